"""Idempotency keys expire (docs/decisions/0129-idempotency-keys-expire.md): an open attempt is never re-sent
under a key the gateway may have forgotten, and a processing PaymentIntent is resolved by retrieval.

Stripe forgets a key once it is 24 hours old; the strict dev Stripe forgets one when told
(``expire_key``). "Past the window" below is an attempt whose ``first_sent_at`` is a day old and
whose key the gateway has forgotten. Every test counts the invoice's PaymentIntents at the gateway
itself (straight at localstripe, by the ``hardcount_invoice`` metadata), and each negative control
shows the same scenario making a second one once the lookup is taken away.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import stripe
from django.db.models import F

from billing import gateway as gw
from billing.models import Customer, Invoice, PaymentAttempt, Subscription
from billing.services import close as close_module
from billing.services import payments
from billing.services.drain import drain_due, reconcile
from billing.services.invoices import pay_invoice
from dunning.models import DunningRun
from hardcount.times import database_now
from ops import doctor
from tests.billing.conftest import DECLINING_CARD, VISA, age_payment_attempts


class Killed(BaseException):
    """The process died here."""


def _drain(tenant, **kw):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, **kw)


def _intents_at_gateway(stripe_client, invoice) -> list:
    """The invoice's PaymentIntents as the gateway has them (every PaymentIntent listed, matched by metadata)."""
    return [
        intent
        for intent in stripe_client.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter()
        if (intent.metadata.to_dict() if intent.metadata else {}).get(gw.INVOICE_METADATA_KEY) == invoice.id
    ]


def _past_the_window(stripe_proxy, invoice, *keys: str) -> None:
    """The invoice's attempts were first sent a day ago, and the gateway has forgotten their keys (and ``keys``)."""
    PaymentAttempt.objects.filter(invoice=invoice).update(first_sent_at=F("first_sent_at") - timedelta(days=1))
    age_payment_attempts(invoice=invoice)
    for key in (*PaymentAttempt.objects.filter(invoice=invoice).values_list("idempotency_key", flat=True), *keys):
        stripe_proxy.expire_key(key)


def _due_again(sub) -> None:
    """The retry ladder's wait is over."""
    Subscription.objects.filter(pk=sub.pk).update(next_billing_attempt_at=database_now())


def _creates(stripe_proxy, action=None):
    return stripe_proxy.entries("POST /v1/payment_intents", action)


def _charged_then_lost(book, tenant, stripe_proxy):
    """A subscription whose first charge succeeded at the gateway but whose answer was lost (a reset)."""
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next("reset", match="POST /v1/payment_intents")
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (invoice.status, attempt.outcome, invoice.payment_intent_id) == ("open", "unknown", "")
    assert attempt.first_sent_at is not None
    return sub, invoice


# ------------------------------------------------------------------ an unknown attempt past the window


def test_an_unknown_attempt_past_the_window_is_found_by_listing_and_never_resent(
    book, tenant, stripe_proxy, stripe_client
):
    sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    _past_the_window(stripe_proxy, invoice)
    stripe_proxy.clear()

    counts = reconcile(livemode=False)

    invoice.refresh_from_db()
    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    (intent,) = _intents_at_gateway(stripe_client, invoice)
    assert counts["payments_resolved"] == 1
    assert (invoice.status, attempt.outcome, attempt.attempt_number) == ("paid", "succeeded", 1)
    assert invoice.payment_intent_id == attempt.payment_intent_id == intent.id
    assert (sub.periods_billed, sub.billing_failure_count) == (1, 0)
    assert _creates(stripe_proxy) == []  # nothing re-sent under the forgotten key
    assert [e.action for e in stripe_proxy.entries("GET /v1/payment_intents")] == ["forwarded"]
    gateway_customer = Customer.objects.get(pk=sub.customer_id).gateway_customer_id
    assert stripe_proxy.entries("GET /v1/payment_intents")[0].request.path.startswith(
        f"/v1/payment_intents?customer={gateway_customer}"
    )
    assert _drain(tenant).attempted == 0


