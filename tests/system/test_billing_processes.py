"""The billing role in real ``runscheduler`` replicas: a deposed leader writes nothing; a long drain keeps its lease.

The replicas charge through the fault-injecting proxy in front of localstripe
(``devstack/strict_stripe.py``), which also keeps Stripe's idempotency; a per-request delay on
PaymentIntent creation makes the drain slow enough to stop or sample it mid-way.
"""

import signal
import time
from collections import Counter

import pytest
from django.conf import settings
from django.db import connection

from billing.models import BillingRun, Invoice, PaymentAttempt, Subscription
from tests.billing.conftest import STRIPE_KEY, Book
from tests.leases.helpers import wait_until
from tests.system.harness import SchedulerProcess, lease

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

TTL_S = settings.HARDCOUNT_LEASE_TTL_S
# Every table the billing role writes (not the lease row, which the successor's heartbeats keep changing).
BILLING_TABLES = (
    "billing_billingrun",
    "billing_billingattempt",
    "billing_invoice",
    "billing_invoicelineitem",
    "billing_invoicecounter",
    "billing_paymentattempt",
    "billing_subscription",
    "billing_customer",
    "billing_ledgerentry",
    "outbox_event",
    "outbox_delivery",
    "dunning_dunningrun",
)


@pytest.fixture
def billing_replicas(transactional_db, stripe_proxy):
    started: list[SchedulerProcess] = []

    def start(count: int, **env: str) -> list[SchedulerProcess]:
        env = {
            "HARDCOUNT_ROLES": "billing.loops.BillingRole",
            "STRIPE_API_BASE": stripe_proxy.api_base,
            "STRIPE_API_KEY": STRIPE_KEY,
            # Short, so a charge left in flight by a stopped leader is re-sent (same key) by its successor.
            "HARDCOUNT_GATEWAY_TIMEOUT_S": "1",
            **env,
        }
        base = len(started)
        for i in range(count):
            started.append(SchedulerProcess(f"billing-replica-{base + i}", env))
        return started[-count:]

    yield start
    for process in started:
        process.stop()


def make_subscriptions(make_card, count: int) -> list[Subscription]:
    book = Book(make_card)
    tenant = book.tenant()
    price = book.price(tenant, amount=1500)
    return [book.subscription(book.customer(tenant), price) for _ in range(count)]


def table_snapshot() -> dict[str, list]:
    """Every row of every billing-role table, as text: equal snapshots mean nothing was written."""
    snapshot = {}
    with connection.cursor() as cursor:
        for table in BILLING_TABLES:
            cursor.execute(f"SELECT t::text FROM {table} t ORDER BY t::text")
            snapshot[table] = [row[0] for row in cursor.fetchall()]
    return snapshot


def leader_of(processes: list[SchedulerProcess]) -> SchedulerProcess:
    assert wait_until(lambda: (row := lease("billing")) is not None and row["live"], timeout_s=15)
    (leader,) = [p for p in processes if p.holder == lease("billing")["holder"]]
    return leader


def test_a_leader_stopped_mid_drain_writes_nothing_after_resuming_while_the_successor_bills_every_subscription_once(
    billing_replicas, stripe_proxy, make_card
):
    subscriptions = make_subscriptions(make_card, 60)
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.1)
    processes = billing_replicas(
        2,
        HARDCOUNT_BILLING_INTERVAL_S="3600",
        HARDCOUNT_BILLING_PAGE_SIZE="5",
        HARDCOUNT_BILLING_CONCURRENCY="2",
        # Two charges and one page in flight keep the drain going for seconds after the tenth payment (with the
        # default 128 charges in flight the whole book was sometimes paid before the stop).
        HARDCOUNT_BILLING_CHARGES_IN_FLIGHT="2",
        HARDCOUNT_BILLING_PAGES_IN_FLIGHT="1",
    )
    leader = leader_of(processes)
    (follower,) = [p for p in processes if p is not leader]
    assert wait_until(lambda: Invoice.objects.filter(status="paid").count() >= 10, timeout_s=30)

    leader.send(signal.SIGSTOP)
    stopped = time.monotonic()
    paid_at_stop = Invoice.objects.filter(status="paid").count()
    assert paid_at_stop < len(subscriptions), "the drain finished before the stop: make it slower"

    # The successor takes over after the TTL and drains the rest.
    follower.wait_for("tick_completed", role="billing", timeout_s=TTL_S + 40)
    assert time.monotonic() - stopped > TTL_S * 0.7
    before_resume = table_snapshot()

    leader.send(signal.SIGCONT)
    leader.wait_for("lease_released", role="billing", timeout_s=15)
    assert leader.find("lease_lost", role="billing")
    assert lease("billing")["holder"] == follower.holder
    assert table_snapshot() == before_resume  # the resumed leader wrote nothing

    per_period = Counter(Invoice.objects.values_list("subscription_id", "period_start"))
    assert set(per_period) == {(s.id, s.next_billing_at) for s in subscriptions}
    assert set(per_period.values()) == {1}
    assert Invoice.objects.filter(status="paid").count() == len(subscriptions)
    assert PaymentAttempt.objects.filter(outcome="succeeded").count() == len(subscriptions)
    created = [
        e
        for e in stripe_proxy.entries("POST /v1/payment_intents", "forwarded")
        if e.request.path == "/v1/payment_intents"
    ]
    assert len(created) == len(subscriptions)  # one PaymentIntent per invoice reached the gateway

    runs = {r.lease_token: r for r in BillingRun.objects.filter(trigger="scheduler", livemode=False)}
    old_token = int(leader.find("lease_acquired", role="billing")[0]["token"])
    assert runs[old_token].status == BillingRun.ABANDONED
    assert runs[old_token + 1].status == BillingRun.COMPLETED
    print(
        f"\nleader SIGSTOPped for {time.monotonic() - stopped:.1f} s after {paid_at_stop} of {len(subscriptions)} "
        f"invoices; successor billed the rest; resumed leader wrote nothing"
    )


