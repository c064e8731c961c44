"""Partitions of the meter-event table: what retention, a month ahead and the conversion cost, each beside the
plain-SQL way of doing the same on the same rows in the same run.

    .venv/bin/python bench/partitions.py                       # 1M meter events over four months
    .venv/bin/python bench/partitions.py --events 5000000

(a) Retention. The oldest month is removed by :func:`hardcount.partitions.apply_retention` (``DETACH … CONCURRENTLY``,
then ``DROP``), beside a ``DELETE`` of the same month's rows (run first, in a transaction rolled back; what the
row-by-row purge would cost, before the vacuum it leaves behind).

(b) A month ahead. :func:`hardcount.partitions.ensure_ahead` adds one month: the length of its transaction is how long
the table's ``ACCESS EXCLUSIVE`` lock is held.

(c) Conversion. ``billing_meterevent`` is migrated back to a plain table with the same rows, then the migration
converts it again; beside it, a plain copy of the same rows into a table like it (indexes and constraints
included).

Runs in a throw-away database ``bench_partitions`` (created and migrated, dropped at the end) on the embedded
PostgreSQL or ``DATABASE_URL``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_partitions")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

CUSTOMERS = 1_000
MONTHS = 4


def _seed(events: int, first: datetime) -> str:
    """A tenant, its customers and ``events`` meter events spread evenly over ``MONTHS`` months from ``first``."""
    from django.db import connection

    from billing.models import Customer
    from hardcount.models import Tenant

    tenant = Tenant.objects.create(name="Bench")
    Customer.objects.bulk_create(
        Customer(tenant=tenant, livemode=False, email=f"c{n}@bench.test") for n in range(CUSTOMERS)
    )
    ids = list(Customer.objects.filter(tenant=tenant).values_list("id", flat=True))
    from hardcount.partitions import add_months

    span_s = (add_months(first, MONTHS) - first).total_seconds()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_meterevent (id, tenant_id, livemode, event_name, customer_id, identifier, value, "
            "payload, timestamp, created_at) "
            "SELECT 'mev_bench' || g, %(tenant)s, false, 'api', (%(ids)s::text[])[1 + g %% %(n)s], 'i' || g, 1, "
            "'{}', %(first)s::timestamptz + make_interval(secs => (g::float8 / %(events)s) * %(span)s), now() "
            "FROM generate_series(0, %(events)s - 1) AS g",
            {"tenant": tenant.id, "ids": ids, "n": len(ids), "first": first, "events": events, "span": span_s},
        )
        cursor.execute("VACUUM ANALYZE billing_meterevent")
    return tenant.id


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection, transaction
    from django.db.migrations.executor import MigrationExecutor

    from hardcount import partitions

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        spec = partitions.Spec("billing_meterevent", "timestamp")
        now = datetime.now(UTC)
        first = partitions.add_months(partitions.month_start(now), -(MONTHS - 1))
        # The table as the migration left it covers this month on; the bench's older months are added first.
        with connection.cursor() as cursor:
            months = partitions.months_of(cursor, spec)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("DROP TABLE billing_meterevent_before")
            month = first
            while month < months[0]:
                cursor.execute(
                    f"CREATE TABLE {spec.month_name(month)} PARTITION OF billing_meterevent FOR VALUES FROM "
                    f"({spec.bound(month)}) TO ({spec.bound(partitions.add_months(month, 1))})"
                )
                month = partitions.add_months(month, 1)
            cursor.execute(
                "CREATE TABLE billing_meterevent_before PARTITION OF billing_meterevent FOR VALUES FROM (MINVALUE) "
                f"TO ({spec.bound(first)})"
            )
        started = time.perf_counter()
        _seed(args.events, first)
        print(f"seeded {args.events:,} meter events over {MONTHS} months in {time.perf_counter() - started:.1f} s")
        month_rows = args.events // MONTHS

        # (a) Retention of the oldest month.
        lo, hi = first, partitions.add_months(first, 1)

        def delete():
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("DELETE FROM billing_meterevent WHERE timestamp >= %s AND timestamp < %s", [lo, hi])
                transaction.set_rollback(True)

        delete_s = _timed(delete)
        days = (now - hi).days  # the oldest month (and the empty _before) only
        detach_s = _timed(lambda: partitions.apply_retention(spec, now=now, days=days))
        print(
            f"(a) retention of one month (~{month_rows:,} rows): DETACH CONCURRENTLY + DROP {detach_s * 1000:.0f} ms"
            f" | DELETE of the same rows {delete_s * 1000:.0f} ms ({delete_s / detach_s:.0f}x)"
        )

        # (b) One month ahead.
        from django.conf import settings

        done = {}
        add_s = _timed(
            lambda: done.update(
                partitions.ensure_ahead(spec, now=now, ahead=settings.HARDCOUNT_PARTITION_AHEAD_MONTHS + 1)
            )
        )
        print(f"(b) {done['created']} month ahead: its transaction (the ACCESS EXCLUSIVE lock) {add_s * 1000:.1f} ms")

        # (c) Conversion, beside a plain copy into a table like it.
        executor = MigrationExecutor(connection)
        (parent,) = [
            p.key for p in executor.loader.graph.node_map[("billing", "0022_monthly_partitions")].parents
            if p.key[0] == "billing"
        ]  # fmt: skip
        executor.migrate([parent])
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM billing_meterevent")
            rows = cursor.fetchone()[0]
        copy_s = _timed(
            lambda: connection.cursor().execute(
                "CREATE TABLE bench_copy (LIKE billing_meterevent INCLUDING ALL); "
                "INSERT INTO bench_copy SELECT * FROM billing_meterevent"
            )
        )
        executor = MigrationExecutor(connection)
        convert_s = _timed(lambda: executor.migrate([("billing", "0022_monthly_partitions")]))
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM billing_meterevent")
            kept = cursor.fetchone()[0]
        print(
            f"(c) conversion of {rows:,} rows: migration {convert_s:.1f} s (rows after: {kept:,})"
            f" | plain copy into a table like it {copy_s:.1f} s ({convert_s / copy_s:.2f}x)"
        )
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
