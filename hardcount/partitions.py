"""Monthly range partitions of the history tables, and their retention (docs/decisions/0177).

A partitioned table has one partition per calendar month (UTC) of its key, ``<table>_pYYYY_MM``,
plus two catch-alls that make the key's whole range covered, so no insert is ever refused:
``<table>_before`` (``MINVALUE`` up to the first month) and ``<table>_after`` (the month past the last
one up to ``MAXVALUE``). There is no ``DEFAULT`` partition: PostgreSQL refuses ``DETACH PARTITION …
CONCURRENTLY`` on a table that has one, and retention detaches concurrently.

The key is a time (``kind="time"``) or a time-ordered id (``kind="id"``: the id's leading 48 bits are
its creation millisecond, :mod:`hardcount.ids`), whose month bounds are :func:`hardcount.ids.floor_id`.

Two operations, both idempotent, run by the ``partition_maintenance`` role (:mod:`hardcount.loops`):

- :func:`ensure_ahead` adds the months up to ``ahead`` past the current one, each in one short
  transaction that detaches ``_after``, creates the month, moves into it any rows ``_after`` held in its
  range, and attaches ``_after`` again above it (an ``ACCESS EXCLUSIVE`` lock held for milliseconds,
  under ``lock_timeout``);
- :func:`apply_retention` detaches every partition whose upper bound is older than the retention with
  ``DETACH PARTITION … CONCURRENTLY`` (outside any transaction), then drops it or moves it to the
  ``partition_archive`` schema.

:func:`convert` is what the migrations use to turn a plain table into a partitioned one (and back).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection as default_connection
from django.db import transaction

from hardcount.ids import floor_id

ARCHIVE_SCHEMA = "partition_archive"
# How long a partition DDL waits for a lock before giving up until the next tick: a waiting
# ACCESS EXCLUSIVE request queues every later reader of the table behind it.
LOCK_TIMEOUT = "2s"
# How many months back a conversion gives their own partition (older rows go to ``_before``).
OLDEST_MONTHS = 36


@dataclass(frozen=True)
class Spec:
    """A partitioned table: ``table``, its partition ``key`` column, ``kind`` (``time`` or ``id``) and, for
    ``id``, the ids' ``prefix`` (``evt``)."""

    table: str
    key: str
    kind: str = "time"
    prefix: str = ""

    def bound(self, month: datetime) -> str:
        """The SQL literal of the key's value at the start of ``month`` (aware, UTC)."""
        if self.kind == "id":
            return f"'{floor_id(self.prefix, month)}'"
        return f"'{month.isoformat()}'::timestamptz"

    def month_name(self, month: datetime) -> str:
        return f"{self.table}_p{month.year:04d}_{month.month:02d}"


def month_start(at: datetime) -> datetime:
    """The first instant (UTC) of ``at``'s month."""
    at = at.astimezone(UTC)
    return datetime(at.year, at.month, 1, tzinfo=UTC)


def add_months(month: datetime, n: int) -> datetime:
    index = month.year * 12 + month.month - 1 + n
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


_MONTH = re.compile(r"_p(\d{4})_(\d{2})$")


def months_of(cursor, spec: Spec) -> list[datetime]:
    """The months that have a partition of ``spec.table``, oldest first."""
    months = []
    for name in partition_names(cursor, spec.table):
        match = _MONTH.search(name)
        if match and name == spec.month_name(datetime(int(match[1]), int(match[2]), 1, tzinfo=UTC)):
            months.append(datetime(int(match[1]), int(match[2]), 1, tzinfo=UTC))
    return sorted(months)


def partition_names(cursor, table: str) -> list[str]:
    """The attached partitions of ``table`` (detach-pending ones included)."""
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass ORDER BY c.relname",
        [table],
    )
    return [row[0] for row in cursor.fetchall()]


def is_partitioned(cursor, table: str) -> bool:
    cursor.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = %s::regclass", [table])
    row = cursor.fetchone()
    return bool(row and row[0])


# --- creating months ahead -----------------------------------------------------------------------------------------


def ensure_ahead(spec: Spec, *, now: datetime, ahead: int, fence=None, connection=None) -> dict[str, int]:
    """Give ``spec.table`` a partition for every month from the current one to ``ahead`` months past it.

    Returns ``{"created": n, "moved": rows}`` (``moved``: rows ``_after`` held in the new months, e.g. usage
    of a test clock far ahead). Each month is one transaction, fenced by ``fence.check()`` when given.
    Raises ``OperationalError`` when a lock is not granted within :data:`LOCK_TIMEOUT` (the next tick retries).
    """
    connection = connection or default_connection
    created = moved = 0
    target = add_months(month_start(now), ahead)
    while True:
        with connection.cursor() as cursor:
            months = months_of(cursor, spec)
        if not months:
            raise RuntimeError(f"{spec.table} has no monthly partition: it was not converted")
        nxt = add_months(months[-1], 1)
        if nxt > target:
            return {"created": created, "moved": moved}
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            if fence is not None:
                fence.check()
            cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            moved += _add_month(cursor, spec, nxt)
        created += 1


