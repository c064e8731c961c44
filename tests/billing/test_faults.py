"""Crash safety and gateway faults (docs/reference/billing.md): every fault goes through tests.stripe_proxy.

A "kill" is simulated in-process by raising a BaseException from a hook between two steps of
the close: nothing after that point runs, exactly as if the process had died there.
"""

from datetime import timedelta

import pytest

from billing.models import BillingAttempt, Invoice, PaymentAttempt, Subscription
from billing.services import close as close_module
from billing.services.drain import drain_due, reconcile
from billing.services.invoices import pay_invoice
from billing.services.ledger import grant_credit
from hardcount.times import database_now
from tests.billing.conftest import DECLINING_CARD, VISA, age_payment_attempts


class Killed(BaseException):
    """The process died here."""


def _drain(tenant, **kw):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, **kw)


def _kill_at(monkeypatch, step):
    def die(*args):
        raise Killed(step)

    monkeypatch.setattr(close_module.hooks, step, die)


def _creates(stripe_proxy, action=None):
    return stripe_proxy.entries("POST /v1/payment_intents", action)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_killed_between_charge_and_record_leaves_one_payment_intent_and_a_paid_invoice(
    book, tenant, stripe_proxy, monkeypatch, concurrency
):
    sub = book.subscribed(tenant)
    _kill_at(monkeypatch, "after_charge")
    with pytest.raises(Killed):
        _drain(tenant, concurrency=concurrency)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == "open"
    assert PaymentAttempt.objects.get(invoice=invoice).outcome == "unknown"  # reserved before the call
    monkeypatch.setattr(close_module.hooks, "after_charge", None)

    assert _drain(tenant).attempted == 1
    # The next run while the attempt may still be in flight does not send it again...
    assert PaymentAttempt.objects.get(invoice=invoice).outcome == "unknown"
    age_payment_attempts(invoice=invoice)  # ...once the in-flight window has passed, it does.
    run = _drain(tenant)

    invoice.refresh_from_db()
    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (run.billed, invoice.status, attempt.outcome, sub.periods_billed) == (1, "paid", "succeeded", 1)
    assert len(_creates(stripe_proxy, "forwarded")) == 1  # exactly one PaymentIntent at the gateway
    assert len(_creates(stripe_proxy, "replayed")) == 1  # the re-send replayed the stored answer
    assert invoice.payment_intent_id == attempt.payment_intent_id == _creates(stripe_proxy)[0].response["id"]


def test_killed_between_invoice_and_charge_charges_once_on_the_next_run(book, tenant, stripe_proxy, monkeypatch):
    sub = book.subscribed(tenant)
    _kill_at(monkeypatch, "after_prepare")
    with pytest.raises(Killed):
        _drain(tenant)
    monkeypatch.setattr(close_module.hooks, "after_prepare", None)
    assert _creates(stripe_proxy) == []
    age_payment_attempts()

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == "paid"
    assert len(_creates(stripe_proxy, "forwarded")) == 1
    assert PaymentAttempt.objects.filter(invoice=invoice).count() == 1


def test_a_reset_after_the_charge_is_unknown_and_the_reconciler_resolves_it_with_the_same_key(
    book, tenant, stripe_proxy
):
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next("reset", match="POST /v1/payment_intents")

    run = _drain(tenant)

    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    sub.refresh_from_db()
    assert (run.failed, attempt.outcome, sub.billing_failure_count, sub.periods_billed) == (1, "unknown", 1, 0)
    age_payment_attempts()

    counts = reconcile(livemode=False)

    attempt.refresh_from_db()
    sub.refresh_from_db()
    assert counts["payments_resolved"] == 1
    assert (attempt.outcome, attempt.invoice.status) == ("succeeded", "paid")
    assert (sub.periods_billed, sub.billing_failure_count, sub.billing_state) == (1, 0, "ok")
    sent = _creates(stripe_proxy)
    assert [e.action for e in sent] == ["reset", "replayed"]
    assert {e.request.idempotency_key for e in sent} == {f"hc:{attempt.invoice_id}:create"}


def test_a_timeout_before_the_gateway_ran_is_sent_again_under_the_same_key(book, tenant, stripe_proxy, settings):
    settings.HARDCOUNT_GATEWAY_TIMEOUT_S = 0.3
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next("timeout", match="POST /v1/payment_intents", hold_s=0.6)
    _drain(tenant)
    assert PaymentAttempt.objects.get(invoice__subscription=sub).outcome == "unknown"
    Subscription.objects.filter(pk=sub.pk).update(next_billing_attempt_at=database_now())
    age_payment_attempts()

    _drain(tenant)

    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    assert (attempt.outcome, attempt.attempt_number) == ("succeeded", 1)
    assert [e.action for e in _creates(stripe_proxy)] == ["timeout", "forwarded"]
    assert len({e.request.idempotency_key for e in _creates(stripe_proxy)}) == 1


# A 429 is the account's rate limit, not the invoice's failure: tests/billing/test_gateway_rate_limits.py.
@pytest.mark.parametrize("status", ["500"])
def test_a_gateway_error_is_a_failure_and_the_ladder_retry_resends_the_same_key(book, tenant, stripe_proxy, status):
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next(status, match="POST /v1/payment_intents")
    _drain(tenant)
    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    assert (attempt.outcome, attempt.http_status) == ("error", int(status))
    assert reconcile(livemode=False)["payments_resolved"] == 0  # the ladder owns this period's retries
    Subscription.objects.filter(pk=sub.pk).update(next_billing_attempt_at=database_now())

    _drain(tenant)

    attempt.refresh_from_db()
    sub.refresh_from_db()
    assert (attempt.outcome, attempt.attempt_number, sub.billing_failure_count) == ("succeeded", 1, 0)
    assert [e.action for e in _creates(stripe_proxy)] == [status, "forwarded"]


