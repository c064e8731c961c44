"""The outbox's entries for the scheduler runtime (``hardcount.scheduler``).

- :class:`ExecutorService`: the leaderless delivery executor, started in every replica
  (``HARDCOUNT_SERVICES``); each runtime gets its own instance, so two runtimes in one
  process behave like two replicas.
- :class:`OutboxMaintenanceRole`: role ``outbox_maintenance`` (``HARDCOUNT_ROLES``), every
  ``HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S`` seconds (default 60) under its lease: the
  reaper of expired delivery leases, then retention of old delivered rows. Executors reap
  on their own too; the role keeps reaping where no executor runs.

Both satisfy the runtime's protocols by shape; nothing here imports the runtime.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from outbox.executor import Executor, ExecutorConfig
from outbox.loops import purge_delivered, reap_expired_claims


class ExecutorService:
    """Scheduler service ``outbox_executor``: ``start()`` starts an :class:`~outbox.executor.Executor`."""

    name = "outbox_executor"

    def __init__(self) -> None:
        self.executor: Executor | None = None

    def start(self) -> None:
        """Start this replica's executor (returns once it is connected; raises if it cannot start)."""
        if self.executor is None:
            self.executor = Executor(ExecutorConfig.from_settings()).start()

    def stop(self) -> None:
        """Stop the executor: requests in flight finish or are cancelled and recorded (see ``Executor.stop``)."""
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.stop()


class OutboxMaintenanceRole:
    """Scheduler role ``outbox_maintenance``: reap expired leases, purge old delivered rows."""

    name = "outbox_maintenance"

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: ``HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S`` (default 60)."""
        return float(getattr(settings, "HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S", 60.0))

    def tick(self, ctx) -> dict[str, Any]:
        """Both steps are idempotent, so they need no fencing; a lost lease stops before the purge."""
        counts = {"reaped": reap_expired_claims(reaper_id=f"maintenance:{ctx.holder}")}
        if ctx.fence.alive():
            counts["purged"] = purge_delivered()
        ctx.stamp()
        return counts