def _add_month(cursor, spec: Spec, month: datetime) -> int:
    after, key = f"{spec.table}_after", spec.key
    lower, upper = spec.bound(month), spec.bound(add_months(month, 1))
    cursor.execute(f"ALTER TABLE {spec.table} DETACH PARTITION {after}")
    cursor.execute(
        f"CREATE TABLE {spec.month_name(month)} PARTITION OF {spec.table} FOR VALUES FROM ({lower}) TO ({upper})"
    )
    # The parent routes the moved rows into the new month (nothing references these tables' rows).
    cursor.execute(
        f"WITH moved AS (DELETE FROM {after} WHERE {key} < {upper} RETURNING *) "
        f"INSERT INTO {spec.table} SELECT * FROM moved"
    )
    moved = cursor.rowcount
    # A CHECK proving the bound lets ATTACH skip its validating scan of the table.
    cursor.execute(f"ALTER TABLE {after} ADD CONSTRAINT {after}_bound CHECK ({key} >= {upper})")
    cursor.execute(f"ALTER TABLE {spec.table} ATTACH PARTITION {after} FOR VALUES FROM ({upper}) TO (MAXVALUE)")
    cursor.execute(f"ALTER TABLE {after} DROP CONSTRAINT {after}_bound")
    return max(moved, 0)


# --- retention -----------------------------------------------------------------------------------------------------


def expired(cursor, spec: Spec, *, cutoff: datetime) -> list[str]:
    """Partitions of ``spec.table`` whose every key lies before ``cutoff``'s month (oldest first): each month
    whose end is at or before ``month_start(cutoff)``, and ``_before`` once the first month is."""
    months = months_of(cursor, spec)
    limit = month_start(cutoff)
    names = [spec.month_name(m) for m in months if add_months(m, 1) <= limit]
    if months and months[0] <= limit and f"{spec.table}_before" in partition_names(cursor, spec.table):
        names.insert(0, f"{spec.table}_before")
    return names


def apply_retention(spec: Spec, *, now: datetime, days: int, archive: bool = False, connection=None) -> list[str]:
    """Detach (``CONCURRENTLY``) and drop, or archive, the partitions of ``spec.table`` older than ``days``.

    ``connection`` must be in autocommit (not inside ``atomic``): ``DETACH … CONCURRENTLY`` cannot run in a
    transaction block. A detach an earlier tick left pending (its session died between the two
    transactions of a concurrent detach) is completed with ``FINALIZE`` first: PostgreSQL refuses any
    other detach of the table meanwhile. Returns the names detached, in that order.
    """
    connection = connection or default_connection
    if connection.in_atomic_block:
        raise RuntimeError("apply_retention needs autocommit: DETACH CONCURRENTLY cannot run in a transaction")
    done = []
    with connection.cursor() as cursor:
        cursor.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
        try:
            # A pending detach blocks every other detach of the table, so it is finished first.
            pending = _detach_pending(cursor, spec.table)
            names = expired(cursor, spec, cutoff=now - timedelta(days=days))
            for name in sorted(pending & set(names)) + [n for n in names if n not in pending]:
                if name in pending:
                    cursor.execute(f"ALTER TABLE {spec.table} DETACH PARTITION {name} FINALIZE")
                else:
                    cursor.execute(f"ALTER TABLE {spec.table} DETACH PARTITION {name} CONCURRENTLY")
                if archive:
                    cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {ARCHIVE_SCHEMA}")
                    cursor.execute(f"ALTER TABLE {name} SET SCHEMA {ARCHIVE_SCHEMA}")
                else:
                    cursor.execute(f"DROP TABLE {name}")
                done.append(name)
        finally:
            cursor.execute("RESET lock_timeout")
    return done


def _detach_pending(cursor, table: str) -> set[str]:
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass AND i.inhdetachpending",
        [table],
    )
    return {row[0] for row in cursor.fetchall()}


# --- converting a table --------------------------------------------------------------------------------------------


