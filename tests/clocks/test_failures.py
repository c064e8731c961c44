"""Failures during an advance: a failing close is not saved on its subscription (docs/reference/billing.md: the run's
exclude list only) and the clock keeps the reason; an error that ends the walk stops the clock where
it got to, ready, instead of leaving it advancing."""

from __future__ import annotations

from datetime import UTC, datetime

from dateutil.relativedelta import relativedelta
from django.db import DatabaseError

from billing.models import BillingAttempt, Invoice, Subscription, TestClock
from billing.services import clocks
from tests.billing.conftest import events
from tests.clocks.helpers import advance, make_clock, subscribe

T0 = datetime(2027, 4, 1, 10, tzinfo=UTC)


def _fail_charges_of(stripe_proxy, sub) -> None:
    pm = sub.customer.default_payment_method
    stripe_proxy.fail_next(
        "500", times=10_000, match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )


def test_a_failing_close_is_retried_at_every_instant_never_saved_on_the_subscription(book, tenant, stripe_proxy):
    clock = make_clock(tenant, T0)
    healthy = subscribe(book, clock)
    failing = subscribe(book, clock)
    _fail_charges_of(stripe_proxy, failing)

    clock = advance(clock, T0 + relativedelta(months=2, days=1))

    assert Invoice.objects.filter(subscription=healthy, status=Invoice.PAID).count() == 3
    failing.refresh_from_db()
    assert (failing.billing_failure_count, failing.next_billing_attempt_at, failing.billing_parked_at) == (
        0,
        None,
        None,
    )
    assert (failing.last_billing_error, failing.next_billing_at) == ("", T0)
    assert events("subscription.billing_failed") == []
    # Tried once per instant of the walk (T0, May 1, Jun 1), each time in that instant's run.
    attempts = BillingAttempt.objects.filter(subscription=failing).order_by("created_at")
    assert [(a.outcome, a.created_at) for a in attempts] == [
        ("failed", T0),
        ("failed", T0 + relativedelta(months=1)),
        ("failed", T0 + relativedelta(months=2)),
    ]
    assert (clock.status, clock.frozen_time) == ("ready", T0 + relativedelta(months=2, days=1))
    assert "500" in clock.last_failure

    # The gateway is back: the next advance catches the late periods up, in order, at the clock's time.
    stripe_proxy.clear()
    clock = advance(clock, T0 + relativedelta(months=2, days=2))

    caught_up = Invoice.objects.filter(subscription=failing).order_by("period_start")
    late = T0 + relativedelta(months=2, days=1)
    assert [(i.period_start, i.status, i.paid_at) for i in caught_up] == [
        (T0, Invoice.PAID, late),
        (T0 + relativedelta(months=1), Invoice.PAID, late),
        (T0 + relativedelta(months=2), Invoice.PAID, late),
    ]
    failing.refresh_from_db()
    assert failing.next_billing_at == T0 + relativedelta(months=3)


def test_an_error_that_ends_the_walk_leaves_the_clock_ready_where_it_got_with_the_reason(book, tenant, monkeypatch):
    clock = make_clock(tenant, T0)
    sub = subscribe(book, clock)
    real_drain = clocks.drain_due
    calls = []

    def drain_then_lose_the_database(**kwargs):
        calls.append(kwargs["as_of"])
        if len(calls) == 2:
            raise DatabaseError("server closed the connection unexpectedly")
        return real_drain(**kwargs)

    monkeypatch.setattr(clocks, "drain_due", drain_then_lose_the_database)

    clock = advance(clock, T0 + relativedelta(months=3))

    assert calls == [T0, T0 + relativedelta(months=1)]
    assert (clock.status, clock.advance_target) == (TestClock.READY, None)
    assert clock.frozen_time == T0 + relativedelta(months=1)  # the instant it was processing
    assert "stopped at 2027-05-01T10:00:00Z" in clock.last_failure
    assert "server closed the connection" in clock.last_failure
    assert [e.data["frozen_time"] for e in events("test_clock.advanced")] == ["2027-05-01T10:00:00Z"]
    assert Invoice.objects.filter(subscription=sub).count() == 1
    assert Subscription.objects.get(pk=sub.pk).next_billing_at == T0 + relativedelta(months=1)