def test_negative_control_without_the_lookup_a_resend_under_the_expired_key_charges_twice(
    book, tenant, stripe_proxy, stripe_client, monkeypatch
):
    _sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    _past_the_window(stripe_proxy, invoice)
    monkeypatch.setattr(payments, "must_look_up", lambda attempt, *, now: False)

    reconcile(livemode=False)

    invoice.refresh_from_db()
    assert invoice.status == "paid"
    assert len(_intents_at_gateway(stripe_client, invoice)) == 2  # the double charge the lookup prevents
    assert [e.action for e in _creates(stripe_proxy)] == ["reset", "forwarded"]
    # The doctor's gateway comparison sees it.
    result = doctor.check_gateway()
    assert any(f"{invoice.id}: 2 succeeded PaymentIntents at the gateway" in e for e in result.examples), result


def test_negative_control_a_lookup_that_finds_nothing_lets_a_second_payment_intent_be_created(
    book, tenant, stripe_proxy, stripe_client, monkeypatch
):
    sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    _past_the_window(stripe_proxy, invoice)
    monkeypatch.setattr(gw.Gateway, "find_invoice_payment_intents", lambda self, *a, **kw: [])

    reconcile(livemode=False)
    first = PaymentAttempt.objects.get(invoice=invoice)
    assert (first.outcome, first.http_status) == ("error", 200)  # "none exists": a final answer
    _due_again(sub)
    _drain(tenant)

    invoice.refresh_from_db()
    assert invoice.status == "paid"
    assert len(_intents_at_gateway(stripe_client, invoice)) == 2
    assert _creates(stripe_proxy)[-1].request.idempotency_key == f"{gw.create_key(invoice.id)}:2"


def test_a_lookup_the_gateway_refuses_proves_nothing_and_is_tried_again(
    book, tenant, stripe_proxy, stripe_client, monkeypatch
):
    _sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    _past_the_window(stripe_proxy, invoice)

    def refuse(self, *args, **kwargs):
        raise stripe.InvalidRequestError("Unexpected customer", param="customer", http_status=400)

    with monkeypatch.context() as patch:
        patch.setattr(gw.Gateway, "find_invoice_payment_intents", refuse)
        reconcile(livemode=False)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (attempt.outcome, attempt.http_status) == ("unknown", 400)  # still open: no new key for it
    age_payment_attempts(invoice=invoice)

    reconcile(livemode=False)

    invoice.refresh_from_db()
    assert invoice.status == "paid"
    assert PaymentAttempt.objects.filter(invoice=invoice).count() == 1
    assert len(_intents_at_gateway(stripe_client, invoice)) == 1
    assert [e.action for e in _creates(stripe_proxy)] == ["reset"]


def test_an_attempt_that_never_reached_the_gateway_is_created_anew_once_the_lookup_finds_none(
    book, tenant, stripe_proxy, stripe_client, settings
):
    settings.HARDCOUNT_GATEWAY_TIMEOUT_S = 0.3
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next("timeout", match="POST /v1/payment_intents", hold_s=0.6)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    assert PaymentAttempt.objects.get(invoice=invoice).outcome == "unknown"
    _past_the_window(stripe_proxy, invoice)

    counts = reconcile(livemode=False)

    first = PaymentAttempt.objects.get(invoice=invoice)
    assert counts["payments_unresolved"] == 1
    assert (first.outcome, first.http_status, invoice.status) == ("error", 200, "open")
    assert "no PaymentIntent at the gateway" in first.error_message
    assert _intents_at_gateway(stripe_client, invoice) == []
    assert [e.action for e in _creates(stripe_proxy)] == ["timeout"]  # the lookup sent nothing
    _due_again(sub)

    _drain(tenant)

    invoice.refresh_from_db()
    attempts = list(PaymentAttempt.objects.filter(invoice=invoice).order_by("attempt_number"))
    (intent,) = _intents_at_gateway(stripe_client, invoice)
    assert invoice.status == "paid"
    assert [(a.attempt_number, a.outcome) for a in attempts] == [(1, "error"), (2, "succeeded")]
    assert attempts[1].idempotency_key == f"{gw.create_key(invoice.id)}:2"  # a fresh key, never the old one
    assert invoice.payment_intent_id == intent.id


