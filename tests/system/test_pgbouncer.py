"""Hardcount through PgBouncer in transaction pooling mode (docs/decisions/0184-pgbouncer-transaction-pooling.md).

Every replica here is a real ``runscheduler`` whose ``DATABASE_URL`` is a ``pgbouncer`` started by
the test (its own ini: ``pool_mode = transaction``, at most :data:`POOL` server connections), with
``HARDCOUNT_DB_TRANSACTION_POOLING=1``. Three experiments run through it, each reusing the
failure-correctness helpers (tests/system/correctness.py, test_failure_correctness.py):

1. ten full replicas (every default role, the webhook executor) bill a book; the billing
   leader is SIGKILLed mid-drain and another replica takes over; the audit and the doctor find
   nothing wrong;
2. the webhook-executor-kill experiment;
3. the billing kill sweep at a few kill points.

Throughout each, a sampler counts PostgreSQL's own sessions of the test database
(``pg_stat_activity``, this test process's direct ones left out): never more than the pool, while
the replicas hold many more client connections to the pooler than that.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from tests.billing.conftest import Book
from tests.system.correctness import (
    age_unknown_attempts,
    assert_clean,
    audit_book,
    billing_env,
    closes_recorded,
    invoices_of,
    seed_book,
    wait_until,
)
from tests.system.harness import lease
from tests.system.pgbouncer import PgBouncer, PooledReplicas, mark_direct_sessions, server_sessions
from tests.system.test_failure_correctness import SWEEP_SIZE, executors_killed_mid_delivery, kill_sweep

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

POOL = 6
REPLICAS = 10


class SessionSampler:
    """On a thread: PostgreSQL's sessions of the test database every 10 ms, the pooler's client
    connections every 200 ms; the peak of each."""

    def __init__(self, bouncer: PgBouncer):
        self.bouncer = bouncer
        self.peak = self.peak_clients = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, server_sessions())
                if self.samples % 20 == 0:
                    self.peak_clients = max(self.peak_clients, self.bouncer.clients())
                self.samples += 1
        finally:
            connections.close_all()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def bouncer():
    restore = mark_direct_sessions()
    started = PgBouncer(pool=POOL)
    yield started
    started.stop()
    restore()


@pytest.fixture
def pooled(bouncer):
    """``pooled(env)``: a :class:`PooledReplicas` pool through ``bouncer``; every pool made is stopped at the end."""
    made: list[PooledReplicas] = []

    def make(env: dict[str, str]) -> PooledReplicas:
        made.append(PooledReplicas(env, bouncer))
        return made[-1]

    yield make
    for pool in made:
        pool.stop_all()


@pytest.fixture
def sampler(bouncer):
    watching = SessionSampler(bouncer)
    yield watching
    watching.stop()


def _assert_within_pool(sampler: SessionSampler, *, more_clients: bool = False) -> None:
    """PostgreSQL never saw more than the pool; with ``more_clients``, the replicas also held more client
    connections than that (so the pool was needed, not merely big enough)."""
    sampler.stop()
    assert sampler.samples > 10, "the sampler did not run"
    peak, clients = sampler.peak, sampler.peak_clients
    assert 1 <= peak <= POOL, f"PostgreSQL saw {peak} sessions through a pool of {POOL}:\n{sampler.bouncer.tail()}"
    if more_clients:
        assert clients > POOL, f"at most {clients} client connections: nothing to pool"
    print(f"through PgBouncer: up to {clients} client connections, at most {peak} server sessions (pool {POOL})")


def test_ten_replicas_through_the_pooler_fail_over_mid_drain_and_the_server_sees_at_most_the_pool(
    transactional_db, stripe_proxy, gateway, make_card, pooled, bouncer, sampler
):
    # Full replicas: every default role (HARDCOUNT_ROLES unset) and the webhook executor.
    pool = pooled(
        billing_env(stripe_proxy, HARDCOUNT_ROLES=None, HARDCOUNT_SERVICES="outbox.scheduling.ExecutorService")
    )
    replicas = [future.result(timeout=120) for future in [pool.start() for _ in range(REPLICAS)]]
    by_holder = {replica.holder: replica for replica in replicas}
    wait_until(lambda: (lease("billing") or {}).get("live"), timeout_s=30, what="a billing leader")

    seeded = seed_book(Book(make_card), gateway, SWEEP_SIZE, name="Pooled")
    tenant_id = seeded.tenant.id
    wait_until(lambda: invoices_of(tenant_id) >= 9, timeout_s=60, what="the drain under way")
    leader = by_holder[lease("billing")["holder"]]
    pool.kill(leader)
    at_kill = (invoices_of(tenant_id), closes_recorded(tenant_id))
    assert at_kill[1] < SWEEP_SIZE, f"the drain had finished at the kill ({at_kill}); slow it down"

    age_unknown_attempts(tenant_id)
    pool.hand_over("billing", leader.holder)

    def taken_over() -> bool:
        held = lease("billing")
        return bool(held and held["live"] and held["holder"] != leader.holder)

    wait_until(taken_over, timeout_s=30, what="another replica to take the billing lease")
    successor = by_holder[lease("billing")["holder"]]
    successor.wait_for("lease_acquired", role="billing", timeout_s=30)
    successor.wait_for("tick_completed", role="billing", timeout_s=60)
    wait_until(lambda: closes_recorded(tenant_id) >= SWEEP_SIZE, timeout_s=60, what="every close recorded")
    assert_clean(audit_book(seeded, stripe_proxy), f"failover through PgBouncer (at the kill: {at_kill})", stripe_proxy)
    _assert_within_pool(sampler, more_clients=True)


def test_webhook_executors_killed_mid_delivery_through_the_pooler(
    transactional_db, stripe_proxy, gateway, make_card, pooled, sampler
):
    executors_killed_mid_delivery(
        stripe_proxy, gateway, make_card, pooled, label="webhook executors SIGKILLed mid-delivery, through PgBouncer"
    )
    _assert_within_pool(sampler)


def test_a_reduced_kill_sweep_through_the_pooler_bills_every_period_exactly_once(
    transactional_db, stripe_proxy, gateway, make_card, pooled, sampler
):
    kill_sweep(
        stripe_proxy,
        gateway,
        make_card,
        pooled,
        kill_points=(3, 10, 19, 28),
        label="runscheduler SIGKILLed mid-drain, through PgBouncer",
    )
    _assert_within_pool(sampler)
