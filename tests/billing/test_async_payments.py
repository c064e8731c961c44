"""Payments that finish later (docs/decisions/0134) and inbound Stripe webhooks (docs/decisions/0135).

A ``requires_action`` PaymentIntent (3-D Secure on an off-session renewal: Stripe's test card
4000002760003184, which the strict dev Stripe's localstripe leaves requiring authentication) and a
``processing`` one (a payment method the strict dev Stripe holds) leave the invoice open and the
subscription off the retry ladder and out of dunning; they are paid when the PaymentIntent's
``payment_intent.succeeded`` arrives at ``/stripe/webhooks/platform`` or, failing that, when the
reconciler's poll finds it. Events are signed here as Stripe signs them
(:func:`devstack.strict_stripe.stripe_signature`) and verified by the ``stripe`` library.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from django.db import connection
from django.test import Client

from billing.gateway_accounts import WebhookAccount
from billing.hosted import hosted_invoice_url
from billing.models import BillingAttempt, Invoice, PaymentAttempt, StripeEvent, Subscription
from billing.services import payments
from billing.services.drain import drain_due, reconcile
from devstack.strict_stripe import generate_webhook_secret, stripe_signature
from dunning.models import DunningRun
from outbox.models import Event
from tests.billing.conftest import DECLINING_CARD, age_payment_attempts, events

AUTHENTICATION_CARD = "4000002760003184"  # Stripe's "authentication required on all transactions" card
SECRET = generate_webhook_secret()
URL = "/stripe/webhooks/platform"


@pytest.fixture(autouse=True)
def _webhook_secret(settings):
    settings.STRIPE_WEBHOOK_SECRET = SECRET


def _drain(tenant):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


def _event(type_: str, obj: dict, *, event_id: str | None = None) -> dict:
    return {
        "id": event_id or f"evt_{type_.replace('.', '_')}_{time.monotonic_ns()}",
        "object": "event",
        "api_version": "2024-06-20",
        "created": int(time.time()),
        "livemode": False,
        "type": type_,
        "data": {"object": obj},
    }


def _post(event: dict, *, secret: str = SECRET, timestamp: int | None = None, slug: str = "platform", header=True):
    payload = json.dumps(event).encode()
    headers = {}
    if header:
        headers["HTTP_STRIPE_SIGNATURE"] = stripe_signature(payload, secret, timestamp or int(time.time()))
    return Client().post(f"/stripe/webhooks/{slug}", data=payload, content_type="application/json", **headers)


def _intent(stripe_client, payment_intent_id: str) -> dict:
    """The PaymentIntent as Stripe would put it in an event (retrieved from the gateway)."""
    return stripe_client.v1.payment_intents.retrieve(payment_intent_id).to_dict()


def _deliver(stripe_client, type_: str, payment_intent_id: str, **kw):
    response = _post(_event(type_, _intent(stripe_client, payment_intent_id)), **kw)
    assert response.status_code == 200, response.content
    return response.json()


def _requires_action(book, tenant):
    """A subscription whose renewal charge needs the customer's authentication."""
    customer = book.customer(tenant, card=AUTHENTICATION_CARD)
    sub = book.subscription(customer, book.price(tenant))
    run = _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    return sub, invoice, run


def _processing(book, tenant, stripe_proxy):
    """A subscription whose first charge answered ``processing``."""
    customer = book.customer(tenant)
    stripe_proxy.hold_processing(customer.default_payment_method)
    sub = book.subscription(customer, book.price(tenant))
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (attempt.outcome, attempt.payment_intent_status) == ("unknown", "processing")
    return sub, invoice


def _paid_once(invoice) -> None:
    """The invoice is paid by exactly one recorded payment, told once."""
    invoice.refresh_from_db()
    assert invoice.status == "paid"
    assert PaymentAttempt.objects.filter(invoice=invoice, outcome="succeeded").count() == 1
    assert len(events("invoice.paid", data__id=invoice.id)) == 1


# ------------------------------------------------------------------ requires_action