def convert(
    schema_editor,
    spec: Spec,
    *,
    partitioned: bool,
    constraints: Mapping[str, str | None],
    now: datetime | None = None,
    ahead: int = 2,
) -> None:
    """Rebuild ``spec.table`` partitioned by month of ``spec.key`` (``partitioned=True``) or plain again, keeping
    every row, column default, CHECK, index, foreign key out of it, trigger, grant, row-level-security policy,
    and the policies of other tables that read it.

    ``constraints`` maps the name of a primary key, unique constraint or index to its SQL in the rebuilt table
    (``"PRIMARY KEY (id, invoice_id)"``, ``"UNIQUE (delivery_id, number)"``, or ``"INDEX (sequence)"``), or to
    None to leave it out; the others are copied as they are. Partitions: every month from the oldest row's
    (or the current one) to ``ahead`` months past ``now``, with ``_before`` and ``_after`` around them.
    Nothing may reference the table by a foreign key (drop those first). Runs inside the migration's transaction.
    """
    now = now or datetime.now(UTC)
    table, old = spec.table, f"{spec.table}__unpartitioned"
    with schema_editor.connection.cursor() as cursor:
        definitions = _definitions(cursor, table, constraints)
        dependents = _dependent_policies(cursor, table)
        for name, policy_table, _sql in dependents:
            cursor.execute(f"DROP POLICY {name} ON {policy_table}")
        cursor.execute(f"ALTER TABLE {table} RENAME TO {old}")
        like = f"(LIKE {old} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS)"
        if partitioned:
            cursor.execute(f"CREATE TABLE {table} {like} PARTITION BY RANGE ({spec.key})")
            cursor.execute(f"SELECT min({spec.key}) FROM {old}")
            oldest = cursor.fetchone()[0]
            # Months from the oldest row's, but no further back than OLDEST_MONTHS: rows older than that (or ids
            # not made by hardcount.ids) lie in _before.
            first = month_start(now)
            if oldest is not None:
                at = oldest if spec.kind == "time" else _id_time(oldest)
                first = max(min(first, month_start(at)), add_months(month_start(now), -OLDEST_MONTHS))
            last = add_months(month_start(now), ahead)
            cursor.execute(
                f"CREATE TABLE {table}_before PARTITION OF {table} FOR VALUES FROM (MINVALUE) TO ({spec.bound(first)})"
            )
            month = first
            while month <= last:
                cursor.execute(
                    f"CREATE TABLE {spec.month_name(month)} PARTITION OF {table} "
                    f"FOR VALUES FROM ({spec.bound(month)}) TO ({spec.bound(add_months(month, 1))})"
                )
                month = add_months(month, 1)
            cursor.execute(
                f"CREATE TABLE {table}_after PARTITION OF {table} FOR VALUES FROM ({spec.bound(month)}) TO (MAXVALUE)"
            )
        else:
            cursor.execute(f"CREATE TABLE {table} {like}")
        cursor.execute(f"INSERT INTO {table} SELECT * FROM {old}")
        cursor.execute(f"DROP TABLE {old}")
        for sql in definitions:
            cursor.execute(sql)
        for _name, _policy_table, sql in dependents:
            cursor.execute(sql)


