"""The ``dunning`` role (SPEC §5): retries of declined invoices, one replica at a time.

A stub for now: the tick does nothing. The dunning issue fills it with the claim of due
dunning runs (``SELECT … FOR UPDATE SKIP LOCKED``), each retry under ``ctx.fence``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from hardcount.scheduler import TickContext


class DunningRole:
    """Scheduler role ``dunning``, every ``HARDCOUNT_DUNNING_INTERVAL_S`` seconds (default 60)."""

    name = "dunning"

    @property
    def interval_s(self) -> float:
        return settings.HARDCOUNT_DUNNING_INTERVAL_S

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """Nothing to do yet; returns no counts."""
        return {}