def test_a_billing_drain_longer_than_twice_the_interval_keeps_the_lease_and_stamps_every_page(
    billing_replicas, stripe_proxy, make_card, client, settings
):
    settings.HARDCOUNT_ROLES = ["billing.loops.BillingRole"]
    settings.HARDCOUNT_BILLING_INTERVAL_S = 1
    make_subscriptions(make_card, 30)
    # Pages of 2 at 0.35 s a charge: about 0.7 s a page, 30 subscriptions in over 10 s.
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.35)
    processes = billing_replicas(
        2,
        HARDCOUNT_BILLING_INTERVAL_S="1",
        HARDCOUNT_BILLING_PAGE_SIZE="2",
        HARDCOUNT_BILLING_CONCURRENCY="1",
    )
    leader = leader_of(processes)
    (follower,) = [p for p in processes if p is not leader]
    first = lease("billing")
    assert wait_until(lambda: lease("billing")["last_stamp_at"] is not None, timeout_s=10)  # the first page

    samples, max_age = 0, 0.0
    while Invoice.objects.filter(status="paid").count() < 30:
        row = lease("billing")
        assert (row["holder"], row["token"], row["live"]) == (leader.holder, first["token"], True)
        if row["stamp_age_s"] is not None:
            max_age = max(max_age, row["stamp_age_s"])
        assert client.get("/health/ready").json()["roles"]["billing"]["stale"] is False
        samples += 1
        time.sleep(0.25)
        assert samples < 400, "the drain never finished"

    completed = leader.wait_for("tick_completed", role="billing", timeout_s=30)
    assert float(completed["duration_s"]) > 2 * 1.0
    assert completed["test_billed"] == "30"
    assert max_age < 2 * 1.0
    assert not follower.find("lease_acquired")
    run = BillingRun.objects.get(trigger="scheduler", livemode=False, lease_token=first["token"], attempted=30)
    assert run.pages >= 15
    print(
        f"\n{float(completed['duration_s']):.1f} s billing tick at a 1 s interval, {run.pages} pages: lease kept, "
        f"stamp never older than {max_age:.2f} s over {samples} samples"
    )


def test_a_leader_sigtermed_mid_drain_ends_its_run_abandoned_before_releasing_the_lease(
    billing_replicas, stripe_proxy, make_card
):
    from ops.doctor import run_checks

    subscriptions = make_subscriptions(make_card, 40)
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.1)
    (leader,) = billing_replicas(
        1,
        HARDCOUNT_BILLING_INTERVAL_S="3600",
        HARDCOUNT_BILLING_PAGE_SIZE="5",
        HARDCOUNT_BILLING_CONCURRENCY="2",
        HARDCOUNT_BILLING_CHARGES_IN_FLIGHT="2",  # as above: still draining at the signal
        HARDCOUNT_BILLING_PAGES_IN_FLIGHT="1",
    )
    assert wait_until(lambda: Invoice.objects.filter(status="paid").count() >= 5, timeout_s=30)

    leader.send(signal.SIGTERM)
    leader.wait_for("lease_released", role="billing", timeout_s=15)
    # It exits on its own after the one SIGTERM (stop() would send a second one into its shutdown).
    assert leader.process.wait(15) == 0

    paid = Invoice.objects.filter(status="paid").count()
    assert paid < len(subscriptions), "the drain finished before the stop: make it slower"
    (run,) = BillingRun.objects.filter(trigger="scheduler", livemode=False)
    assert (run.status, run.finished_at is not None) == (BillingRun.ABANDONED, True)
    assert run.error.startswith("stopped at a safe point")
    assert run.billed == paid  # its counts are the run's own at the stop
    assert lease("billing")["holder"] is None
    failing = {r.name: r.examples for r in run_checks() if r.status not in ("ok", "not checked")}
    assert "billing_run_not_orphaned_by_lease" not in failing, failing
