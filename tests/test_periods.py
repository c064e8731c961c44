"""Billing periods computed from the anchor: month ends, leap days, DST."""

from datetime import UTC, datetime

import pytest

from billing.periods import period_bounds, period_start


def utc(*args):
    return datetime(*args, tzinfo=UTC)


def test_jan_31_anchor_bills_month_ends_without_drifting():
    anchor = utc(2027, 1, 31, 9, 30)
    starts = [period_start(anchor, "month", 1, n) for n in range(13)]
    assert [(s.month, s.day) for s in starts] == [
        (1, 31), (2, 28), (3, 31), (4, 30), (5, 31), (6, 30), (7, 31),
        (8, 31), (9, 30), (10, 31), (11, 30), (12, 31), (1, 31),
    ]  # fmt: skip
    assert all(s.hour == 9 and s.minute == 30 for s in starts)


def test_jan_31_anchor_gets_feb_29_in_leap_year():
    assert period_start(utc(2028, 1, 31), "month", 1, 1) == utc(2028, 2, 29)


def test_feb_29_yearly_anchor_returns_to_29th_in_leap_years():
    anchor = utc(2028, 2, 29, 12)
    assert [period_start(anchor, "year", 1, n).date().isoformat() for n in range(5)] == [
        "2028-02-29", "2029-02-28", "2030-02-28", "2031-02-28", "2032-02-29",
    ]  # fmt: skip


def test_period_end_is_next_period_start_and_interval_count_multiplies():
    start, end = period_bounds(utc(2027, 1, 15), "month", 3, 1)
    assert (start, end) == (utc(2027, 4, 15), utc(2027, 7, 15))


def test_weekly_periods_are_exact_utc_weeks_across_dst_changes():
    # US DST starts 2027-03-14 and ends 2027-11-07; a UTC week stays 7 × 24 h.
    anchor = utc(2027, 3, 8, 5)
    bounds = [period_bounds(anchor, "week", 1, n) for n in range(40)]
    assert all((end - start).total_seconds() == 7 * 86400 for start, end in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(39))


def test_naive_anchor_is_refused():
    with pytest.raises(ValueError):
        period_start(datetime(2027, 1, 1), "month", 1, 0)