def test_requires_action_tells_the_tenant_and_is_neither_a_decline_nor_a_ladder_failure(book, tenant):
    sub, invoice, run = _requires_action(book, tenant)

    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert invoice.status == "open"
    assert (attempt.outcome, attempt.payment_intent_status, attempt.decline_code) == ("unknown", "requires_action", "")
    (told,) = events("invoice.payment_action_required")
    assert told.data["id"] == invoice.id and told.data["status"] == "open"
    intent = told.data["payment_intent"]
    assert intent["id"] == invoice.payment_intent_id
    assert intent["client_secret"].startswith(f"{invoice.payment_intent_id}_secret_")
    assert intent["status"] == "requires_action" and intent["next_action"]["type"] == "use_stripe_sdk"
    # The customer's own page, where the payment can be confirmed (tests/billing/test_hosted_invoice.py).
    assert told.data["hosted_invoice_url"] == hosted_invoice_url(invoice) is not None
    # Not a decline (no dunning, not past_due), not a failure (no ladder step).
    assert events("invoice.payment_failed") == [] and not DunningRun.objects.exists()
    assert (sub.status, sub.billing_failure_count, sub.next_billing_attempt_at, sub.periods_billed) == (
        "active",
        0,
        None,
        1,
    )
    assert events("subscription.billing_failed") == [] and events("subscription.past_due") == []
    assert BillingAttempt.objects.get(run=run).outcome == "payment_pending"
    run.refresh_from_db()
    assert (run.billed, run.failed) == (1, 0)


def test_requires_action_is_paid_by_the_inbound_succeeded_event(book, tenant, stripe_proxy, stripe_client):
    sub, invoice, _run = _requires_action(book, tenant)

    stripe_proxy.complete_action(invoice.payment_intent_id, "succeeded")
    receipt = _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)

    assert receipt["result"] == "applied" and receipt["duplicate"] is False
    _paid_once(invoice)
    sub.refresh_from_db()
    assert (sub.status, sub.periods_billed) == ("active", 1)
    assert StripeEvent.objects.get().invoice_id == invoice.id
    assert len(events("invoice.payment_action_required")) == 1


def test_requires_action_is_paid_by_the_polling_fallback_at_its_cadence(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice, _run = _requires_action(book, tenant)
    stripe_proxy.complete_action(invoice.payment_intent_id, "succeeded")
    stripe_proxy.clear()

    # Within the poll interval the reconciler does not even ask.
    reconcile(livemode=False)
    assert stripe_proxy.entries("GET /v1/payment_intents") == []
    invoice.refresh_from_db()
    assert invoice.status == "open"

    age_payment_attempts(invoice=invoice)
    counts = reconcile(livemode=False)

    assert counts["payments_resolved"] == 1
    assert [e.request.line for e in stripe_proxy.entries("GET /v1/payment_intents")] == [
        f"GET /v1/payment_intents/{invoice.payment_intent_id}"
    ]
    assert stripe_proxy.entries("POST /v1/payment_intents") == []  # looked up, never re-sent
    _paid_once(invoice)


def test_a_poll_that_finds_it_still_requiring_action_tells_the_tenant_only_once(book, tenant, stripe_proxy):
    _sub, invoice, _run = _requires_action(book, tenant)
    age_payment_attempts(invoice=invoice)

    counts = reconcile(livemode=False)

    assert counts["payments_unresolved"] == 1
    assert len(events("invoice.payment_action_required")) == 1
    assert PaymentAttempt.objects.get(invoice=invoice).payment_intent_status == "requires_action"


def test_failed_authentication_is_a_decline_by_the_normal_rules(book, tenant, stripe_proxy, stripe_client):
    sub, invoice, _run = _requires_action(book, tenant)

    stripe_proxy.complete_action(invoice.payment_intent_id, "failed")
    receipt = _deliver(stripe_client, "payment_intent.payment_failed", invoice.payment_intent_id)

    assert receipt["result"] == "applied"
    invoice.refresh_from_db()
    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (invoice.status, attempt.outcome, attempt.decline_code) == (
        "open",
        "declined",
        "payment_intent_authentication_failure",
    )
    assert (sub.status, sub.periods_billed) == ("past_due", 1)
    assert DunningRun.objects.get(invoice=invoice).status == "active"
    assert len(events("invoice.payment_failed")) == 1


def test_a_payment_made_by_the_customer_after_a_decline_pays_the_invoice(
    book, tenant, stripe_proxy, stripe_client, make_card
):
    """Stripe lets the customer pay a declined PaymentIntent on-session with its client_secret: its event pays."""
    sub = book.subscribed(tenant, card=DECLINING_CARD)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    assert DunningRun.objects.get(invoice=invoice).status == "active"
    # The customer's own confirmation, with a card that works (not an attempt of ours).
    stripe_client.v1.payment_intents.confirm(invoice.payment_intent_id, params={"payment_method": make_card()})

    receipt = _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)

    assert receipt["result"] == "applied"
    _paid_once(invoice)
    attempts = list(PaymentAttempt.objects.filter(invoice=invoice).order_by("attempt_number"))
    assert [(a.outcome, a.idempotency_key) for a in attempts] == [
        ("declined", attempts[0].idempotency_key),
        ("succeeded", ""),
    ]
    assert DunningRun.objects.get(invoice=invoice).status != "active"
    sub.refresh_from_db()
    assert sub.status == "active"