def test_a_charge_whose_gateway_customer_was_never_recorded_is_found_through_the_customer_list(
    book, tenant, stripe_proxy, stripe_client, monkeypatch
):
    sub = book.subscribed(tenant)

    def die(plan, result):
        raise Killed("after the charge, before its record")

    monkeypatch.setattr(close_module.hooks, "after_charge", die)
    with pytest.raises(Killed):
        _drain(tenant, concurrency=1)
    monkeypatch.setattr(close_module.hooks, "after_charge", None)
    invoice = Invoice.objects.get(subscription=sub)
    customer = Customer.objects.get(pk=sub.customer_id)
    assert customer.gateway_customer_id == ""
    (created,) = _intents_at_gateway(stripe_client, invoice)
    _past_the_window(stripe_proxy, invoice)

    reconcile(livemode=False)

    invoice.refresh_from_db()
    customer.refresh_from_db()
    assert (invoice.status, invoice.payment_intent_id) == ("paid", created.id)
    assert customer.gateway_customer_id == created.customer  # learned by the lookup
    assert len(_intents_at_gateway(stripe_client, invoice)) == 1
    assert [e.action for e in _creates(stripe_proxy)] == ["forwarded"]


def test_a_confirmation_past_the_window_is_resolved_by_retrieving_the_invoices_payment_intent(
    book, tenant, stripe_proxy, stripe_client, make_card
):
    sub = book.subscribed(tenant, card=DECLINING_CARD)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.payment_intent_id
    Customer.objects.filter(pk=sub.customer_id).update(default_payment_method=make_card(VISA))
    stripe_proxy.fail_next("reset", match=f"POST /v1/payment_intents/{invoice.payment_intent_id}/confirm")
    pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    retry = PaymentAttempt.objects.get(invoice=invoice, attempt_number=2)
    assert (retry.outcome, retry.idempotency_key) == ("unknown", gw.attempt_key(invoice.id, 2))
    _past_the_window(stripe_proxy, invoice)
    stripe_proxy.clear()

    invoice, attempt, _ = pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)

    assert (invoice.status, attempt.pk, attempt.outcome) == ("paid", retry.pk, "succeeded")
    assert _creates(stripe_proxy) == []
    assert [e.request.line for e in stripe_proxy.entries("GET /v1/payment_intents")] == [
        f"GET /v1/payment_intents/{invoice.payment_intent_id}"
    ]
    assert len(_intents_at_gateway(stripe_client, invoice)) == 1
    assert DunningRun.objects.get(invoice=invoice).status == "recovered"


# ------------------------------------------------------------------ inside the window: behaviour kept


def test_inside_the_window_an_unknown_attempt_is_still_resent_under_its_key(book, tenant, stripe_proxy, stripe_client):
    _sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    PaymentAttempt.objects.filter(invoice=invoice).update(
        first_sent_at=F("first_sent_at") - payments.key_safe_window() + timedelta(minutes=5)
    )
    age_payment_attempts(invoice=invoice)

    reconcile(livemode=False)

    invoice.refresh_from_db()
    assert invoice.status == "paid"
    sent = _creates(stripe_proxy)
    assert [e.action for e in sent] == ["reset", "replayed"]
    assert {e.request.idempotency_key for e in sent} == {gw.create_key(invoice.id)}
    assert stripe_proxy.entries("GET /v1/payment_intents") == []
    assert len(_intents_at_gateway(stripe_client, invoice)) == 1