def _id_time(value: str) -> datetime:
    from hardcount.ids import _ALPHABET

    digits = value.split("_", 1)[-1][:10].lower()
    if len(digits) < 10 or any(ch not in _ALPHABET for ch in digits):
        return datetime(1970, 1, 1, tzinfo=UTC)
    ms = 0
    for ch in digits:
        ms = ms * 32 + _ALPHABET.index(ch)
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _definitions(cursor, table: str, overrides: Mapping[str, str | None]) -> list[str]:
    """The statements that give a rebuilt ``table`` what the current one has besides columns, CHECKs and defaults."""
    statements: list[str] = []
    cursor.execute(
        "SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype IN ('p', 'u', 'f') ORDER BY contype DESC, conname",
        [table],
    )
    handled = set()
    for name, _contype, sql in cursor.fetchall():
        handled.add(name)
        statements.extend(_override(table, name, overrides[name]) if name in overrides else [])
        if name not in overrides:
            statements.append(f"ALTER TABLE {table} ADD CONSTRAINT {name} {sql}")
    cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname", [table])
    for name, sql in cursor.fetchall():
        if name in handled:
            continue
        handled.add(name)
        statements.extend(_override(table, name, overrides[name]) if name in overrides else [sql])
    for name in sorted(set(overrides) - handled):
        statements.extend(_override(table, name, overrides[name]))
    cursor.execute(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal", [table]
    )
    statements.extend(row[0] for row in cursor.fetchall())
    cursor.execute("SELECT relrowsecurity, relforcerowsecurity FROM pg_class WHERE oid = %s::regclass", [table])
    enabled, forced = cursor.fetchone()
    if enabled:
        statements.append(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
    if forced:
        statements.append(f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY")
    statements.extend(sql for _name, _table, sql in _policies(cursor, "c.oid = %s::regclass", [table]))
    cursor.execute(
        "SELECT a.grantee::regrole::text, string_agg(a.privilege_type, ', ') "
        "FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = %s::regclass AND a.grantee <> c.relowner "
        "AND a.grantee <> 0 GROUP BY a.grantee",
        [table],
    )
    statements.extend(f"GRANT {privileges} ON {table} TO {grantee}" for grantee, privileges in cursor.fetchall())
    return [s for s in statements if s]


def _override(table: str, name: str, sql: str | None) -> list[str]:
    if sql is None:
        return []
    if sql.startswith("INDEX "):
        return [f"CREATE INDEX {name} ON {table} {sql.removeprefix('INDEX ')}"]
    return [f"ALTER TABLE {table} ADD CONSTRAINT {name} {sql}"]


def _policies(cursor, where: str, params: Iterable) -> list[tuple[str, str, str]]:
    cursor.execute(
        "SELECT p.polname, c.relname, p.polpermissive, p.polcmd, "
        "ARRAY(SELECT rolname FROM pg_roles WHERE oid = ANY(p.polroles)), "
        "pg_get_expr(p.polqual, p.polrelid), pg_get_expr(p.polwithcheck, p.polrelid) "
        f"FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid WHERE {where} ORDER BY c.relname, p.polname",
        list(params),
    )
    commands = {"r": "SELECT", "a": "INSERT", "w": "UPDATE", "d": "DELETE", "*": "ALL"}
    out = []
    for name, relname, permissive, cmd, roles, qual, check in cursor.fetchall():
        sql = f"CREATE POLICY {name} ON {relname} AS {'PERMISSIVE' if permissive else 'RESTRICTIVE'}"
        sql += f" FOR {commands[cmd]} TO {', '.join(roles) if roles else 'PUBLIC'}"
        if qual:
            sql += f" USING ({qual})"
        if check:
            sql += f" WITH CHECK ({check})"
        out.append((name, relname, sql))
    return out


def _dependent_policies(cursor, table: str) -> list[tuple[str, str, str]]:
    """Policies of other tables whose expressions read ``table`` (a child's policy through its parent row)."""
    return _policies(
        cursor,
        "p.polrelid <> %s::regclass AND p.oid IN (SELECT objid FROM pg_depend WHERE classid = 'pg_policy'::regclass "
        "AND refclassid = 'pg_class'::regclass AND refobjid = %s::regclass)",
        [table, table],
    )


def operation(spec: Spec, *, forward: Mapping[str, str | None], backward: Mapping[str, str | None]):
    """A migration operation converting ``spec.table`` (``forward``: the ``constraints`` of :func:`convert` for the
    partitioned table, ``backward``: for the plain one)."""
    from django.db import migrations

    def partition(apps, schema_editor):
        convert(schema_editor, spec, partitioned=True, constraints=forward)

    def unpartition(apps, schema_editor):
        convert(schema_editor, spec, partitioned=False, constraints=backward)

    return migrations.RunPython(partition, unpartition, elidable=False)


# --- metrics -------------------------------------------------------------------------------------------------------


class PartitionMetrics:
    """``hardcount_partition_months_ahead{table}``: months past the current one (UTC) that have their own
    partition, per table of ``HARDCOUNT_PARTITIONED_TABLES`` (below the setting: the role has not kept up;
    negative: rows of this month already go to ``_after``). Read from the catalog at scrape time."""

    def describe(self):
        """The family, empty: touches no database."""
        return [self._family()]

    def collect(self):
        """The family filled from the catalog, on the caller's connection."""
        from django.conf import settings

        family = self._family()
        current = month_start(datetime.now(UTC))
        with default_connection.cursor() as cursor:
            for table, entry in settings.HARDCOUNT_PARTITIONED_TABLES.items():
                spec = Spec(table, entry["key"], kind=entry.get("kind", "time"), prefix=entry.get("prefix", ""))
                months = months_of(cursor, spec) if is_partitioned(cursor, table) else []
                if months:
                    last = months[-1]
                    family.add_metric([table], (last.year - current.year) * 12 + last.month - current.month)
        return [family]

    @staticmethod
    def _family():
        from prometheus_client.core import GaugeMetricFamily

        return GaugeMetricFamily(
            "hardcount_partition_months_ahead",
            "Months past the current one that have their own partition, per partitioned table.",
            labels=["table"],
        )
