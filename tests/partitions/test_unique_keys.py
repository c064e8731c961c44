"""The unique keys of the partitioned tables still hold across the whole table, not one partition.

Each is refused twice over: by the statement the product runs, and by a plain INSERT. The negative
controls show what makes it hold: without the constraint (dropped inside a rolled-back transaction) the
duplicate goes in, and PostgreSQL refuses a unique index of a partitioned table that lacks the partition
key, so each key had to include it (or, for meter events, live in the non-partitioned guard table).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, IntegrityError, NotSupportedError, connection, transaction

from billing.queries import insert_meter_events
from outbox import queries

from .conftest import id_at, partition_of

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


def execute(sql: str, params=None) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def count(table: str, where: str, params=()) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table} WHERE {where}", list(params))
        return cursor.fetchone()[0]


def without(constraint_sql: str, body) -> None:
    """Run ``body()`` after ``constraint_sql`` (a DROP) inside a transaction that is rolled back."""
    with pytest.raises(Rollback), transaction.atomic():
        execute(constraint_sql)
        body()
        raise Rollback


def attempt(delivery_id: str, number: int) -> dict:
    return {
        "attempt_id": id_at("wha", datetime.now(UTC)), "delivery_id": delivery_id, "number": number,
        "outcome": "retryable", "status_code": 503, "latency_ms": 5, "error": "", "response_excerpt": "",
        "executor": "test",
    }  # fmt: skip


@pytest.fixture
def delivery(tenant):
    from outbox.models import Delivery, Event, WebhookEndpoint

    endpoint = WebhookEndpoint.objects.create(
        tenant=tenant, livemode=False, url="http://127.0.0.1:9/x", enabled_events=["*"], secret="whsec_x"
    )
    event = Event.objects.create(tenant=tenant, livemode=False, type="x", data={})
    return Delivery.objects.create(event=event, endpoint=endpoint)


def test_one_attempt_per_delivery_and_number(delivery):
    assert execute(queries.INSERT_ATTEMPT, attempt(delivery.id, 1)) == 1
    assert execute(queries.INSERT_ATTEMPT, attempt(delivery.id, 1)) == 0  # the executor's ON CONFLICT still works
    with pytest.raises(IntegrityError), transaction.atomic():
        execute(queries.INSERT_ATTEMPT.split("ON CONFLICT")[0], attempt(delivery.id, 1))
    assert count("outbox_deliveryattempt", "delivery_id = %s", [delivery.id]) == 1

    def duplicate():
        execute(queries.INSERT_ATTEMPT.split("ON CONFLICT")[0], attempt(delivery.id, 1))
        assert count("outbox_deliveryattempt", "delivery_id = %s", [delivery.id]) == 2

    without("ALTER TABLE outbox_deliveryattempt DROP CONSTRAINT delivery_attempt_one_per_number", duplicate)


def test_a_unique_key_without_the_partition_key_is_refused_by_postgresql():
    for sql in (
        "CREATE UNIQUE INDEX probe ON outbox_deliveryattempt (id)",
        "CREATE UNIQUE INDEX probe ON billing_paymentattempt (id)",
        "CREATE UNIQUE INDEX probe ON billing_meterevent (tenant_id, livemode, identifier)",
    ):
        with pytest.raises((NotSupportedError, DatabaseError), match="must include all partitioning columns"):
            with transaction.atomic():
                execute(sql)


@pytest.fixture
def invoices(tenant):
    """Two invoices of one subscription, made (by their ids) in two different months."""
    from billing.models import Invoice
    from tests.admin import rows

    sub = rows.subscription(tenant)
    made = []
    for offset, at in enumerate((datetime.now(UTC) - timedelta(days=40), datetime.now(UTC))):
        invoice = rows.invoice(sub, offset=offset)
        Invoice.objects.filter(pk=invoice.pk).update(id=id_at("in", at))
        made.append(Invoice.objects.get(subscription=sub, period_start=invoice.period_start))
    return made


def pay(invoice, number: int, outcome: str):
    from billing.models import PaymentAttempt

    return PaymentAttempt.objects.create(
        tenant_id=invoice.tenant_id, livemode=False, invoice=invoice, attempt_number=number, amount=1000,
        currency="usd", outcome=outcome,
    )  # fmt: skip


def test_one_payment_attempt_per_invoice_and_number(invoices):
    old, new = invoices
    pay(old, 1, "declined")
    pay(new, 1, "declined")  # another invoice's number 1, in another partition
    assert len(partition_of("billing_paymentattempt", "true")) == 2
    with pytest.raises(IntegrityError), transaction.atomic():
        pay(old, 1, "declined")

    def duplicate():
        pay(old, 1, "declined")
        assert count("billing_paymentattempt", "invoice_id = %s", [old.id]) == 2

    without("ALTER TABLE billing_paymentattempt DROP CONSTRAINT payment_attempt_number_unique", duplicate)


def test_one_succeeded_payment_attempt_per_invoice(invoices):
    old, new = invoices
    pay(old, 1, "succeeded")
    pay(new, 1, "succeeded")
    with pytest.raises(IntegrityError), transaction.atomic():
        pay(old, 2, "succeeded")
    pay(old, 2, "declined")  # only the success is unique

    def duplicate():
        pay(old, 3, "succeeded")
        assert count("billing_paymentattempt", "invoice_id = %s AND outcome = 'succeeded'", [old.id]) == 2

    without("DROP INDEX payment_attempt_one_success", duplicate)


def test_one_meter_event_per_identifier_across_partitions(tenant):
    from tests.admin import rows

    customer = rows.subscription(tenant).customer_id
    now = datetime.now(UTC)

    def event(at: datetime) -> tuple:
        return (id_at("mev", now), "req-1", "api", customer, 1, {}, at.isoformat(), now.isoformat())

    # The identifiers not inserted (seen before): none the first time.
    assert insert_meter_events(tenant_id=tenant.id, livemode=False, rows=[event(now)], now=now) == set()
    # The same identifier at a time of another month (another partition) is admitted by nothing.
    again = [event(now - timedelta(days=40))]
    assert insert_meter_events(tenant_id=tenant.id, livemode=False, rows=again, now=now) == {"req-1"}
    assert count("billing_meterevent", "identifier = 'req-1'") == 1

    # The negative control: the event table alone holds both, one per partition; the guard table is the key.
    second = event(now - timedelta(days=40))
    execute(
        "INSERT INTO billing_meterevent (id, tenant_id, livemode, event_name, customer_id, identifier, value, "
        "payload, timestamp, created_at) VALUES (%s, %s, false, 'api', %s, 'req-1', 1, '{}', %s, %s)",
        [second[0], tenant.id, customer, second[6], now],
    )
    assert count("billing_meterevent", "identifier = 'req-1'") == 2
    assert len(partition_of("billing_meterevent", "identifier = 'req-1'")) == 2