# ------------------------------------------------------------------ processing


def test_processing_waits_off_the_ladder(book, tenant, stripe_proxy):
    sub, _invoice = _processing(book, tenant, stripe_proxy)

    sub.refresh_from_db()
    assert (sub.status, sub.billing_failure_count, sub.next_billing_attempt_at, sub.periods_billed) == (
        "active",
        0,
        None,
        1,
    )
    assert events("subscription.billing_failed") == [] and events("invoice.paid") == []
    assert events("invoice.payment_action_required") == []


def test_processing_paid_by_an_event_delivered_before_the_reconciler(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")

    _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)
    age_payment_attempts(invoice=invoice)
    counts = reconcile(livemode=False)

    assert counts["payments_resolved"] == counts["payments_unresolved"] == 0
    _paid_once(invoice)


def test_processing_paid_by_an_event_delivered_after_the_reconciler(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")

    age_payment_attempts(invoice=invoice)
    assert reconcile(livemode=False)["payments_resolved"] == 1
    receipt = _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)

    assert receipt["result"] == "no_change"
    _paid_once(invoice)


def test_processing_paid_by_an_event_delivered_while_the_reconciler_runs(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    age_payment_attempts(invoice=invoice)
    # The reconciler's lookup is held at the gateway while the event arrives.
    stripe_proxy.fail_next("delay", match="GET /v1/payment_intents", delay_s=1.5)
    counts = {}

    def run():
        try:
            counts.update(reconcile(livemode=False))
        finally:
            connection.close()

    aged = PaymentAttempt.objects.get(invoice=invoice).started_at
    reconciler = threading.Thread(target=run)
    reconciler.start()
    deadline = time.monotonic() + 5
    # The reservation (committed before the lookup is sent) moves started_at.
    while PaymentAttempt.objects.get(invoice=invoice).started_at == aged and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the lookup is in its delay now
    receipt = _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)
    recorded_by_the_event = PaymentAttempt.objects.get(invoice=invoice).outcome
    reconciler.join(10)

    assert (receipt["result"], recorded_by_the_event) == ("applied", "succeeded")
    assert counts["payments_resolved"] == 1  # its lookup found the payment recorded: nothing twice
    _paid_once(invoice)


def test_payment_failed_after_processing_is_a_decline_by_the_normal_rules(book, tenant, stripe_proxy, stripe_client):
    sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "failed", decline_code="insufficient_funds")

    _deliver(stripe_client, "payment_intent.payment_failed", invoice.payment_intent_id)

    invoice.refresh_from_db()
    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (invoice.status, attempt.outcome, attempt.decline_code) == ("open", "declined", "insufficient_funds")
    assert (sub.status, sub.periods_billed, sub.billing_failure_count) == ("past_due", 1, 0)
    assert DunningRun.objects.get(invoice=invoice).status == "active"


# ------------------------------------------------------------------ the inbound endpoint