def test_an_attempt_with_no_recorded_first_send_is_looked_up(book, tenant, stripe_proxy, stripe_client):
    # Attempts reserved before first_sent_at existed: their key's age is unknown.
    _sub, invoice = _charged_then_lost(book, tenant, stripe_proxy)
    PaymentAttempt.objects.filter(invoice=invoice).update(first_sent_at=None)
    age_payment_attempts(invoice=invoice)

    reconcile(livemode=False)

    invoice.refresh_from_db()
    assert invoice.status == "paid"
    assert [e.action for e in _creates(stripe_proxy)] == ["reset"]
    assert len(_intents_at_gateway(stripe_client, invoice)) == 1


def test_the_safe_window_is_the_setting(settings):
    now = datetime.now(UTC)
    attempt = PaymentAttempt(outcome="unknown", idempotency_key="hc:in_x:create", first_sent_at=now)
    assert payments.key_safe_window() == timedelta(hours=23)
    attempt.first_sent_at = now - timedelta(hours=22, minutes=59)
    assert payments.reuses_key(attempt, now=now)
    attempt.first_sent_at = now - timedelta(hours=23)
    assert payments.must_look_up(attempt, now=now) and not payments.reuses_key(attempt, now=now)
    settings.HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S = 60
    attempt.first_sent_at = now - timedelta(seconds=59)
    assert payments.reuses_key(attempt, now=now)
    attempt.first_sent_at = now - timedelta(seconds=61)
    assert payments.must_look_up(attempt, now=now)
    attempt.first_sent_at, attempt.payment_intent_status = now, gw.PROCESSING
    assert payments.must_look_up(attempt, now=now)


# ------------------------------------------------------------------ processing PaymentIntents


def _processing(book, tenant, stripe_proxy):
    """A subscription whose first charge answered ``processing``."""
    customer = book.customer(tenant)
    stripe_proxy.hold_processing(customer.default_payment_method)
    sub = book.subscription(customer, book.price(tenant))
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (attempt.outcome, attempt.payment_intent_status) == ("unknown", "processing")
    assert invoice.payment_intent_id == attempt.payment_intent_id != ""
    return sub, invoice


@pytest.mark.parametrize("settles", ["succeeded", "failed"])
def test_a_processing_payment_intent_is_retrieved_never_resent_inside_and_past_the_window(
    book, tenant, stripe_proxy, stripe_client, settles
):
    sub, invoice = _processing(book, tenant, stripe_proxy)
    age_payment_attempts(invoice=invoice)
    stripe_proxy.clear()

    # Inside the window, still processing: retrieved, and it waits.
    counts = reconcile(livemode=False)

    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert counts["payments_unresolved"] == 1
    assert (attempt.outcome, attempt.payment_intent_status) == ("unknown", "processing")
    assert _creates(stripe_proxy) == []
    assert [e.request.line for e in stripe_proxy.entries("GET /v1/payment_intents")] == [
        f"GET /v1/payment_intents/{invoice.payment_intent_id}"
    ]

    # It settles at the gateway; the key is forgotten meanwhile.
    stripe_proxy.settle(invoice.payment_intent_id, settles, decline_code="insufficient_funds")
    _past_the_window(stripe_proxy, invoice)

    counts = reconcile(livemode=False)

    invoice.refresh_from_db()
    sub.refresh_from_db()
    attempt.refresh_from_db()
    (intent,) = _intents_at_gateway(stripe_client, invoice)
    assert _creates(stripe_proxy) == []
    assert intent.id == invoice.payment_intent_id
    if settles == "succeeded":
        assert counts["payments_resolved"] == 1
        assert (invoice.status, attempt.outcome, sub.periods_billed, sub.status) == ("paid", "succeeded", 1, "active")
    else:
        assert (invoice.status, attempt.outcome, attempt.decline_code) == ("open", "declined", "insufficient_funds")
        assert (sub.periods_billed, sub.status) == (1, "past_due")
        assert DunningRun.objects.get(invoice=invoice).status == "active"


