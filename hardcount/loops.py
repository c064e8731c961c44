"""The kernel's maintenance roles: ``idempotency_maintenance`` and ``partition_maintenance``.

The ``idempotency_maintenance`` role: prune idempotency records past their retention.

Stripe removes a key once it is at least 24 hours old, and a key used again after that is a
new request; Hardcount keeps records ``HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS`` (24 by default,
never less) and this role deletes the expired ones, one replica at a time under its leader
lease, every ``HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S`` seconds (default 300). The claim
already treats an expired record as absent, so the role's cadence only bounds the table's
size, never what a client sees. Rules: docs/decisions/0023.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import OperationalError

from hardcount.idempotency import prune_expired
from hardcount.logfmt import logfmt
from hardcount.partitions import Spec, apply_retention, ensure_ahead
from hardcount.scheduler import TickContext

logger = logging.getLogger(__name__)

# SQLSTATE of a lock not granted within lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


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


class PartitionMaintenanceRole:
    """Scheduler role ``partition_maintenance`` (in ``HARDCOUNT_ROLES`` by default): months ahead, then retention.

    For every table of ``HARDCOUNT_PARTITIONED_TABLES``: creates the partitions up to
    ``HARDCOUNT_PARTITION_AHEAD_MONTHS`` past the current month (fenced transactions), then detaches
    ``CONCURRENTLY`` and drops (or archives) those older than the table's ``retention_days``
    (docs/reference/partitions.md). Every step is idempotent; a lock not granted within
    :data:`hardcount.partitions.LOCK_TIMEOUT` leaves the step to the next tick.
    """

    name = "partition_maintenance"

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: ``HARDCOUNT_PARTITION_MAINTENANCE_INTERVAL_S`` (default 3600)."""
        return float(settings.HARDCOUNT_PARTITION_MAINTENANCE_INTERVAL_S)

    def tick(self, ctx: TickContext, *, now: datetime | None = None) -> dict[str, Any]:
        """Returns ``{"created": n, "moved": rows, "detached": n, "skipped": n}`` for the log line (``skipped``: steps
        a lock timeout left to the next tick). ``now`` is the wall clock unless a test passes another."""
        now = now or datetime.now(UTC)
        counts = {"created": 0, "moved": 0, "detached": 0, "skipped": 0}
        for spec, days in partition_specs():
            if not ctx.fence.alive():
                break
            try:
                done = ensure_ahead(spec, now=now, ahead=settings.HARDCOUNT_PARTITION_AHEAD_MONTHS, fence=ctx.fence)
                counts["created"] += done["created"]
                counts["moved"] += done["moved"]
                if days is not None and ctx.fence.alive():
                    detached = apply_retention(spec, now=now, days=days, archive=settings.HARDCOUNT_PARTITION_ARCHIVE)
                    counts["detached"] += len(detached)
            except OperationalError as exc:
                if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                logger.warning(logfmt("partition_step_skipped", table=spec.table, error=str(exc).strip()))
                counts["skipped"] += 1
            ctx.stamp()
        return counts


def partition_specs() -> list[tuple[Spec, int | None]]:
    """The tables of ``HARDCOUNT_PARTITIONED_TABLES`` with their retention in days (None: kept)."""
    return [
        (Spec(table, entry["key"], kind=entry.get("kind", "time"), prefix=entry.get("prefix", "")),
         entry.get("retention_days"))
        for table, entry in settings.HARDCOUNT_PARTITIONED_TABLES.items()
    ]  # fmt: skip
