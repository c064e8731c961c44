"""Dunning's SQL that the ORM cannot say cleanly: the due-run claim, and the database clock.

Each statement is named and says the guarantee it gives. They run on the calling thread's
Django connection, inside the caller's transaction.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection

# CLAIM_DUE_RUNS: lock up to ``limit`` active runs due by ``as_of`` (the DB's now() when null),
# oldest due first, of one mode and one clock (``test_clock_id`` null: wall-clock runs only).
#
# FOR UPDATE SKIP LOCKED: a run another dunning loop has locked is being claimed or settled
# right now, so this loop passes over it instead of waiting and then retrying it a second
# time. A run claimed and committed by another loop has moved its next_attempt_at past
# ``as_of``; PostgreSQL re-checks the WHERE clause on the newest row version before locking
# it, so such a run is not returned either. ``exclude`` keeps a run the caller has already
# handled in this pass from being handled twice.
CLAIM_DUE_RUNS = """
    SELECT id FROM dunning_dunningrun
    WHERE status = 'active'
      AND livemode = %(livemode)s
      AND next_attempt_at <= COALESCE(%(as_of)s::timestamptz, now())
      AND test_clock_id IS NOT DISTINCT FROM %(test_clock_id)s
      AND NOT (id = ANY(%(exclude)s::text[]))
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
"""


def claim_due_runs(
    *, livemode: bool, as_of: datetime | None, test_clock_id: str | None, exclude: list[str], limit: int
) -> list[str]:
    """CLAIM_DUE_RUNS: ids of the due runs now locked by the caller's transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            CLAIM_DUE_RUNS,
            {
                "livemode": livemode,
                "as_of": as_of,
                "test_clock_id": test_clock_id,
                "exclude": exclude,
                "limit": limit,
            },
        )
        return [row[0] for row in cursor.fetchall()]