def _paid_invoice(book, tenant):
    sub = book.subscribed(tenant)
    _drain(tenant)
    return Invoice.objects.get(subscription=sub)


def test_a_bad_or_missing_signature_is_400_and_writes_nothing(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    event = _event("payment_intent.succeeded", _intent(stripe_client, invoice.payment_intent_id))
    before = Event.objects.count()

    wrong = _post(event, secret=generate_webhook_secret())
    missing = _post(event, header=False)
    tampered_payload = json.dumps(event).encode()
    tampered = Client().post(
        URL,
        data=tampered_payload.replace(b'"livemode": false', b'"livemode": true'),
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=stripe_signature(tampered_payload, SECRET, int(time.time())),
    )

    for response in (wrong, missing, tampered):
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "signature_invalid"
    assert not StripeEvent.objects.exists() and Event.objects.count() == before
    invoice.refresh_from_db()
    assert invoice.status == "open"


def test_a_stale_timestamp_is_400_and_writes_nothing(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    event = _event("payment_intent.succeeded", _intent(stripe_client, invoice.payment_intent_id))

    stale = _post(event, timestamp=int(time.time()) - 301)
    fresh_enough = _post(event, timestamp=int(time.time()) - 240)  # negative control: inside the tolerance

    assert stale.status_code == 400 and stale.json()["error"]["code"] == "signature_invalid"
    assert fresh_enough.status_code == 200
    assert StripeEvent.objects.count() == 1


def test_an_unknown_account_or_no_secret_is_404(book, tenant, settings):
    event = _event("payment_intent.succeeded", {"id": "pi_x", "object": "payment_intent", "status": "succeeded"})
    assert _post(event, slug="acct_nobody").status_code == 404
    for slug in ("%00", "acct%00x", "%ED%A0%80"):  # a NUL, a lone surrogate's bytes: no account, not a 500
        response = _post(event, slug=slug)
        assert (response.status_code, response.json()["error"]["code"]) == (404, "resource_missing"), slug
    settings.STRIPE_WEBHOOK_SECRET = ""
    response = _post(event)
    assert response.status_code == 404 and response.json()["error"]["code"] == "resource_missing"
    assert not StripeEvent.objects.exists()


def test_a_body_that_is_no_event_is_400(book, tenant):
    for payload in (b"not json", b"[]", json.dumps({"id": "evt_1", "type": "x", "data": []}).encode()):
        response = Client().post(
            URL,
            data=payload,
            content_type="application/json",
            HTTP_STRIPE_SIGNATURE=stripe_signature(payload, SECRET, int(time.time())),
        )
        assert response.status_code == 400, payload
    assert not StripeEvent.objects.exists()


def test_a_duplicate_delivery_is_a_no_op(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    event = _event("payment_intent.succeeded", _intent(stripe_client, invoice.payment_intent_id))

    first, second = _post(event), _post(event)

    assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
    assert second.json()["result"] == "applied"
    assert StripeEvent.objects.count() == 1
    _paid_once(invoice)


def test_failed_after_succeeded_leaves_the_invoice_paid(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    processing = _intent(stripe_client, invoice.payment_intent_id)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id)
    # A payment_failed that Stripe sent earlier (its object is stale) arrives last.
    stale = {
        **processing,
        "status": "requires_payment_method",
        "last_payment_error": {"code": "card_declined", "decline_code": "generic_decline"},
    }

    response = _post(_event("payment_intent.payment_failed", stale))

    assert response.status_code == 200 and response.json()["result"] == "no_change"
    _paid_once(invoice)
    assert events("invoice.payment_failed") == [] and not DunningRun.objects.exists()


def test_a_stale_failure_of_an_open_invoice_is_rechecked_at_the_gateway(book, tenant, stripe_proxy, stripe_client):
    """The event says failed, the PaymentIntent (retrieved) has succeeded since: it is paid, not dunned."""
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stale = {
        **_intent(stripe_client, invoice.payment_intent_id),
        "status": "requires_payment_method",
        "last_payment_error": {"code": "card_declined", "decline_code": "generic_decline"},
    }
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    stripe_proxy.clear()

    response = _post(_event("payment_intent.payment_failed", stale))

    assert response.json()["result"] == "applied"
    assert [e.request.line for e in stripe_proxy.entries("GET /v1/payment_intents")] == [
        f"GET /v1/payment_intents/{invoice.payment_intent_id}"
    ]
    _paid_once(invoice)
    assert not DunningRun.objects.exists()


def test_negative_control_a_stale_failure_taken_as_delivered_duns_a_paid_payment(
    book, tenant, stripe_proxy, stripe_client, monkeypatch, no_doctor
):
    from billing import stripe_webhooks

    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stale = {
        **_intent(stripe_client, invoice.payment_intent_id),
        "status": "requires_payment_method",
        "last_payment_error": {"code": "card_declined", "decline_code": "generic_decline"},
    }
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    monkeypatch.setattr(stripe_webhooks, "FINAL_STATUSES", frozenset({"succeeded", "requires_payment_method"}))

    _post(_event("payment_intent.payment_failed", stale))

    invoice.refresh_from_db()
    assert invoice.status == "open" and DunningRun.objects.filter(invoice=invoice).exists()


def test_the_gateway_down_during_a_recheck_is_503_and_the_redelivery_acts(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "failed", decline_code="insufficient_funds")
    event = _event("payment_intent.payment_failed", _intent(stripe_client, invoice.payment_intent_id))
    stripe_proxy.fail_next("500", match="GET /v1/payment_intents")

    down = _post(event)
    again = _post(event)

    assert down.status_code == 503 and down.json()["error"]["code"] == "gateway_unavailable"
    assert again.status_code == 200 and again.json()["result"] == "applied"
    assert PaymentAttempt.objects.get(invoice=invoice).outcome == "declined"


def test_an_account_touches_only_its_own_tenants_invoices(book, tenant, stripe_proxy, stripe_client, monkeypatch):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    other = book.tenant("Other")
    account = WebhookAccount(slug="acct_other", signing_secret=SECRET, tenant_id=other.id, livemode=False)
    monkeypatch.setattr(
        "billing.api.stripe_webhooks.webhook_account", lambda slug: account if slug == "acct_other" else None
    )

    receipt = _deliver(stripe_client, "payment_intent.succeeded", invoice.payment_intent_id, slug="acct_other")

    assert receipt["result"] == "no_invoice"
    invoice.refresh_from_db()
    assert invoice.status == "open"
    assert StripeEvent.objects.get().tenant_id is None


def test_refunds_and_disputes_are_recorded_and_told_to_the_tenant(book, tenant, stripe_client):
    invoice = _paid_invoice(book, tenant)
    charge = {
        "id": "ch_refunded",
        "object": "charge",
        "amount": invoice.amount_paid,
        "amount_refunded": 400,
        "currency": invoice.currency,
        "payment_intent": invoice.payment_intent_id,
        "refunded": False,
    }
    dispute = {
        "id": "dp_1",
        "object": "dispute",
        "amount": invoice.amount_paid,
        "currency": invoice.currency,
        "charge": "ch_refunded",
        "payment_intent": invoice.payment_intent_id,
        "reason": "fraudulent",
        "status": "needs_response",
    }

    refunded = _post(_event("charge.refunded", charge))
    disputed = _post(_event("charge.dispute.created", dispute))

    assert refunded.json()["result"] == disputed.json()["result"] == "applied"
    (told_refund,) = events("charge.refunded")
    assert (told_refund.tenant_id, told_refund.data["invoice"], told_refund.data["amount_refunded"]) == (
        tenant.id,
        invoice.id,
        400,
    )
    (told_dispute,) = events("charge.dispute.created")
    assert (told_dispute.data["object"], told_dispute.data["reason"], told_dispute.data["amount"]) == (
        "dispute",
        "fraudulent",
        invoice.amount_paid,
    )
    assert {e.type for e in StripeEvent.objects.filter(invoice=invoice)} == {
        "charge.refunded",
        "charge.dispute.created",
    }
    invoice.refresh_from_db()
    assert invoice.status == "paid"


def test_a_redelivered_refund_is_told_to_the_tenant_once(book, tenant):
    invoice = _paid_invoice(book, tenant)
    charge = {"id": "ch_1", "object": "charge", "amount": 1000, "amount_refunded": 1000, "currency": "usd"}
    event = _event("charge.refunded", {**charge, "payment_intent": invoice.payment_intent_id, "refunded": True})

    first, second = _post(event), _post(event)

    assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
    assert len(events("charge.refunded")) == 1


def test_an_unknown_event_type_is_200_and_ignored(book, tenant):
    response = _post(_event("customer.created", {"id": "cus_1", "object": "customer"}))

    assert response.status_code == 200 and response.json()["result"] == "ignored"
    assert StripeEvent.objects.get().result == "ignored"


# ------------------------------------------------------------------ the strict dev Stripe sends them


def test_the_strict_dev_stripe_sends_signed_events_that_pay_the_invoice(book, tenant, stripe_proxy, live_server):
    sender = stripe_proxy.send_webhooks_to(f"{live_server.url}{URL}", SECRET, retry_delays_s=(0.2,))
    try:
        _sub, invoice, _run = _requires_action(book, tenant)
        assert sender.wait_idle()
        stripe_proxy.complete_action(invoice.payment_intent_id, "succeeded")
        assert sender.wait_idle()
    finally:
        stripe_proxy.stop_webhooks()

    types = [d.event["type"] for d in sender.deliveries]
    assert types == ["payment_intent.created", "payment_intent.requires_action", "payment_intent.succeeded"]
    assert all(d.statuses == [200] for d in sender.deliveries)
    _paid_once(invoice)  # no reconciler ran
    assert set(StripeEvent.objects.values_list("result", flat=True)) == {"ignored", "applied"}


def test_a_processing_payment_that_settles_is_told_by_the_strict_dev_stripe(book, tenant, stripe_proxy, live_server):
    sender = stripe_proxy.send_webhooks_to(f"{live_server.url}{URL}", SECRET, retry_delays_s=(0.2,))
    try:
        _sub, invoice = _processing(book, tenant, stripe_proxy)
        stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
        assert sender.wait_idle()
    finally:
        stripe_proxy.stop_webhooks()

    assert [d.event["type"] for d in sender.deliveries][-2:] == [
        "payment_intent.processing",
        "payment_intent.succeeded",
    ]
    _paid_once(invoice)


def test_payments_pending_interval_is_never_below_the_in_flight_window(settings):
    settings.HARDCOUNT_PENDING_PAYMENT_POLL_S = 1
    assert payments.pending_poll_interval() == payments.in_flight_window()
    settings.HARDCOUNT_PENDING_PAYMENT_POLL_S = 3600
    assert payments.pending_poll_interval().total_seconds() == 3600


def test_subscription_on_a_pending_payment_is_not_due_again(book, tenant, stripe_proxy):
    sub, _invoice = _processing(book, tenant, stripe_proxy)
    run = _drain(tenant)
    assert run.attempted == 0
    assert Subscription.objects.get(pk=sub.pk).periods_billed == 1


def test_the_platform_account_does_not_touch_a_tenant_with_an_account_of_its_own(
    book, tenant, stripe_proxy, stripe_client
):
    """A tenant's own account's events arrive at its own slug; the platform's URL cannot pay its invoices."""
    from billing.gateway_accounts import set_account

    _sub, invoice = _processing(book, tenant, stripe_proxy)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")
    own_secret = generate_webhook_secret()
    account, _ = set_account(
        tenant_id=tenant.id, livemode=False, secret_key="sk_test_ownAccount000000000000001", webhook_secret=own_secret
    )
    event = _event("payment_intent.succeeded", _intent(stripe_client, invoice.payment_intent_id))

    at_platform = _post(event)
    assert at_platform.status_code == 200 and at_platform.json()["result"] == "no_invoice"
    invoice.refresh_from_db()
    assert invoice.status == "open"

    at_own = _post(event, secret=own_secret, slug=account.slug)
    assert at_own.status_code == 200 and at_own.json()["result"] == "applied", at_own.content
    _paid_once(invoice)
