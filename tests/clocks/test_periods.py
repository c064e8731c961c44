"""Advancing a clock bills every period in between, in order, each at its own time (issue 7)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from dateutil.relativedelta import relativedelta

from billing.models import Invoice, Subscription
from tests.billing.conftest import events
from tests.clocks.helpers import advance, make_clock, subscribe


def _utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def _invoices(sub) -> list[Invoice]:
    return list(Invoice.objects.filter(subscription=sub).order_by("period_start"))


@pytest.mark.parametrize(
    ("year", "february"),
    [(2027, _utc(2027, 2, 28, 9, 30)), (2028, _utc(2028, 2, 29, 9, 30))],
    ids=["common-year", "leap-year"],
)
def test_monthly_subscription_anchored_jan_31_bills_each_month_end_through_a_year(book, tenant, year, february):
    anchor = _utc(year, 1, 31, 9, 30)
    clock = make_clock(tenant, anchor)
    sub = subscribe(book, clock)

    clock = advance(clock, _utc(year + 1, 1, 31, 9, 30))

    expected = [
        anchor,
        february,
        _utc(year, 3, 31, 9, 30),
        _utc(year, 4, 30, 9, 30),
        _utc(year, 5, 31, 9, 30),
        _utc(year, 6, 30, 9, 30),
        _utc(year, 7, 31, 9, 30),
        _utc(year, 8, 31, 9, 30),
        _utc(year, 9, 30, 9, 30),
        _utc(year, 10, 31, 9, 30),
        _utc(year, 11, 30, 9, 30),
        _utc(year, 12, 31, 9, 30),
        _utc(year + 1, 1, 31, 9, 30),
    ]
    thirteenth = anchor + relativedelta(months=13)  # Feb 28 or 29 of the next year
    invoices = _invoices(sub)
    assert [i.period_start for i in invoices] == expected
    assert [i.period_end for i in invoices] == [*expected[1:], thirteenth]
    # Each invoice is dated by the clock at its own period start, and paid then.
    assert [i.created_at for i in invoices] == expected
    assert [i.paid_at for i in invoices] == expected
    assert {i.status for i in invoices} == {Invoice.PAID}
    assert [i.number for i in sorted(invoices, key=lambda i: i.number)] == [f"{n:06d}" for n in range(1, 14)]
    created = [e.created_at for e in events("invoice.created", data__subscription=sub.id)]
    assert created == expected
    sub.refresh_from_db()
    assert (sub.current_period_start, sub.next_billing_at) == (expected[-1], thirteenth)
    assert (clock.status, clock.frozen_time, clock.advance_target) == ("ready", expected[-1], None)
    assert [e.data["frozen_time"] for e in events("test_clock.advanced")] == [f"{year + 1}-01-31T09:30:00Z"]


def test_yearly_subscription_anchored_feb_29_bills_feb_28_in_common_years_and_feb_29_in_leap_years(book, tenant):
    anchor = _utc(2028, 2, 29, 12)
    clock = make_clock(tenant, anchor)
    sub = subscribe(book, clock, interval="year")

    advance(clock, _utc(2032, 2, 29, 12))

    expected = [
        _utc(2028, 2, 29, 12),
        _utc(2029, 2, 28, 12),
        _utc(2030, 2, 28, 12),
        _utc(2031, 2, 28, 12),
        _utc(2032, 2, 29, 12),
    ]
    invoices = _invoices(sub)
    assert [i.period_start for i in invoices] == expected
    assert [i.created_at for i in invoices] == expected
    sub.refresh_from_db()
    assert sub.next_billing_at == _utc(2033, 2, 28, 12)
    assert sub.status == Subscription.ACTIVE
