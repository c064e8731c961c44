"""Usage billing under a real ``runscheduler`` SIGKILLed between the usage aggregation and the invoice's commit.

A book of subscriptions with a licensed and a metered item, each with events in its first period, is
drained by a replica carrying the kill points of tests/system/faults.py. The close of the period after
(the one that bills the first period's usage, once the grace has passed) is killed at ``after_usage``:
inside step 1's transaction, after the usage statement, before the invoice is written. A successor
finishes the drain: every period has one invoice, every event is billed once (the usage line's quantity
is the events' sum, on one invoice), and the doctor's checks find nothing. Both close paths: the page
close (the default) and the per-close path.

And two real processes ingesting the same batch of identified events at the same moment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from dateutil.relativedelta import relativedelta
from django.db import transaction

from billing.models import Invoice, InvoiceLineItem, MeterEvent, Subscription, SubscriptionItem
from billing.periods import period_bounds
from billing.queries import aggregate_usage
from billing.services import usage
from billing.services.catalog import create_price
from tests.billing.conftest import Book
from tests.system.correctness import (
    SeededBook,
    assert_clean,
    assert_gateway_agrees,
    audit_book,
    billing_env,
    wait_until,
)
from tests.system.faults import arm
from tests.system.harness import BASE_DIR, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

BOOK_SIZE = 6
UNIT = 3  # cents per unit of the metered price


def _seed(book: Book, settings) -> tuple[SeededBook, object, dict[str, int]]:
    """``BOOK_SIZE`` monthly subscriptions (1,000 licensed + ``UNIT`` cents a unit) whose first period ended two
    hours ago (past the one-hour grace of the replicas), with 3 events each in that period; the units per
    subscription. The events are old for this process's grace, so it is widened here (the replicas keep theirs)."""
    from hardcount.times import database_now

    settings.HARDCOUNT_USAGE_GRACE_S = 60 * 86400
    with transaction.atomic():
        tenant = book.tenant("Usage kill")
        meter = usage.create_meter(
            tenant_id=tenant.id, livemode=False, display_name="API", event_name="api_calls", formula="sum"
        )
        metered = create_price(
            tenant_id=tenant.id,
            livemode=False,
            amount=UNIT,
            currency="usd",
            interval="month",
            nickname="Calls",
            recurring={"usage_type": "metered", "meter": meter.id},
        )
        anchor = database_now() - relativedelta(months=1) - timedelta(hours=2)
        subs, units = [], {}
        for i in range(BOOK_SIZE):
            customer = book.customer(tenant)
            sub = book.subscription(customer, book.price(tenant, amount=1000), anchor=anchor + timedelta(seconds=i))
            SubscriptionItem.objects.create(
                tenant_id=tenant.id, livemode=False, subscription=sub, price=metered, quantity=1
            )
            subs.append(sub)
            values = [10 + i, 20, 7 * i]
            events = [
                {
                    "event_name": "api_calls",
                    "identifier": f"{sub.id}-{n}",
                    "payload": {"stripe_customer_id": customer.id, "value": str(value)},
                    "timestamp": int((anchor + timedelta(days=3 + 9 * n)).timestamp()),
                }
                for n, value in enumerate(values)
            ]
            results = usage.record_meter_events(tenant_id=tenant.id, livemode=False, events=events)
            assert [r.status for r in results] == ["accepted"] * 3
            units[sub.id] = sum(values)
    return SeededBook(tenant, subs, {s.id: "paying" for s in subs}), metered, units


