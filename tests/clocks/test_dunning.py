"""Dunning retries fall due by the clock: an advance takes a declined invoice through its schedule
(docs/reference/dunning.md: 1, 3, 5 and 7 days after the decline) to the final action, each step at its own time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services.customers import update_customer
from dunning.models import DunningRun
from dunning.services import update_settings
from tests.billing.conftest import DECLINING_CARD, events
from tests.clocks.helpers import advance, make_clock, subscribe

DAY = timedelta(days=1)


def test_a_declining_card_runs_its_whole_dunning_schedule_across_dst_to_the_final_action(
    book, tenant, new_york_sessions
):
    # The retries on Mar 11, 13, 15 and 17 straddle New York's switch to summer time (Mar 14).
    declined_at = datetime(2027, 3, 10, 15, tzinfo=UTC)
    update_settings(tenant_id=tenant.id, livemode=False, final_action="canceled")
    clock = make_clock(tenant, declined_at)
    sub = subscribe(book, clock, card=DECLINING_CARD)

    clock = advance(clock, datetime(2027, 5, 1, tzinfo=UTC))

    retries = [declined_at + d * DAY for d in (1, 3, 5, 7)]
    (invoice,) = Invoice.objects.filter(subscription_id=sub.id)  # canceled: April's period is never billed
    assert [e.created_at for e in events("invoice.payment_failed")] == [declined_at, *retries]
    assert [e.created_at for e in events("dunning.retry_scheduled")] == [declined_at, *retries[:-1]]
    assert PaymentAttempt.objects.filter(invoice=invoice, outcome="declined").count() == 5
    assert (invoice.status, invoice.marked_uncollectible_at) == (Invoice.UNCOLLECTIBLE, retries[-1])
    run = DunningRun.objects.get(invoice=invoice)
    assert (run.status, run.retries_done, run.ended_at) == (DunningRun.EXHAUSTED, 4, retries[-1])
    sub.refresh_from_db()
    assert sub.status == Subscription.CANCELED
    assert [e.created_at for e in events("subscription.past_due")] == [declined_at]
    assert [e.created_at for e in events("subscription.canceled", data__id=sub.id)] == [retries[-1]]
    assert (clock.status, clock.frozen_time) == ("ready", datetime(2027, 5, 1, tzinfo=UTC))


def test_a_card_replaced_during_dunning_is_charged_on_the_clock_and_billing_carries_on(book, tenant, make_card):
    start = datetime(2027, 6, 1, 9, tzinfo=UTC)
    clock = make_clock(tenant, start)
    sub = subscribe(book, clock, card=DECLINING_CARD)
    clock = advance(clock, start + 2 * DAY)  # declined at once, and again at the first retry (day 1)

    update_customer(
        tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, default_payment_method=make_card()
    )
    advance(clock, start + 40 * DAY)

    first, second = Invoice.objects.filter(subscription_id=sub.id).order_by("period_start")
    assert PaymentAttempt.objects.filter(invoice=first, outcome="declined").count() == 2
    # The new card is tried at once (the clock's time when it changed), not at the next scheduled retry.
    assert (first.status, first.paid_at) == (Invoice.PAID, start + 2 * DAY)
    assert DunningRun.objects.get(invoice=first).status == DunningRun.RECOVERED
    assert (second.status, second.period_start, second.paid_at) == (
        Invoice.PAID,
        datetime(2027, 7, 1, 9, tzinfo=UTC),
        datetime(2027, 7, 1, 9, tzinfo=UTC),
    )
    sub.refresh_from_db()
    assert sub.status == Subscription.ACTIVE