def test_a_credit_granted_between_a_decline_and_a_retry_does_not_change_the_amount(
    book, tenant, stripe_proxy, make_card, stripe_client
):
    # Daily, anchored 25 hours ago: period 1 is due as soon as period 0 is closed.
    anchor = database_now() - timedelta(hours=25)
    sub = book.subscribed(tenant, card=DECLINING_CARD, amount=1000, interval="day", anchor=anchor)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.amount_due) == ("open", 1000)

    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=300)
    customer = sub.customer
    customer.default_payment_method = make_card()  # the customer fixes the card
    customer.save(update_fields=["default_payment_method"])
    invoice, attempt, outcome = pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)

    assert (outcome.kind, invoice.status, invoice.amount_paid) == ("billed", "paid", 1000)
    assert (attempt.attempt_number, attempt.amount, attempt.idempotency_key) == (2, 1000, f"hc:{invoice.id}:attempt:2")
    assert stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).amount == 1000
    confirm = stripe_proxy.entries("/confirm", "forwarded")[0]
    assert "amount" not in confirm.request.params  # a confirmation never restates the amount
    customer.refresh_from_db()
    assert customer.credit_balance == 300  # the credit waits for the next invoice

    _drain(tenant)

    following = Invoice.objects.get(subscription=sub, period_start=anchor + timedelta(days=1))
    assert (following.total, following.credit_applied, following.amount_due) == (1000, 300, 700)
    assert following.status == "paid"
    assert stripe_client.v1.payment_intents.retrieve(following.payment_intent_id).amount == 700
    customer.refresh_from_db()
    assert customer.credit_balance == 0


def test_a_credit_granted_before_a_same_key_resend_does_not_change_its_body(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant, amount=1000)
    stripe_proxy.fail_next("timeout_after_forward", match="POST /v1/payment_intents", hold_s=2.5)
    _drain(tenant)
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=300)
    age_payment_attempts()

    reconcile(livemode=False)

    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    assert (attempt.outcome, attempt.amount) == ("succeeded", 1000)
    sent = _creates(stripe_proxy)
    assert [e.action for e in sent] == ["timeout_after_forward", "replayed"]  # same body: no idempotency_error
    assert sent[0].request.params["amount"] == sent[1].request.params["amount"] == "1000"


def test_jpy_amounts_are_sent_without_scaling(book, tenant, stripe_proxy, stripe_client):
    sub = book.subscribed(tenant, amount=1000, currency="jpy")

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    sent = _creates(stripe_proxy, "forwarded")[0].request.params
    assert (sent["amount"], sent["currency"]) == ("1000", "jpy")
    intent = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id)
    assert (intent.amount, intent.currency, intent.status) == (1000, "jpy", "succeeded")


def test_an_invoice_over_the_gateways_eight_digits_is_held_before_the_gateway_and_the_drain_goes_on(
    book, tenant, stripe_proxy
):
    # 2 × 99,999,999 = 199,999,998: no PaymentIntent can take it (Stripe refuses it, 400 amount_too_large, as the
    # strict dev Stripe does: tests/test_strict_stripe.py). The close holds the draft for an operator instead of
    # sending it to be refused on every rung of the ladder (docs/decisions/0217); the period advances.
    sub = book.subscribed(tenant, amount=99_999_999, quantity=2)
    due_at = Subscription.objects.get(pk=sub.pk).next_billing_at

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    invoice = Invoice.objects.get(subscription=sub)
    sub.refresh_from_db()
    assert (run.status, invoice.status, invoice.hold_reason, invoice.total) == (
        "completed",
        "draft",
        "amount_too_large",
        199_999_998,
    )
    assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
    assert _creates(stripe_proxy) == []  # nothing was sent to the gateway
    assert BillingAttempt.objects.get(run=run, subscription=sub).outcome == "held"
    assert sub.billing_failure_count == 0 and sub.next_billing_attempt_at is None and sub.next_billing_at > due_at


@pytest.mark.parametrize(("card", "concurrency"), [(VISA, 1), (VISA, 4), (DECLINING_CARD, 1)])
def test_a_cancel_landing_between_the_charge_and_its_record_leaves_the_subscription_canceled(
    book, tenant, monkeypatch, card, concurrency
):
    from billing.services.catalog import cancel_subscription
    from dunning.models import DunningRun
    from outbox.models import Event

    sub = book.subscribed(tenant, card=card)

    def cancel(*args):
        cancel_subscription(tenant_id=tenant.id, livemode=False, subscription_id=sub.id)

    monkeypatch.setattr(close_module.hooks, "after_charge", cancel)
    run = _drain(tenant, concurrency=concurrency)

    invoice = Invoice.objects.get(subscription=sub)
    sub.refresh_from_db()
    assert (run.billed, run.failed) == (1, 0)
    assert invoice.status == ("paid" if card != DECLINING_CARD else "open")
    assert (sub.status, sub.next_billing_at, sub.periods_billed) == ("canceled", None, 0)
    assert (sub.billing_failure_count, sub.next_billing_attempt_at) == (0, None)
    runs = list(DunningRun.objects.filter(invoice=invoice).values_list("status", "end_reason"))
    assert runs == ([] if card == VISA else [("ended", "subscription_canceled")])
    types = list(Event.objects.filter(data__id=sub.id).order_by("sequence").values_list("type", flat=True))
    assert types[types.index("subscription.canceled") + 1 :] == []  # nothing about it after the cancel
