"""The public JSON shape of dunning objects, shared by API responses and event data.

Times are ISO 8601 UTC with ``Z`` (:func:`hardcount.times.iso`).
"""

from __future__ import annotations

from typing import Any

from dunning.models import DunningRun
from dunning.schedule import last_retry_at, next_retry_at, retries_left
from hardcount.times import iso


def dunning_run_data(run) -> dict[str, Any]:
    """A dunning run: its invoice, state, schedule and what comes next.

    ``next_attempt_at`` is the next automatic charge (null when the run is over, waits for a new
    payment method, or has no retry left); ``final_action_at`` is when the end state applies if
    no payment arrives (the last retry's time; null once the run is over).
    """
    active = run.status == DunningRun.ACTIVE
    return {
        "id": run.id,
        "object": "dunning_run",
        "livemode": run.livemode,
        "invoice": run.invoice_id,
        "status": run.status,
        "end_reason": run.end_reason or None,
        "retry_days": list(run.retry_days),
        "retries_done": run.retries_done,
        "retries_left": retries_left(run),
        "next_attempt_at": iso(next_retry_at(run)),
        "final_action_at": iso(last_retry_at(run)) if active else None,
        "waiting_for_payment_method": run.waiting_for_payment_method,
        "last_decline_code": run.last_decline_code or None,
        "last_error": run.last_error or None,
        "test_clock": run.test_clock_id,
        "first_declined_at": iso(run.first_declined_at),
        "created": iso(run.created_at),
        "ended_at": iso(run.ended_at),
    }


def dunning_settings_data(policy) -> dict[str, Any]:
    """A tenant's dunning policy for one mode (:class:`dunning.services.Policy`)."""
    return {
        "object": "dunning_settings",
        "livemode": policy.livemode,
        "retry_days": list(policy.retry_days),
        "final_action": policy.final_action,
        "updated_at": iso(policy.updated_at),
    }