def test_negative_control_a_processing_payment_intent_resent_under_its_key_replays_then_charges_twice(
    book, tenant, stripe_proxy, stripe_client, monkeypatch, no_doctor
):
    _sub, invoice = _processing(book, tenant, stripe_proxy)
    monkeypatch.setattr(payments, "must_look_up", lambda attempt, *, now: False)
    age_payment_attempts(invoice=invoice)
    stripe_proxy.settle(invoice.payment_intent_id, "succeeded")

    # Inside the window a re-send only replays "processing", though the payment has succeeded...
    reconcile(livemode=False)
    assert PaymentAttempt.objects.get(invoice=invoice).payment_intent_status == "processing"
    assert [e.action for e in _creates(stripe_proxy)] == ["forwarded", "replayed"]

    # ...and once the key is forgotten it creates a second PaymentIntent.
    _past_the_window(stripe_proxy, invoice)
    reconcile(livemode=False)

    assert [e.action for e in _creates(stripe_proxy)] == ["forwarded", "replayed", "forwarded"]
    assert len(_intents_at_gateway(stripe_client, invoice)) == 2
    (found,) = doctor.run_checks(names=["one_payment_intent_per_invoice"])
    assert found.status == doctor.FAIL  # the books see it too: the attempt names another PaymentIntent


# ------------------------------------------------------------------ the lookup at the gateway


def test_the_lookup_lists_every_page_of_the_customers_payment_intents(stripe_proxy, stripe_client, make_card):
    customer = stripe_client.v1.customers.create(params={"email": "pages@example.com"})
    other = stripe_client.v1.customers.create(params={"email": "other@example.com"})
    pm = make_card(VISA)

    def create(cus, invoice_id):
        return stripe_client.v1.payment_intents.create(
            params={
                "amount": 1000,
                "currency": "usd",
                "customer": cus.id,
                "payment_method": pm,
                "off_session": True,
                "confirm": True,
                "metadata": {gw.INVOICE_METADATA_KEY: invoice_id},
            }
        )

    ours = [create(customer, "in_lookup_a"), create(customer, "in_lookup_b"), create(customer, "in_lookup_c")]
    create(other, "in_lookup_b")

    listed = stripe_client.v1.payment_intents.list(params={"customer": customer.id, "limit": 2})
    assert [i.id for i in listed.data] == [ours[2].id, ours[1].id]  # newest first, as at Stripe
    assert listed.has_more
    gateway = gw.get_gateway()
    assert [i.id for i in gateway.find_invoice_payment_intents(customer.id, "in_lookup_a", page_size=1)] == [ours[0].id]
    assert [i.id for i in gateway.find_invoice_payment_intents(customer.id, "in_lookup_b", page_size=1)] == [ours[1].id]
    assert gateway.find_invoice_payment_intents(customer.id, "in_lookup_z", page_size=1) == []


def test_an_expired_key_runs_again_and_stays_expired_across_a_restart(localstripe_base, tmp_path):
    from devstack.strict_stripe import StrictStripe

    path = tmp_path / "idempotency.jsonl"
    client = lambda proxy: stripe.StripeClient("sk_test_x", base_addresses={"api": proxy.api_base})  # noqa: E731
    proxy = StrictStripe(localstripe_base, store_path=path).start()
    try:
        first = client(proxy).v1.customers.create(params={"email": "ttl@example.com"}, options={"idempotency_key": "k"})
        assert proxy.expire_key("k") and not proxy.expire_key("k")
        assert "k" not in proxy.stored_keys()
    finally:
        proxy.stop()
    proxy = StrictStripe(localstripe_base, store_path=path).start()
    try:
        assert "k" not in proxy.stored_keys()
        again = client(proxy).v1.customers.create(params={"email": "ttl@example.com"}, options={"idempotency_key": "k"})
    finally:
        proxy.stop()
    assert again.id != first.id  # run again, as at Stripe once a key is pruned
