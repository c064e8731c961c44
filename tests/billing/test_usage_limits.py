"""Usage beyond what a payment can take holds its invoice instead of failing the close for ever (decision 0217); the
meter events' identifier guard is pruned past its retention (decision 0219)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from billing.models import BillingAttempt, Invoice, MeterEventIdentifier, PaymentAttempt, Subscription, SubscriptionItem
from billing.services import usage
from billing.services.drain import drain_due
from hardcount.times import database_now
from tests.billing.test_usage import _event, _ingest, _meter, _metered_price, _month_after, _month_before

BIGINT_MAX = 2**63 - 1


@pytest.fixture(params=["page", "per_close"])
def page_close(request, settings):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = request.param == "page"
    return request.param


def _metered_subscription_with_usage(book, settings, *, unit_amount: int, events: int):
    """A subscription to a licensed price (2,000) and a per-unit metered price of ``unit_amount``, on its period 1
    (period 0 ended 2 hours ago), with ``events`` events of 10⁹ units (the largest) in period 0."""
    tenant = book.tenant()
    anchor = _month_before(database_now() - timedelta(hours=2))
    customer = book.customer(tenant)
    metered = _metered_price(tenant, _meter(tenant), amount=unit_amount)
    sub = book.subscription(customer, book.price(tenant, amount=2000), anchor=anchor)
    SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=metered)
    Subscription.objects.filter(pk=sub.pk).update(periods_billed=1, next_billing_at=_month_after(anchor))
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400  # to record period 0's usage after the fact
    batch = [_event(customer, usage.MAX_EVENT_VALUE, anchor + timedelta(minutes=n + 1)) for n in range(events)]
    assert {r.status for r in _ingest(tenant, batch)} == {"accepted"}
    settings.HARDCOUNT_USAGE_GRACE_S = 3600
    return tenant, sub


# (unit amount, events): 2×10⁹ minor units, within bigint but beyond a PaymentIntent; 10¹¹ × 99,999,999 ≈ 10¹⁹, beyond
# bigint too.
SIZES = [pytest.param(1, 2, id="beyond-a-payment"), pytest.param(99_999_999, 100, id="beyond-bigint")]


@pytest.mark.parametrize(("unit_amount", "events"), SIZES)
def test_usage_beyond_what_a_payment_takes_holds_the_invoice_and_the_period_closes(
    book, settings, page_close, unit_amount, events
):
    tenant, sub = _metered_subscription_with_usage(book, settings, unit_amount=unit_amount, events=events)
    quantity = events * usage.MAX_EVENT_VALUE
    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.hold_reason, invoice.number) == ("draft", "amount_too_large", None)
    lines = list(invoice.lines.order_by("id"))
    assert [line.amount for line in lines] == [2000, 0]
    assert f"{quantity * unit_amount:,} USD minor units, beyond 99,999,999; held for review" in lines[1].description
    assert (invoice.subtotal, invoice.amount_due) == (2000, 2000)
    assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
    sub.refresh_from_db()
    assert (sub.periods_billed, sub.billing_failure_count, sub.last_billing_error) == (2, 0, "")
    attempt = BillingAttempt.objects.get(run=run, subscription=sub)
    assert attempt.outcome == "held" and attempt.invoice_id == invoice.id
    run.refresh_from_db()
    assert (run.billed, run.failed) == (1, 0)

    # Its next close is a month away: nothing is retried meanwhile, and the held draft is left alone.
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice.refresh_from_db()
    assert (invoice.status, Invoice.objects.filter(subscription=sub).count()) == ("draft", 1)


@pytest.mark.parametrize(("unit_amount", "events"), SIZES)
def test_negative_control_without_the_hold_the_close_fails_and_the_period_never_closes(
    book, settings, monkeypatch, unit_amount, events
):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = False
    tenant, sub = _metered_subscription_with_usage(book, settings, unit_amount=unit_amount, events=events)
    from billing.services import close

    # No line or total is ever "too large": neither the usage lines' hold nor the one after tax (decision 0231).
    monkeypatch.setattr(usage, "MAX_AMOUNT", 10**40)
    monkeypatch.setattr(close, "MAX_AMOUNT", 10**40)
    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    sub.refresh_from_db()
    assert sub.periods_billed == 1 and sub.billing_failure_count == 1
    # Beyond bigint the invoice cannot be written; beyond a payment the gateway refuses the PaymentIntent.
    assert ("out of range" in sub.last_billing_error) == (unit_amount * events * usage.MAX_EVENT_VALUE > BIGINT_MAX)
    assert BillingAttempt.objects.get(run=run, subscription=sub).outcome == "failed"


def test_guard_rows_past_the_retention_are_pruned_and_a_resent_old_event_is_then_refused(book, settings):
    settings.HARDCOUNT_USAGE_GRACE_S = 3600
    tenant = book.tenant()
    customer = book.customer(tenant)
    _meter(tenant)
    now = database_now()
    at = now - timedelta(minutes=30)
    sent = [_event(customer, 1, at, f"ev-{n}") for n in range(3)]
    assert [r.status for r in _ingest(tenant, sent)] == ["accepted"] * 3
    retention = usage.identifier_retention()
    assert retention == timedelta(hours=25)  # Stripe's 24 hours (longer than the grace and the skew), plus an hour
    # ev-0 was taken just past the retention, ev-1 just inside it; ev-2 now.
    ages = {"ev-0": retention + timedelta(minutes=1), "ev-1": retention - timedelta(minutes=1)}
    with connection.cursor() as cursor:
        for identifier, age in ages.items():
            cursor.execute(
                "UPDATE billing_metereventidentifier SET created_at = now() - %s WHERE identifier = %s",
                [age, identifier],
            )

    assert usage.prune_identifiers(batch=1) == 1
    assert sorted(MeterEventIdentifier.objects.values_list("identifier", flat=True)) == ["ev-1", "ev-2"]
    assert usage.prune_identifiers() == 0

    # The kept ones still de-duplicate. ev-0's own timestamp, were it really that old, would be beyond the grace:
    # refused as too old, never counted twice.
    old = _event(customer, 1, now - retention - timedelta(minutes=1), "ev-0")
    statuses = [(r.status, r.error and r.error["code"]) for r in _ingest(tenant, [sent[1], sent[2], old])]
    assert statuses == [("duplicate", None), ("duplicate", None), ("refused", "timestamp_too_old")]


def test_the_guards_retention_follows_a_grace_longer_than_a_day(settings):
    settings.HARDCOUNT_USAGE_GRACE_S = 3 * 86400
    assert usage.identifier_retention() == timedelta(days=3, minutes=5, hours=1)


def test_an_immediate_cancel_whose_usage_is_beyond_a_payment_is_a_422_and_changes_nothing(book, monkeypatch):
    from billing.services.changes import cancel_subscription
    from hardcount.errors import InvalidRequestError
    from tests.billing.test_usage_changes import JAN15, _setup
    from tests.clocks.helpers import advance

    tenant, clock, customer, sub, *_ = _setup(book)  # 40 units at 3 cents by Jan 15
    assert _ingest(tenant, [_event(customer, usage.MAX_EVENT_VALUE, None)])[0].status == "accepted"
    advance(clock, JAN15 + timedelta(seconds=1))

    def cancel():
        return cancel_subscription(tenant_id=tenant.id, livemode=False, subscription_id=sub.id, prorate=False)

    with pytest.raises(InvalidRequestError) as refused:
        cancel()
    assert refused.value.code == "usage_amount_too_large"
    sub.refresh_from_db()
    assert sub.status == "active" and not Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")
    customer.refresh_from_db()
    assert customer.usage_billed_until == {}

    # The negative control: without the check the cancel writes a final invoice no PaymentIntent can take.
    monkeypatch.setattr(usage, "MAX_AMOUNT", 10**40)
    cancel()
    final = Invoice.objects.get(subscription=sub, billing_reason="subscription_update")
    assert final.total == (40 + usage.MAX_EVENT_VALUE) * 3 > 99_999_999
