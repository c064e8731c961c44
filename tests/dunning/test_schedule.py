"""The schedule of a dunning run, its retries through localstripe, and its end states (SPEC §5)."""

from __future__ import annotations

import pytest

from billing.models import Invoice, PaymentAttempt, Subscription
from dunning.models import DunningRun
from dunning.services import process_due, update_settings
from tests.dunning.conftest import DAY, MINUTE, STOLEN_CARD, charges_sent, confirms, decline, doctor_failures, events


def _retry_times(declined, stripe_proxy, days=(1, 3, 5, 7)) -> list:
    """Run the dunning pass a minute before and at each retry time; the times at which it confirmed."""
    confirmed_at = []
    for day in days:
        due = declined.at + day * DAY
        before = len(confirms(stripe_proxy))
        assert process_due(livemode=False, as_of=due - MINUTE) == 0
        assert len(confirms(stripe_proxy)) == before, f"retried before day {day}"
        process_due(livemode=False, as_of=due)
        if len(confirms(stripe_proxy)) == before + 1:
            confirmed_at.append(due)
    return confirmed_at


def test_an_always_declining_invoice_is_retried_1_3_5_and_7_days_after_the_decline_to_the_minute(
    book, tenant, declined, stripe_proxy
):
    confirmed_at = _retry_times(declined, stripe_proxy)

    assert confirmed_at == [declined.at + d * DAY for d in (1, 3, 5, 7)]
    attempts = list(PaymentAttempt.objects.filter(invoice=declined.invoice).order_by("attempt_number"))
    assert [(a.attempt_number, a.outcome, a.decline_code) for a in attempts] == [
        (n, "declined", "generic_decline") for n in range(1, 6)
    ]
    # Each retry's decline is recorded at its billing time, and says when the next one is due.
    failed = events("invoice.payment_failed", data__id=declined.invoice.id)
    assert [e.created_at for e in failed] == [declined.at + d * DAY for d in (0, 1, 3, 5, 7)]
    assert [e.data["next_payment_attempt"] for e in failed] == [
        *(_iso(declined.at + d * DAY) for d in (1, 3, 5, 7)),
        None,
    ]


def test_the_last_declined_retry_marks_the_invoice_uncollectible_and_the_subscription_unpaid(
    book, tenant, declined, stripe_proxy
):
    _retry_times(declined, stripe_proxy)

    invoice = Invoice.objects.get(pk=declined.invoice.pk)
    sub = Subscription.objects.get(pk=declined.subscription.pk)
    run = DunningRun.objects.get(pk=declined.run.pk)
    end = declined.at + 7 * DAY
    assert (invoice.status, invoice.marked_uncollectible_at) == ("uncollectible", end)
    assert sub.status == "unpaid"
    assert (run.status, run.end_reason, run.retries_done, run.ended_at) == ("exhausted", "retries_exhausted", 4, end)
    assert [e.data["id"] for e in events("invoice.marked_uncollectible")] == [invoice.id]
    assert [e.data["status"] for e in events("subscription.updated", data__id=sub.id)][-1] == "unpaid"
    assert [(e.data["id"], e.created_at) for e in events("dunning.exhausted")] == [(run.id, end)]
    # Nothing more happens to it.
    assert process_due(livemode=False, as_of=end + 30 * DAY) == 0
    assert doctor_failures() == []


def _iso(value) -> str:
    from billing.representations import iso

    return iso(value)
