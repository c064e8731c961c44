"""Helpers for the partition tests: ids made at a chosen time, and the partition a row lies in."""

from __future__ import annotations

import secrets
from datetime import datetime

from django.db import connection

from hardcount.ids import floor_id


def id_at(prefix: str, at: datetime) -> str:
    """An id ``<prefix>_…`` as :func:`hardcount.ids.new_id` would have made it at ``at``."""
    floor = floor_id(prefix, at)
    suffix = "".join(secrets.choice("0123456789abcdefghjkmnpqrstvwxyz") for _ in range(16))
    return floor[:-16] + suffix


def partition_of(table: str, where: str, params=()) -> list[str]:
    """The partitions holding the rows of ``table`` matching ``where``."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT DISTINCT tableoid::regclass::text FROM {table} WHERE {where}", list(params))
        return sorted(row[0] for row in cursor.fetchall())


def partitions(table: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY c.relname",
            [table],
        )
        return [row[0] for row in cursor.fetchall()]
