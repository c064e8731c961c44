"""A run's claims: marked with the run, read from where the last one stopped, lap after lap (docs/decisions/0187).

Real PostgreSQL; the gateway is localstripe behind the strict dev Stripe.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from django.db import connections, transaction

from billing.models import BillingAttempt, Subscription
from billing.queries import claim_due_page, mark_still_due
from billing.services.drain import drain_due
from hardcount.times import database_now


def _claim(run_id=None, after=None, page_size=10):
    with transaction.atomic():
        return claim_due_page(
            livemode=False,
            tenant_id=None,
            test_clock_id=None,
            as_of=None,
            page_size=page_size,
            run_id=run_id,
            after=after,
        )


def test_a_run_s_claim_passes_over_what_it_marked_and_another_run_s_does_not(book, tenant):
    subs = [book.subscribed(tenant) for _ in range(3)]
    paid = book.subscribed(tenant, anchor=database_now() + timedelta(days=1))  # not due: never marked
    first = _claim("brun_a")
    assert sorted(row[0] for row in first) == sorted(s.id for s in subs)
    with transaction.atomic():
        assert mark_still_due("brun_a", [row[0] for row in first] + [paid.id], as_of=None) == 3
    assert _claim("brun_a") == []  # nothing sent back: the rows carry the mark
    assert set(Subscription.objects.values_list("claimed_by_run", flat=True)) == {"brun_a", None}
    # Negative control: another run (or no run at all) claims the same due rows again.
    assert len(_claim("brun_b")) == 3
    assert len(_claim()) == 3


def test_a_claim_starts_past_the_row_it_is_given(book, tenant):
    now = database_now()
    subs = [book.subscribed(tenant, anchor=now - timedelta(hours=10 - i)) for i in range(4)]
    page = _claim(page_size=2)
    assert [row[0] for row in page] == [s.id for s in subs[:2]]
    after = (page[-1][2], page[-1][0])
    assert [row[0] for row in _claim(after=after, page_size=10)] == [s.id for s in subs[2:]]


def test_a_run_comes_back_in_a_second_lap_for_a_row_that_was_locked_when_it_passed(book, tenant):
    now = database_now()
    held, later = (book.subscribed(tenant, anchor=now - timedelta(hours=5 - i)) for i in range(2))
    last = book.subscribed(tenant, anchor=now - timedelta(hours=1))
    locked, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                Subscription.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    locked.wait(30)

    def on_page(run):
        release.set()
        holder.join()

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=1, on_page=on_page)

    assert run.attempted == 3 and run.billed == 3
    attempted = list(
        BillingAttempt.objects.filter(run=run).order_by("created_at").values_list("subscription_id", flat=True)
    )
    assert sorted(attempted) == sorted([held.id, later.id, last.id])
    for sub in (held, later, last):
        sub.refresh_from_db()
        assert sub.periods_billed == 1


def test_a_subscription_several_periods_behind_is_billed_one_period_per_run(book, tenant):
    sub = book.subscribed(tenant, anchor=database_now() - timedelta(days=95))

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=1)

    sub.refresh_from_db()
    assert (run.attempted, sub.periods_billed) == (1, 1)  # due again at once, but this run claimed it already
    assert drain_due(livemode=False, trigger="manual", tenant_id=tenant.id).attempted == 1
