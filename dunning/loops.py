"""The ``dunning`` role (SPEC §5): retries of declined invoices, one replica at a time.

A tick, under the ``dunning`` lease: the live-mode pass, then the test-mode pass, over
wall-clock runs (a test clock's runs are due by its advance). Each pass claims due runs
``FOR UPDATE SKIP LOCKED`` and retries or settles them (:mod:`dunning.retries`); every write
is checked against ``ctx.fence``, and a lost lease or a stop request ends the tick at the next
safe point (before the next page or run). The liveness stamp is written after every page.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from dunning.services import process_due
from hardcount.scheduler import TickContext

MODES = ((True, "live"), (False, "test"))


class DunningRole:
    """Scheduler role ``dunning``, every ``HARDCOUNT_DUNNING_INTERVAL_S`` seconds (default 60)."""

    name = "dunning"

    @property
    def interval_s(self) -> float:
        return settings.HARDCOUNT_DUNNING_INTERVAL_S

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """One pass per mode; returns the number of runs acted on per mode, for the log line."""
        counts: dict[str, Any] = {}
        for livemode, mode in MODES:
            counts[f"{mode}_runs"] = process_due(livemode=livemode, fence=ctx.fence, on_page=ctx.stamp)
            ctx.stamp()
        return counts
