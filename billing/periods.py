"""Billing periods, anchored on the billing cycle anchor.

Period n of a subscription spans ``[anchor + n × interval, anchor + (n+1) × interval)``,
each bound computed from the anchor with :class:`dateutil.relativedelta.relativedelta`
rather than by adding one interval to the previous bound. So a Jan 31 anchor gives
Feb 28 (or 29), then Mar 31, Apr 30, and never drifts to the 28th; a Feb 29 yearly anchor
gives Feb 28 in common years and Feb 29 again in leap years. Bounds are computed in UTC,
so daylight-saving changes of any local zone cannot shift or duplicate a period.
"""

from __future__ import annotations

from datetime import UTC, datetime

from dateutil.relativedelta import relativedelta

INTERVALS = ("day", "week", "month", "year")


def _step(interval: str, count: int) -> relativedelta:
    if interval == "day":
        return relativedelta(days=count)
    if interval == "week":
        return relativedelta(weeks=count)
    if interval == "month":
        return relativedelta(months=count)
    if interval == "year":
        return relativedelta(years=count)
    raise ValueError(f"unknown interval {interval!r}; expected one of {INTERVALS}")


def period_start(anchor: datetime, interval: str, interval_count: int, n: int) -> datetime:
    """Start of period ``n`` (n ≥ 0): ``anchor + n × interval_count interval`` in UTC.

    Raises ``ValueError`` for a naive ``anchor``, a negative ``n`` or an unknown interval.
    """
    if anchor.tzinfo is None:
        raise ValueError("anchor must be timezone-aware")
    if n < 0:
        raise ValueError("period index must be >= 0")
    return anchor.astimezone(UTC) + _step(interval, interval_count * n)


def period_bounds(anchor: datetime, interval: str, interval_count: int, n: int) -> tuple[datetime, datetime]:
    """``(start, end)`` of period ``n``; ``end`` is the start of period ``n + 1``."""
    return (
        period_start(anchor, interval, interval_count, n),
        period_start(anchor, interval, interval_count, n + 1),
    )