@pytest.mark.parametrize("page_close", ["1", "0"], ids=["page", "per_close"])
def test_a_scheduler_killed_between_the_usage_aggregation_and_the_invoice_commit_bills_the_usage_once(
    transactional_db, stripe_proxy, gateway, make_card, replicas, tmp_path, settings, page_close
):
    fault_file = str(tmp_path / "fault.json")
    seeded, metered, units = _seed(Book(make_card), settings)
    target = seeded.subscriptions[1]
    arm(fault_file, "after_usage", target.id)
    pool = replicas(
        billing_env(
            stripe_proxy,
            HARDCOUNT_SERVICES="tests.system.faults.FaultPoints",
            HARDCOUNT_FAULT_FILE=fault_file,
            HARDCOUNT_BILLING_PAGE_CLOSE=page_close,
        )
    )
    leader = pool.start().result(timeout=60)
    standby = pool.start()
    assert leader.process.wait(timeout=90) == -signal.SIGKILL, f"the replica did not die:\n{leader.log()}"
    assert leader.find("fault_point_reached", point="after_usage", subscription=target.id), leader.log()
    pool.kill(leader)
    arm(fault_file, None)

    # The kill left the first period billed and nothing of the second: its usage statement ran, nothing committed.
    target.refresh_from_db()
    second = period_bounds(target.billing_cycle_anchor, "month", 1, 1)[0]
    assert target.periods_billed == 1
    assert not Invoice.objects.filter(subscription=target, period_start=second).exists()
    assert MeterEvent.objects.filter(customer_id=target.customer_id).count() == 3

    pool.hand_over("billing", leader.holder)
    successor = standby.result(timeout=60)
    successor.wait_for("lease_acquired", role="billing", timeout_s=30)
    wait_until(
        lambda: Subscription.objects.filter(tenant_id=seeded.tenant.id, periods_billed=2).count() == BOOK_SIZE,
        timeout_s=90,
        what="every subscription's second period billed",
    )
    successor.wait_for("tick_completed", role="billing", timeout_s=60)

    for sub in seeded.subscriptions:
        usage_lines = list(InvoiceLineItem.objects.filter(invoice__subscription=sub, price=metered))
        # Once, on the invoice of the second period, over the first: the events' sum, never twice.
        assert [(line.quantity, line.amount) for line in usage_lines] == [(units[sub.id], UNIT * units[sub.id])]
        invoice = Invoice.objects.get(pk=usage_lines[0].invoice_id)
        assert (invoice.status, invoice.total) == ("paid", 1000 + UNIT * units[sub.id])
        assert (
            usage_lines[0].period_end
            == invoice.period_start
            == period_bounds(sub.billing_cycle_anchor, "month", 1, 1)[0]
        )
    audit = audit_book(seeded, stripe_proxy, expect_final_states=False)
    assert audit.invoices == 2 * BOOK_SIZE
    assert_clean(audit, f"usage kill ({'page' if page_close == '1' else 'per-close'} path)", stripe_proxy)
    assert_gateway_agrees()


def test_two_processes_ingesting_the_same_batch_at_once_store_each_event_once(transactional_db, tmp_path):
    """Two real processes send one batch of 1,000 identified events at the same moment: between them every event is
    accepted once and a duplicate once, the table holds each once, and its usage is each value once."""
    _race_one_batch(tmp_path, {"DATABASE_URL": database_url()})


def test_the_same_race_through_pgbouncer_in_transaction_pooling_stores_each_event_once(
    transactional_db, tmp_path, bouncer
):
    """The insert's bound batch between its savepoint and release (decision 0229), and the loser's fallback to that
    savepoint, hold through a transaction-pooling PgBouncer too."""
    _race_one_batch(tmp_path, {"DATABASE_URL": bouncer.url, "HARDCOUNT_DB_TRANSACTION_POOLING": "1"})


def _race_one_batch(tmp_path, database_env: dict[str, str]) -> None:
    from hardcount.times import database_now

    book = Book(make_card=None)
    tenant = book.tenant("Usage race")
    customers = [book.customer(tenant, card=None) for _ in range(5)]
    meter = usage.create_meter(
        tenant_id=tenant.id, livemode=False, display_name="API", event_name="api_calls", formula="sum"
    )
    batch = [
        {
            "event_name": "api_calls",
            "identifier": f"race-{n}",
            "payload": {"stripe_customer_id": customers[n % 5].id, "value": str(1 + n % 3)},
        }
        for n in range(1000)
    ]
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    env = {**os.environ, **database_env, "HARDCOUNT_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "tests.system.ingest_once", "--tenant", tenant.id, "--batch", str(path)]
    processes = [
        subprocess.Popen(command, cwd=BASE_DIR, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for process in processes:
            assert process.stdout.readline().strip() == "ready"
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        counts = []
        for process in processes:
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0
            counts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert sum(c.get("accepted", 0) for c in counts) == 1000, counts
    assert sum(c.get("duplicate", 0) for c in counts) == 1000, counts
    assert MeterEvent.objects.filter(tenant=tenant).count() == 1000
    now = database_now()
    quantities = aggregate_usage(
        [(c.id, c.id, meter.id, now - timedelta(days=1), now + timedelta(days=1)) for c in customers]
    )
    expected = {c.id: sum(1 + n % 3 for n in range(1000) if n % 5 == i) for i, c in enumerate(customers)}
    assert quantities == expected
