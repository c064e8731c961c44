"""The dashboard's money figures (ops/sql/dashboard.sql) equal the sums worked out by hand for a small book."""

from datetime import timedelta

import pytest
from django.db import connection

from billing.models import Customer, PaymentAttempt, Price, Subscription, TestClock
from dunning.models import DunningRun
from ops.dashboard import dashboard
from outbox.models import Delivery, WebhookEndpoint
from tests.admin import rows
from tests.outbox.conftest import emit, make_endpoint

pytestmark = pytest.mark.django_db


def _db_times():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now(), date_trunc('day', now(), 'UTC'), date_trunc('month', now(), 'UTC')")
        return cursor.fetchone()


def _on_price(sub: Subscription, amount: int, currency: str, interval: str, interval_count: int = 1) -> Subscription:
    price = Price.objects.create(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        amount=amount,
        currency=currency,
        interval=interval,
        interval_count=interval_count,
    )
    Subscription.objects.filter(pk=sub.pk).update(price=price)
    Customer.objects.filter(pk=sub.customer_id).update(currency=currency)
    sub.refresh_from_db()
    return sub


def _paid(sub: Subscription, amount: int, completed_at, *, offset: int, settled_without_charge: bool = False):
    invoice = rows.invoice(sub, status="paid", offset=offset)
    return PaymentAttempt.objects.create(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        invoice=invoice,
        attempt_number=1,
        amount=amount,
        currency=invoice.currency,
        outcome="succeeded",
        settled_without_charge=settled_without_charge,
        started_at=completed_at,
        completed_at=completed_at,
    )


@pytest.fixture
def book(tenant):
    """Test mode: usd 10.00/month ×2, usd 120.00/year, usd 90.00 every 3 months, eur 12.99/week, jpy ¥1,000/month
    (past_due); left out: a trialing, a canceled and a test-clock subscription. Live mode: gbp 5.00/day."""
    now, today, month = _db_times()
    usd_a = rows.subscription(tenant)
    usd_b = rows.subscription(tenant)
    _on_price(rows.subscription(tenant), 12_000, "usd", "year")
    _on_price(rows.subscription(tenant), 9_000, "usd", "month", 3)
    eur = _on_price(rows.subscription(tenant), 1_299, "eur", "week")
    jpy = _on_price(rows.subscription(tenant, status="past_due"), 1_000, "jpy", "month")
    rows.subscription(tenant, status="trialing")
    rows.subscription(tenant, status="canceled")
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=now + timedelta(days=400))
    on_clock = rows.subscription(tenant, test_clock=clock)
    Customer.objects.filter(pk=on_clock.customer_id).update(test_clock=clock)
    _on_price(rows.subscription(tenant, livemode=True), 500, "gbp", "day")

    # Collected: today 10.00 + 12.99 eur; earlier this month (or today, on the 1st) 10.00; last month 10.00 (out);
    # a zero settled without a charge (out); a test clock's charge (out).
    _paid(usd_a, 1_000, now - timedelta(seconds=1), offset=0)
    _paid(eur, 1_299, now - timedelta(seconds=1), offset=0)
    earlier = max(month, now - timedelta(days=1))
    _paid(usd_b, 1_000, earlier, offset=0)
    _paid(usd_b, 1_000, month - timedelta(hours=1), offset=1)
    _paid(usd_a, 0, now - timedelta(seconds=1), offset=1, settled_without_charge=True)
    _paid(on_clock, 1_000, now - timedelta(seconds=1), offset=0)

    # In dunning: jpy's declined invoice ¥1,000. Failing: a waiting subscription's unanswered usd 10.00 invoice.
    declined = rows.invoice(jpy)
    DunningRun.objects.create(
        tenant=tenant, livemode=False, invoice=declined, first_declined_at=now, schedule_anchor_at=now
    )
    rows.invoice(rows.waiting(tenant))
    return {"today": today, "earlier": earlier}


def test_money_figures_per_mode_and_currency_equal_the_hand_computed_ones(book):
    modes = {m.mode: {c.currency: c for c in m.money} for m in dashboard().modes}
    test, live = modes["test"], modes["live"]

    # usd: 1000 + 1000 + 12000/12 + 9000/3 + (the waiting subscription's) 1000; eur 1299 × 52/12; jpy 1000.
    assert test["usd"].mrr == 1_000 + 1_000 + 1_000 + 3_000 + 1_000
    assert test["usd"].subscriptions == 5
    assert test["eur"].mrr == round(1_299 * 52 / 12) == 5_629
    assert test["jpy"].mrr == 1_000
    assert live["gbp"].mrr == round(500 * 365 / 12) == 15_208

    earlier_is_today = book["earlier"] >= book["today"]
    assert test["usd"].collected_today == (2_000 if earlier_is_today else 1_000)
    assert test["usd"].collected_month == 2_000
    assert (test["eur"].collected_today, test["eur"].collected_month) == (1_299, 1_299)

    assert (test["jpy"].in_dunning, test["jpy"].in_dunning_invoices) == (1_000, 1)
    assert (test["usd"].failing, test["usd"].failing_invoices) == (1_000, 1)
    assert test["usd"].in_dunning == 0 and test["jpy"].failing == 0


def test_the_index_shows_the_money_formatted_by_currency(book, operator):
    text = operator.get("/admin/").content.decode()

    assert "$70.00" in text  # the usd MRR
    assert "€56.29" in text and "¥1,000" in text and "£152.08" in text
    assert "7000 usd" not in text.lower()


def test_webhook_backlog_is_listed_by_endpoint_with_the_open_circuit_flagged(tenant, operator):
    now, _today, _month = _db_times()
    healthy = make_endpoint(tenant, "https://example.com/healthy")
    broken = make_endpoint(tenant, "https://example.com/broken")
    WebhookEndpoint.objects.filter(pk=broken.pk).update(
        circuit_open_until=now + timedelta(minutes=5), consecutive_failures=6
    )
    emit(tenant)
    emit(tenant)
    Delivery.objects.filter(endpoint=healthy).update(fire_after=now - timedelta(seconds=1))
    Delivery.objects.filter(endpoint=broken).update(fire_after=now + timedelta(minutes=5))

    endpoints = {e.url: e for e in dashboard().endpoints}

    assert [e.url for e in dashboard().endpoints] == ["https://example.com/broken", "https://example.com/healthy"]
    assert (endpoints["https://example.com/broken"].circuit_open, endpoints["https://example.com/broken"].queued) == (
        True,
        2,
    )
    assert endpoints["https://example.com/broken"].due == 0
    assert (endpoints["https://example.com/healthy"].circuit_open, endpoints["https://example.com/healthy"].due) == (
        False,
        2,
    )
    text = operator.get("/admin/").content.decode()
    assert 'id="webhook-backlog"' in text and "circuit open until" in text
