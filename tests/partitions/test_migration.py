"""The partitioning migrations keep every row: a book seeded on the tables as they were, migrated forward,
reads back the same rows, each in the partition of its month, and migrates back the same way."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from hardcount.ids import floor_id
from tests.admin import rows

from .conftest import id_at, partition_of

pytestmark = pytest.mark.django_db(transaction=True)

MIGRATIONS = [("outbox", "0005_monthly_partitions"), ("billing", "0022_monthly_partitions")]
TABLES = {
    "outbox_event": "id",
    "outbox_delivery": "id",
    "outbox_deliveryattempt": "id",
    "billing_billingattempt": "id",
    "billing_paymentattempt": "id",
    "billing_meterevent": "id",
}


def migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)


def latest() -> list[tuple[str, str]]:
    """Every app's last migration: where the rest of the session's tests expect the schema to be."""
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


def previous(app: str, name: str) -> tuple[str, str]:
    """The migration of ``app`` that ``name`` follows (whatever it is numbered after a merge)."""
    graph = MigrationExecutor(connection).loader.graph
    (parent,) = [p for p in graph.node_map[(app, name)].parents if p.key[0] == app]
    return parent.key


def snapshot() -> dict[str, list[tuple]]:
    """Every row of every table, as text, ordered by id."""
    out = {}
    with connection.cursor() as cursor:
        for table, order in TABLES.items():
            cursor.execute(f"SELECT t::text FROM {table} t ORDER BY {order}")
            out[table] = [row[0] for row in cursor.fetchall()]
    return out


def is_partitioned(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", [table])
        return cursor.fetchone()[0] == "p"


def seed(tenant, months: list[datetime]) -> None:
    """Events, deliveries, attempts, billing and payment attempts and meter events made in each of ``months``."""
    from billing.models import BillingAttempt, BillingRun, Meter, MeterEvent, PaymentAttempt

    # Invoices as they were before the partitioning: migrations after it may add columns the tables lack here.
    OldInvoice = (
        MigrationExecutor(connection)
        .loader.project_state([previous(app, name) for app, name in MIGRATIONS])
        .apps.get_model("billing", "Invoice")
    )
    from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint

    endpoint = WebhookEndpoint.objects.create(
        tenant=tenant, livemode=False, url="http://127.0.0.1:9/x", enabled_events=["*"], secret="whsec_x"
    )
    sub = rows.subscription(tenant)
    Meter.objects.create(tenant=tenant, livemode=False, display_name="API", event_name="api", formula="sum")
    now = timezone.now()
    run = BillingRun.objects.create(trigger="scheduler", livemode=False, as_of=now, started_at=now)
    for n, month in enumerate(months):
        at = month + timedelta(days=3, hours=n)
        event = Event.objects.create(id=id_at("evt", at), tenant=tenant, livemode=False, type="x", data={"n": n})
        delivery = Delivery.objects.create(id=id_at("whd", at), event=event, endpoint=endpoint)
        for number in (1, 2):
            DeliveryAttempt.objects.create(id=id_at("wha", at), delivery=delivery, number=number)
        invoice = OldInvoice.objects.create(
            id=id_at("in", at), tenant_id=tenant.pk, livemode=False, customer_id=sub.customer_id,
            subscription_id=sub.pk, status="open", tax_status="not_applicable", currency=sub.price.currency,
            period_start=sub.billing_cycle_anchor + timedelta(days=30 * n),
            period_end=sub.billing_cycle_anchor + timedelta(days=30 * (n + 1)),
            subtotal=sub.price.amount, total=sub.price.amount, amount_due=sub.price.amount,
        )  # fmt: skip
        PaymentAttempt.objects.create(
            tenant=tenant, livemode=False, invoice_id=invoice.pk, attempt_number=1, amount=1000, currency="usd",
            outcome="declined",
        )  # fmt: skip
        PaymentAttempt.objects.create(
            tenant=tenant, livemode=False, invoice_id=invoice.pk, attempt_number=2, amount=1000, currency="usd",
            outcome="succeeded",
        )  # fmt: skip
        BillingAttempt.objects.create(
            id=id_at("batt", at), run=run, subscription=sub, invoice_id=invoice.pk, outcome="billed", created_at=at
        )
        MeterEvent.objects.bulk_create(
            MeterEvent(
                id=id_at("mev", at), tenant=tenant, livemode=False, event_name="api", customer_id=sub.customer_id,
                identifier=f"i{n}-{k}", value=k, payload={}, timestamp=at + timedelta(minutes=k), created_at=at,
            )
            for k in range(3)
        )  # fmt: skip
    # An id hardcount.ids never made (a test's or an import's) still has a partition to go to.
    Event.objects.create(id="evt_imported", tenant=tenant, livemode=False, type="x", data={})


def test_the_migrations_keep_every_row_in_its_months_partition(tenant):
    targets = [previous(app, name) for app, name in MIGRATIONS]
    migrate(targets)
    try:
        assert not any(is_partitioned(t) for t in TABLES)  # the negative control: the tables as they were
        now = datetime.now(UTC)
        this = datetime(now.year, now.month, 1, tzinfo=UTC)
        months = [(this - timedelta(days=32 * k)).replace(day=1) for k in (2, 1, 0)]
        seed(tenant, months)
        before = snapshot()
        assert [len(before[t]) for t in TABLES] == [4, 3, 6, 3, 6, 9]
    finally:
        migrate(MIGRATIONS)
        # Later migrations (after the partitioning ones) were unapplied by the step back: reapply them.
        migrate(latest())
    assert all(is_partitioned(t) for t in TABLES)
    assert snapshot() == before
    for month in months:
        suffix = f"_p{month.year:04d}_{month.month:02d}"
        lo, hi = month, (month + timedelta(days=32)).replace(day=1)
        assert partition_of("billing_meterevent", "timestamp >= %s AND timestamp < %s", [lo, hi]) == [
            "billing_meterevent" + suffix
        ]
        assert partition_of("outbox_event", "id >= %s AND id < %s", [floor_id("evt", lo), floor_id("evt", hi)]) == [
            "outbox_event" + suffix
        ]
    assert partition_of("outbox_event", "id = 'evt_imported'") == ["outbox_event_after"]
    # Each attempt lies in its delivery's month, each payment attempt in its invoice's.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM outbox_deliveryattempt a JOIN outbox_delivery d ON d.id = a.delivery_id "
            "WHERE replace(a.tableoid::regclass::text, 'deliveryattempt', '') <> "
            "replace(d.tableoid::regclass::text, 'delivery', '')"
        )
        assert cursor.fetchone()[0] == 0

    # And back: the plain tables hold the same rows.
    migrate([previous(app, name) for app, name in MIGRATIONS])
    try:
        assert not any(is_partitioned(t) for t in TABLES)
        assert snapshot() == before
    finally:
        migrate(latest())
