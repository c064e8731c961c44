"""An advance over 24 monthly periods of 1,000 subscriptions finishes (24,000 invoices through localstripe).

The test prints how long the advance took; there is no timing assertion (speed targets live in
``bench/``). It takes minutes: marked ``slow`` (``make test`` runs it; ``-m "not slow"`` skips it
while iterating). The gateway talks to localstripe directly, not through the fault proxy, which
no fault of this test needs.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from dateutil.relativedelta import relativedelta
from django.db import transaction
from django.db.models import Count

from billing.models import Customer, Invoice, Price, Subscription, SubscriptionItem
from billing.representations import customer_data, subscription_data
from outbox.services import emit_event
from tests.clocks.helpers import advance, make_clock

SUBSCRIPTIONS = 1_000
PERIODS = 24
ANCHOR = datetime(2027, 1, 31, 9, 30, tzinfo=UTC)


@pytest.mark.slow
def test_advance_over_24_monthly_periods_of_1000_subscriptions_bills_each_period_once(
    book, tenant, make_card, localstripe_base, settings, capsys
):
    settings.STRIPE_API_BASE = localstripe_base
    clock = make_clock(tenant, ANCHOR, name="scale")
    price = Price.objects.create(
        tenant=tenant, livemode=False, amount=1500, currency="usd", interval="month", interval_count=1
    )
    setup_started = time.monotonic()
    cards = [make_card() for _ in range(SUBSCRIPTIONS)]
    with transaction.atomic():
        customers = Customer.objects.bulk_create(
            Customer(
                tenant=tenant,
                livemode=False,
                email=f"scale{n}@example.com",
                default_payment_method=cards[n],
                currency="usd",
                test_clock=clock,
            )
            for n in range(SUBSCRIPTIONS)
        )
        subscriptions = Subscription.objects.bulk_create(
            Subscription(
                tenant=tenant,
                livemode=False,
                customer=customer,
                price=price,
                status=Subscription.ACTIVE,
                billing_cycle_anchor=ANCHOR,
                next_billing_at=ANCHOR,
                test_clock=clock,
            )
            for customer in customers
        )
        SubscriptionItem.objects.bulk_create(
            SubscriptionItem(tenant=tenant, livemode=False, subscription=sub, price=price) for sub in subscriptions
        )
        for customer, subscription in zip(customers, subscriptions, strict=True):
            emit_event(
                tenant_id=tenant.id,
                livemode=False,
                type="customer.created",
                data=customer_data(customer),
                created_at=ANCHOR,
            )
            emit_event(
                tenant_id=tenant.id,
                livemode=False,
                type="subscription.created",
                data=subscription_data(subscription),
                created_at=ANCHOR,
            )
    setup_s = time.monotonic() - setup_started
    target = ANCHOR + relativedelta(months=PERIODS - 1, days=1)  # periods 0..23 start by then

    started = time.monotonic()
    clock = advance(clock, target, timeout_s=3600)
    elapsed_s = time.monotonic() - started

    with capsys.disabled():
        print(
            f"\n[test clocks] advance of {SUBSCRIPTIONS} subscriptions over {PERIODS} monthly periods: "
            f"{elapsed_s:.1f} s ({SUBSCRIPTIONS * PERIODS / elapsed_s:.0f} invoices/s; set-up {setup_s:.1f} s)"
        )
    assert (clock.status, clock.frozen_time, clock.last_failure) == ("ready", target, "")
    per_subscription = Invoice.objects.filter(subscription__test_clock=clock, status=Invoice.PAID).values(
        "subscription_id"
    )
    counts = per_subscription.annotate(n=Count("id")).values_list("n", flat=True)
    assert sorted(set(counts)) == [PERIODS] and len(counts) == SUBSCRIPTIONS
    expected_starts = {ANCHOR + relativedelta(months=n) for n in range(PERIODS)}
    assert set(Invoice.objects.filter(subscription__test_clock=clock).values_list("period_start", flat=True)) == (
        expected_starts
    )
    assert (
        not Subscription.objects.filter(test_clock=clock)
        .exclude(next_billing_at=ANCHOR + relativedelta(months=PERIODS))
        .exists()
    )
