"""The ``billing`` role: the scheduler's billing tick (SPEC §3, §4).

A tick, under the ``billing`` lease: drain live mode, then the test-mode pass, then the
reconcilers of both modes (invoices whose tax is pending, payments whose outcome is
unknown). The tick's fence guards every write of the drain; its liveness stamp is written
after every page, so a drain longer than the interval never looks stale. A lost lease or a
stop request ends the tick at the drain's next safe point (``fence.alive()``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from billing.models import BillingRun
from billing.services.clocks import resume_stalled_advances
from billing.services.drain import drain_due, reconcile
from hardcount.scheduler import TickContext, TickFailed

MODES = ((True, "live"), (False, "test"))


class BillingRole:
    """Scheduler role ``billing``, every ``HARDCOUNT_BILLING_INTERVAL_S`` seconds (default 1 h)."""

    name = "billing"

    @property
    def interval_s(self) -> float:
        return settings.HARDCOUNT_BILLING_INTERVAL_S

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """Drain live, then test; then reconcile both modes. Returns counts per mode for the log line.

        Raises :class:`TickFailed` when a drain was ended by a database error (after the
        other mode and the reconcilers had their turn), so the tick is retried soon.
        """
        counts: dict[str, Any] = {}
        failed_runs = []
        for livemode, mode in MODES:
            if not ctx.fence.alive():
                return counts
            run = drain_due(livemode=livemode, trigger="scheduler", fence=ctx.fence, on_page=ctx.stamp)
            if run.status == BillingRun.FAILED:
                failed_runs.append(f"{run.id} ({mode}): {run.error}")
            counts[f"{mode}_run"] = run.id
            counts[f"{mode}_attempted"] = run.attempted
            counts[f"{mode}_billed"] = run.billed
            counts[f"{mode}_failed"] = run.failed
        # Test-clock advances whose process died resume in the background (billing/services/clocks.py).
        counts["test_clocks_resumed"] = len(resume_stalled_advances(livemode=False))
        for livemode, mode in MODES:
            if not ctx.fence.alive():
                return counts
            reconciled = reconcile(livemode=livemode, fence=ctx.fence) or {}
            for key, value in reconciled.items():
                counts[f"{mode}_reconcile_{key}"] = value
        if failed_runs:
            # Not a completed tick: the ticker retries in min(interval, 30 s), not an hour later.
            raise TickFailed("billing drain ended by a database error: " + "; ".join(failed_runs))
        ctx.stamp()
        return counts
