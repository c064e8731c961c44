"""Billing shards in real ``runscheduler`` replicas: two processes bill one book in parallel, once; a dead shard
leader's shard is taken over; a stopped shard leader writes nothing once its shard's lease is gone.

``HARDCOUNT_BILLING_SHARDS=2``: the book's tenants are split between ``billing:0`` and ``billing:1``
(billing/shards.py). The replicas charge through the fault-injecting proxy in front of localstripe, slowed
per PaymentIntent so the drains overlap and can be stopped mid-way.
"""

import signal
import time
from collections import Counter

import pytest
from django.conf import settings

from billing.models import BillingAttempt, BillingRun, Invoice, PaymentAttempt, Subscription
from billing.shards import shard_of
from ops.doctor import run_checks
from tests.billing.conftest import STRIPE_KEY, Book
from tests.leases.helpers import wait_until
from tests.system.harness import SchedulerProcess, lease
from tests.system.test_billing_processes import table_snapshot

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

TTL_S = settings.HARDCOUNT_LEASE_TTL_S
# Longer than one replica's start-up: the first replica leaves the second shard to the second one.
SPREAD_S = 15
SHARDS = ("billing:0", "billing:1")


@pytest.fixture
def shard_replicas(transactional_db, stripe_proxy, settings):
    settings.HARDCOUNT_BILLING_SHARDS = 2  # the doctor's sweep reads shards as the replicas do
    started: list[SchedulerProcess] = []

    def start(count: int, **env: str) -> list[SchedulerProcess]:
        env = {
            "HARDCOUNT_ROLES": "billing.loops.BillingRole",
            "HARDCOUNT_BILLING_SHARDS": "2",
            "HARDCOUNT_LEASE_SPREAD_S": str(SPREAD_S),
            "HARDCOUNT_BILLING_INTERVAL_S": "3600",
            "HARDCOUNT_BILLING_PAGE_SIZE": "5",
            "HARDCOUNT_BILLING_CONCURRENCY": "2",
            "STRIPE_API_BASE": stripe_proxy.api_base,
            "STRIPE_API_KEY": STRIPE_KEY,
            # Short, so a charge left in flight by a dead leader is re-sent (same key) by its successor.
            "HARDCOUNT_GATEWAY_TIMEOUT_S": "1",
            **env,
        }
        base = len(started)
        for i in range(count):
            started.append(SchedulerProcess(f"shard-replica-{base + i}", env))
        return started[-count:]

    yield start
    for process in started:
        process.stop()


def sharded_book(make_card, per_shard: int) -> dict[int, list[Subscription]]:
    """Tenants of both shards with ``per_shard`` due subscriptions in each shard, by shard."""
    book = Book(make_card)
    subscriptions: dict[int, list[Subscription]] = {0: [], 1: []}
    tenants = 0
    while min(len(s) for s in subscriptions.values()) < per_shard:
        tenant = book.tenant(f"Tenant {tenants}")
        tenants += 1
        shard = shard_of(tenant.id, 2)
        if len(subscriptions[shard]) >= per_shard:
            continue
        price = book.price(tenant, amount=1500)
        for _ in range(min(5, per_shard - len(subscriptions[shard]))):
            subscriptions[shard].append(book.subscription(book.customer(tenant), price))
    return subscriptions


def holders() -> dict[str, str | None]:
    return {role: (row or {}).get("holder") if (row := lease(role)) and row["live"] else None for role in SHARDS}


def paid_in(subscriptions: list[Subscription]) -> int:
    return Invoice.objects.filter(subscription__in=subscriptions, status="paid").count()


def assert_billed_once(subscriptions: list[Subscription], stripe_proxy) -> None:
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


def assert_runs_stay_in_their_shards() -> None:
    for run in BillingRun.objects.filter(trigger="scheduler"):
        index = int(run.lease_role.partition(":")[2])
        tenants = set(BillingAttempt.objects.filter(run=run).values_list("subscription__tenant_id", flat=True))
        assert {shard_of(t, 2) for t in tenants} <= {index}, (run.id, run.lease_role)


def doctor_failures() -> dict[str, list[str]]:
    return {r.name: r.examples for r in run_checks() if r.status not in ("ok", "not checked")}


