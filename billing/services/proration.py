"""Proration: the share of a period's amount that falls after an instant, in integer minor units.

Stripe prorates by the second (https://docs.stripe.com/billing/subscriptions/prorations): a change at
``at`` inside the billing period ``[start, end)`` credits the unused time of what it removes and
charges the remaining time of what it adds, each ``amount × remaining_seconds / period_seconds``.
Each line is rounded once, to the currency's minor unit (amounts are minor units already), half
away from zero, in integer arithmetic: no float ever sees money. docs/decisions/0141-proration-rules.md.
"""

from __future__ import annotations

from datetime import datetime, timedelta

SECOND = timedelta(seconds=1)


def whole_seconds(at: datetime) -> datetime:
    """``at`` without its fraction of a second: prorations are computed for whole seconds, as Stripe's
    ``proration_date`` (unix seconds) states them."""
    return at.replace(microsecond=0)


def prorate(amount: int, remaining_s: int, period_s: int) -> int:
    """``amount × remaining_s / period_s`` rounded half away from zero (signed minor units).

    Raises ``ValueError`` for a period that is not positive or a remaining time outside ``0..period_s``.
    """
    if period_s <= 0:
        raise ValueError("period_s must be positive")
    if not 0 <= remaining_s <= period_s:
        raise ValueError("remaining_s must be within the period")
    quotient, remainder = divmod(abs(amount) * remaining_s, period_s)
    if 2 * remainder >= period_s:
        quotient += 1
    return quotient if amount >= 0 else -quotient


def remaining_share(start: datetime, end: datetime, at: datetime) -> tuple[int, int]:
    """``(remaining_seconds, period_seconds)`` of period ``[start, end)`` after ``at`` (whole seconds, floored)."""
    period_s = (end - start) // SECOND
    remaining_s = max(0, min(period_s, (end - at) // SECOND))
    return remaining_s, period_s
