"""Outbox maintenance: the reaper of expired delivery leases, and retention of old deliveries.

Both are plain functions over Django's connection plus a small class with one ``tick()``
so the scheduler runtime can run them as a maintenance loop. The executor also reaps on
its own event loop (``outbox.executor.reap_expired_claims_async``) with the same SQL, so
expired leases are re-queued even where no scheduler runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction

from outbox import queries
from outbox.executor import LEASE_LOST, lost_attempt_params
from outbox.metrics import DELIVERY_ATTEMPTS

log = logging.getLogger("outbox.loops")

# RETENTION_DELETE_BATCH: remove one batch of succeeded deliveries completed before the
# cutoff, with their attempts, in one statement. SKIP LOCKED and a small batch keep every
# lock short; links from replays to a removed delivery are cleared first. Failed
# deliveries are kept: they are what operators replay.
RETENTION_DELETE_BATCH = """
WITH doomed AS (
    SELECT id FROM outbox_delivery
    WHERE status = 'succeeded' AND completed_at < now() - make_interval(days => %(days)s)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), unlinked AS (
    UPDATE outbox_delivery SET replay_of_id = NULL WHERE replay_of_id IN (SELECT id FROM doomed)
), attempts AS (
    DELETE FROM outbox_deliveryattempt WHERE delivery_id IN (SELECT id FROM doomed)
)
DELETE FROM outbox_delivery WHERE id IN (SELECT id FROM doomed)
"""


def reap_expired_claims(*, reaper_id: str = "reaper", limit: int = 500) -> int:
    """Re-queue deliveries whose lease expired (``queries.REAP_EXPIRED_CLAIMS``); returns how many.

    Each re-queued delivery gets a ``lease_lost`` attempt row for the attempt its executor
    held; one whose 8th attempt was lost is failed instead. Rows whose lease was renewed in
    the meantime are never touched (the UPDATE re-checks the expiry).
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(queries.REAP_EXPIRED_CLAIMS, {"limit": limit})
        names = [col.name for col in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        evidence = [
            lost_attempt_params(
                delivery_id=r["id"], lost_claim=r["lost_claim"], number=r["prev_attempts"], recorded_by=reaper_id
            )
            for r in rows
            if r["prev_attempts"] >= 1
        ]
        if evidence:
            cursor.executemany(queries.INSERT_ATTEMPT, evidence)
    if evidence:
        DELIVERY_ATTEMPTS.labels(outcome=LEASE_LOST).inc(len(evidence))
    if rows:
        log.info("outbox reaper re-queued %d deliveries with expired leases reaper=%s", len(rows), reaper_id)
    return len(rows)


def purge_delivered(*, retention_days: int | None = None, batch: int = 1000, max_batches: int = 100) -> int:
    """Delete succeeded deliveries (and their attempts) completed over ``retention_days`` ago.

    ``retention_days`` defaults to ``HARDCOUNT_OUTBOX_RETENTION_DAYS`` (30). Works in batches
    of ``batch`` rows, each its own short transaction, at most ``max_batches`` per call;
    returns the number of deliveries removed. Events are kept.
    """
    if retention_days is None:
        retention_days = getattr(settings, "HARDCOUNT_OUTBOX_RETENTION_DAYS", 30)
    days = int(retention_days)
    removed = 0
    for _ in range(max_batches):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(RETENTION_DELETE_BATCH, {"days": days, "limit": batch})
            count = cursor.rowcount
        removed += count
        if count < batch:
            break
    if removed:
        log.info("outbox retention removed %d delivered rows older than %d days", removed, days)
    return removed


@dataclass
class OutboxMaintenance:
    """A maintenance loop's tick: reap expired leases, then purge old delivered rows."""

    reaper_id: str = "outbox-maintenance"

    def tick(self, fence=None) -> dict[str, int]:
        """One pass; ``fence`` is accepted for the runtime's role protocol (the work is idempotent)."""
        return {"reaped": reap_expired_claims(reaper_id=self.reaper_id), "purged": purge_delivered()}


__all__ = ["RETENTION_DELETE_BATCH", "OutboxMaintenance", "purge_delivered", "reap_expired_claims"]
