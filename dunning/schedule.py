"""A dunning run's schedule, as pure functions of the run's row (docs/decisions/0070).

Retry k (1-based) of a run is due ``retry_days[k-1]`` whole days after ``schedule_anchor_at``
(the first decline, unless a new payment method moved it). Days are exact 24-hour steps in UTC,
so a retry lands on the minute of the decline whatever the time zone or DST.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from dunning.models import DunningRun


def retry_at(run: DunningRun, k: int) -> datetime:
    """When scheduled retry ``k`` (1 ≤ k ≤ ``len(run.retry_days)``) of ``run`` is due."""
    return run.schedule_anchor_at + timedelta(days=run.retry_days[k - 1])


def last_retry_at(run: DunningRun) -> datetime:
    """The last scheduled retry's time: when a run waiting for a new payment method is exhausted."""
    return retry_at(run, len(run.retry_days))


def retries_left(run: DunningRun) -> int:
    """Scheduled retries not started yet."""
    return max(len(run.retry_days) - run.retries_done, 0)


def next_retry_at(run: DunningRun) -> datetime | None:
    """When the run's next charge is due; None when the run is over, waits for a new payment
    method, or has no retry left (its end state is due)."""
    if run.status != DunningRun.ACTIVE or run.waiting_for_payment_method:
        return None
    if run.attempt_started_at is not None or run.retry_requested_at is not None:
        return run.next_attempt_at
    if retries_left(run) == 0:
        return None
    return run.next_attempt_at
