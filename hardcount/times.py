"""The one clock and the one time format.

Every due-time and lease decision uses PostgreSQL's ``now()``, never the application's
clock (docs/reference/guarantees.md); every time the API or an event shows is ISO 8601 UTC
with a ``Z``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection


def database_now() -> datetime:
    """PostgreSQL's ``now()``, UTC-aware: the current transaction's start (outside one, this statement's)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def iso(value: datetime | None) -> str | None:
    """``2027-01-31T09:30:00Z`` for an aware datetime (converted to UTC), None for None."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