def test_two_replicas_each_lead_one_shard_bill_the_book_once_and_a_dead_ones_shard_is_taken_over(
    shard_replicas, stripe_proxy, make_card
):
    book = sharded_book(make_card, per_shard=60)
    everything = book[0] + book[1]
    # Slow enough (under the 1 s gateway timeout) that shard 0's drain, three pages of 5 in flight, outlasts the
    # gap between the two leaders' starts.
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.7)
    first, second = shard_replicas(2)

    assert wait_until(lambda: all(holders().values()), timeout_s=30), holders()
    led = holders()
    assert set(led.values()) == {first.holder, second.holder}, led  # one shard each
    by_holder = {first.holder: first, second.holder: second}
    assert wait_until(lambda: paid_in(book[1]) >= 5, timeout_s=30)

    victim = by_holder[led["billing:1"]]
    survivor = by_holder[led["billing:0"]]
    victim.process.kill()
    killed = time.monotonic()
    victim.process.wait(10)
    paid_at_kill = paid_in(book[1])
    assert paid_at_kill < len(book[1]), "shard 1 finished before the kill: make it slower"

    # The survivor takes billing:1 once the lease has expired (then after its spread: it leads one shard already).
    taken = survivor.wait_for("lease_acquired", role="billing:1", timeout_s=TTL_S + SPREAD_S + 30)
    assert taken["_t"] - killed > TTL_S * 0.7
    survivor.wait_for("tick_completed", role="billing:1", timeout_s=60)
    survivor.wait_for("tick_completed", role="billing:0", timeout_s=60)

    assert_billed_once(everything, stripe_proxy)
    assert_runs_stay_in_their_shards()
    runs = BillingRun.objects.filter(trigger="scheduler", livemode=False)
    assert {r.lease_role for r in runs} == set(SHARDS)
    # The dead leader's run of shard 1 was superseded by its successor's; shard 0's run was never touched.
    assert sorted(r.status for r in runs.filter(lease_role="billing:1")) == ["abandoned", "completed"]
    (shard_0_run,) = runs.filter(lease_role="billing:0")
    assert shard_0_run.status == "completed"
    # In parallel: shard 1's first leader was billing before shard 0's drain had finished.
    first_shard_1_run = runs.get(lease_role="billing:1", status="abandoned")
    assert first_shard_1_run.started_at < shard_0_run.finished_at
    assert first_shard_1_run.billed > 0
    assert doctor_failures() == {}
    print(
        f"\n2 shards × {len(book[0])} subscriptions over 2 replicas; shard 1's leader SIGKILLed after "
        f"{paid_at_kill}; taken over {taken['_t'] - killed:.1f} s later; every period billed once; doctor clean"
    )


def test_a_stopped_shard_leader_writes_nothing_after_its_shard_is_taken_over(shard_replicas, stripe_proxy, make_card):
    book = sharded_book(make_card, per_shard=40)
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.4)
    first, second = shard_replicas(2)
    assert wait_until(lambda: all(holders().values()), timeout_s=30), holders()
    by_holder = {first.holder: first, second.holder: second}
    stale = by_holder[holders()["billing:0"]]
    successor = by_holder[holders()["billing:1"]]
    assert wait_until(lambda: paid_in(book[0]) >= 5, timeout_s=30)

    stale.send(signal.SIGSTOP)
    assert paid_in(book[0]) < len(book[0]), "shard 0 finished before the stop: make it slower"
    successor.wait_for("lease_acquired", role="billing:0", timeout_s=TTL_S + SPREAD_S + 30)
    successor.wait_for("tick_completed", role="billing:0", timeout_s=60)
    successor.wait_for("tick_completed", role="billing:1", timeout_s=60)
    before_resume = table_snapshot()

    stale.send(signal.SIGCONT)
    stale.wait_for("lease_released", role="billing:0", timeout_s=15)
    assert stale.find("lease_lost", role="billing:0")
    assert lease("billing:0")["holder"] == successor.holder
    time.sleep(1)
    assert table_snapshot() == before_resume  # the resumed leader of shard 0 wrote nothing
    assert_billed_once(book[0] + book[1], stripe_proxy)
    assert doctor_failures() == {}
