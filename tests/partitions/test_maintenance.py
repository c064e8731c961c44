"""The partition_maintenance role: months created ahead, rows never refused, retention by detach.

Retention is shown on a table of its own (``partition_probe``, converted like the real ones), so
dropping its old months leaves the product's tables alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.db import DatabaseError, connection, transaction

from hardcount import partitions as p
from hardcount.fencing import NO_FENCE
from hardcount.loops import PartitionMaintenanceRole, partition_specs
from hardcount.scheduler import TickContext

from .conftest import partition_of, partitions

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 6, 15, 12, tzinfo=UTC)
PROBE = p.Spec("partition_probe", "created_at")


def execute(sql: str, params=None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def rows(where: str = "true") -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT note FROM partition_probe WHERE {where} ORDER BY created_at")
        return [row[0] for row in cursor.fetchall()]


def insert(note: str, at: datetime) -> None:
    execute("INSERT INTO partition_probe (id, created_at, note) VALUES (%s, %s, %s)", [note, at, note])


@pytest.fixture
def probe():
    """``partition_probe`` converted on NOW: February (its oldest row) to August, with _before and _after."""
    execute("CREATE TABLE partition_probe (id text NOT NULL, created_at timestamptz NOT NULL, note text NOT NULL)")
    execute("ALTER TABLE partition_probe ADD CONSTRAINT partition_probe_pkey PRIMARY KEY (id)")
    insert("feb", datetime(2026, 2, 10, tzinfo=UTC))
    insert("may", datetime(2026, 5, 1, tzinfo=UTC))
    with transaction.atomic():
        p.convert(
            SimpleNamespace(connection=connection), PROBE, partitioned=True, now=NOW,
            constraints={"partition_probe_pkey": "PRIMARY KEY (id, created_at)"},
        )  # fmt: skip
    yield
    execute("DROP TABLE IF EXISTS partition_probe")
    execute(f"DROP SCHEMA IF EXISTS {p.ARCHIVE_SCHEMA} CASCADE")


def months(table: str = "partition_probe") -> list[str]:
    return [name.removeprefix(table + "_") for name in partitions(table)]


def test_a_conversion_covers_every_key_from_minvalue_to_maxvalue(probe):
    assert months() == ["after", "before", "p2026_02", "p2026_03", "p2026_04", "p2026_05", "p2026_06",
                        "p2026_07", "p2026_08"]  # fmt: skip
    insert("ancient", datetime(1900, 1, 1, tzinfo=UTC))
    insert("far", datetime(2300, 1, 1, tzinfo=UTC))
    assert partition_of("partition_probe", "note = 'ancient'") == ["partition_probe_before"]
    assert partition_of("partition_probe", "note = 'far'") == ["partition_probe_after"]
    assert partition_of("partition_probe", "note = 'may'") == ["partition_probe_p2026_05"]


def test_months_ahead_are_created_and_take_the_rows_after_held(probe):
    insert("october", datetime(2026, 10, 3, tzinfo=UTC))  # e.g. a test clock's usage, months ahead
    assert partition_of("partition_probe", "note = 'october'") == ["partition_probe_after"]
    done = p.ensure_ahead(PROBE, now=datetime(2026, 8, 2, tzinfo=UTC), ahead=2)
    assert done == {"created": 2, "moved": 1}
    assert months()[-2:] == ["p2026_09", "p2026_10"]
    assert partition_of("partition_probe", "note = 'october'") == ["partition_probe_p2026_10"]
    assert p.ensure_ahead(PROBE, now=datetime(2026, 8, 2, tzinfo=UTC), ahead=2) == {"created": 0, "moved": 0}
    insert("november", datetime(2026, 11, 1, tzinfo=UTC))  # past the last month: _after again
    assert partition_of("partition_probe", "note = 'november'") == ["partition_probe_after"]


def test_retention_detaches_concurrently_and_drops_the_months_past_it(probe):
    # 60 days before July 10 is May 11: every month ending by May 1 goes (February to April, and _before).
    detached = p.apply_retention(PROBE, now=datetime(2026, 7, 10, tzinfo=UTC), days=60)
    assert detached == ["partition_probe_before", "partition_probe_p2026_02", "partition_probe_p2026_03",
                        "partition_probe_p2026_04"]  # fmt: skip
    assert months() == ["after", "p2026_05", "p2026_06", "p2026_07", "p2026_08"]
    assert rows() == ["may"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_class WHERE relname LIKE 'partition_probe_p2026_0_' AND relkind = 'r'")
        assert cursor.fetchone()[0] == 4  # dropped, not left behind
    assert p.apply_retention(PROBE, now=datetime(2026, 7, 10, tzinfo=UTC), days=60) == []


def test_retention_can_archive_instead_of_dropping(probe):
    p.apply_retention(PROBE, now=datetime(2026, 5, 10, tzinfo=UTC), days=31, archive=True)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT note FROM {p.ARCHIVE_SCHEMA}.partition_probe_p2026_02")
        assert cursor.fetchall() == [("feb",)]
    assert rows() == ["may"]


def test_postgresql_rules_the_design_follows(probe):
    """DETACH CONCURRENTLY is refused inside a transaction and beside a DEFAULT partition (so there is none)."""
    with pytest.raises(RuntimeError, match="autocommit"), transaction.atomic():
        p.apply_retention(PROBE, now=NOW, days=1)
    with pytest.raises(DatabaseError, match="cannot run inside a transaction block"), transaction.atomic():
        execute("ALTER TABLE partition_probe DETACH PARTITION partition_probe_p2026_02 CONCURRENTLY")
    execute("CREATE TABLE partition_probe_default PARTITION OF partition_probe DEFAULT")
    with pytest.raises(DatabaseError, match="default partition exists"):
        execute("ALTER TABLE partition_probe DETACH PARTITION partition_probe_p2026_02 CONCURRENTLY")


def context(alive: bool = True) -> TickContext:
    fence = NO_FENCE if alive else SimpleNamespace(token=1, check=lambda: None, alive=lambda: False)
    return TickContext(role="partition_maintenance", holder="test", token=1, fence=fence, stamp=lambda *a: True)


def test_the_role_keeps_every_table_two_months_ahead_and_is_idempotent():
    role = PartitionMaintenanceRole()
    now = datetime.now(UTC)
    role.tick(context())  # the test database may have been made in an earlier month
    later = now + timedelta(days=31)
    counts = role.tick(context(), now=later)
    assert counts["created"] == len(partition_specs()) and counts["detached"] == 0 and counts["skipped"] == 0
    last = p.add_months(p.month_start(later), 2)
    for spec, _days in partition_specs():
        assert p.months_of(connection.cursor(), spec)[-1] == last
    assert role.tick(context(), now=later)["created"] == 0
    assert role.tick(context(alive=False), now=later + timedelta(days=62))["created"] == 0  # a lost lease does nothing


def test_the_default_retention_of_each_table():
    days = dict((spec.table, d) for spec, d in partition_specs())
    assert days == {
        "outbox_event": 90, "outbox_delivery": 90, "outbox_deliveryattempt": 400,
        "billing_billingattempt": None, "billing_paymentattempt": None, "billing_meterevent": 1200,
    }  # fmt: skip


def test_meter_events_outlive_the_longest_period_and_its_grace():
    from django.conf import settings

    from billing.services.catalog import MAX_INTERVAL_COUNT

    assert settings.HARDCOUNT_LONGEST_PERIOD_DAYS == MAX_INTERVAL_COUNT["day"]
    assert settings.HARDCOUNT_METER_EVENT_MIN_RETENTION_DAYS == MAX_INTERVAL_COUNT["day"] + 1
    env = {**os.environ, "HARDCOUNT_METER_EVENT_RETENTION_DAYS": str(MAX_INTERVAL_COUNT["day"])}
    setup = [sys.executable, "-c", "import django; django.setup()"]
    shorter = subprocess.run(setup, env=env, capture_output=True, text=True, check=False)
    assert shorter.returncode != 0 and "HARDCOUNT_METER_EVENT_RETENTION_DAYS must be at least" in shorter.stderr
    env["HARDCOUNT_METER_EVENT_RETENTION_DAYS"] = str(MAX_INTERVAL_COUNT["day"] + 1)
    assert subprocess.run(setup, env=env, check=False).returncode == 0


def test_a_concurrent_detach_cut_short_is_finalized_by_the_next_retention(probe):
    """A DETACH … CONCURRENTLY ended between its two transactions leaves the partition pending (PostgreSQL then
    refuses a second concurrent detach of it); the next retention completes it with FINALIZE."""
    import psycopg

    db = connection.settings_dict
    conninfo = {"dbname": db["NAME"], "host": db["HOST"], "port": db["PORT"], "user": db["USER"]}
    if db.get("PASSWORD"):
        conninfo["password"] = db["PASSWORD"]
    with psycopg.connect(**conninfo) as reader, psycopg.connect(**conninfo, autocommit=True) as detacher:
        reader.execute("SELECT count(*) FROM partition_probe")  # an open snapshot the detach must wait out
        detacher.execute("SET statement_timeout = '1s'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            detacher.execute("ALTER TABLE partition_probe DETACH PARTITION partition_probe_p2026_02 CONCURRENTLY")
        reader.rollback()
    assert p._detach_pending(connection.cursor(), "partition_probe") == {"partition_probe_p2026_02"}
    with pytest.raises(DatabaseError, match="already pending detach"):  # any other detach of the table too
        execute("ALTER TABLE partition_probe DETACH PARTITION partition_probe_before CONCURRENTLY")
    detached = p.apply_retention(PROBE, now=datetime(2026, 4, 10, tzinfo=UTC), days=31)
    assert detached == ["partition_probe_p2026_02", "partition_probe_before"]
    assert "p2026_02" not in months() and rows() == ["may"]


def test_the_months_ahead_metric_reads_the_catalog():
    from hardcount.partitions import PartitionMetrics

    PartitionMaintenanceRole().tick(context())
    (family,) = PartitionMetrics().collect()
    ahead = {sample.labels["table"]: sample.value for sample in family.samples}
    assert set(ahead) == {spec.table for spec, _days in partition_specs()}
    assert all(value >= 2 for value in ahead.values()), ahead
    # The value is the last month's distance from the current one, as the catalog has it.
    last = p.months_of(connection.cursor(), partition_specs()[0][0])[-1]
    current = p.month_start(datetime.now(UTC))
    assert ahead["outbox_event"] == (last.year - current.year) * 12 + last.month - current.month


def test_the_role_is_configured_by_default():
    """Without it no month is created past the migration's and no partition is ever retired: the role must run in a
    deployment that sets nothing."""
    from django.conf import settings

    from hardcount.scheduler import configured_roles

    assert "hardcount.loops.PartitionMaintenanceRole" in settings.HARDCOUNT_ROLES
    (role,) = configured_roles(["partition_maintenance"])
    assert isinstance(role, PartitionMaintenanceRole)
    assert role.interval_s == 3600.0
