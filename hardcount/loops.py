"""The ``idempotency_maintenance`` role: prune idempotency records past their retention.

Stripe removes a key once it is at least 24 hours old, and a key used again after that is a
new request; Hardcount keeps records ``HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS`` (24 by default,
never less) and this role deletes the expired ones, one replica at a time under its leader
lease, every ``HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S`` seconds (default 300). The claim
already treats an expired record as absent, so the role's cadence only bounds the table's
size, never what a client sees. Rules: docs/decisions/0023.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from hardcount.idempotency import prune_expired
from hardcount.scheduler import TickContext


class IdempotencyMaintenanceRole:
    """Scheduler role ``idempotency_maintenance`` (in ``HARDCOUNT_ROLES`` by default)."""

    name = "idempotency_maintenance"

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: ``HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S`` (default 300)."""
        return float(settings.HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S)

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """Prune in fenced batches until none are left; returns ``{"pruned": n}`` for the log line.

        Each batch checks the fencing token in its own transaction and stamps liveness after
        it; a lost lease or a stop request ends the tick between batches.
        """
        pruned = prune_expired(fence=ctx.fence, on_batch=ctx.stamp)
        ctx.stamp()
        return {"pruned": pruned}
