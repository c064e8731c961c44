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

import pytest

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
from tests.system.pgbouncer import assert_within_pool
from tests.system.test_failure_correctness import SWEEP_SIZE, executors_killed_mid_delivery, kill_sweep

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPLICAS = 10


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
    assert_within_pool(sampler, more_clients=True)


def test_webhook_executors_killed_mid_delivery_through_the_pooler(
    transactional_db, stripe_proxy, gateway, make_card, pooled, sampler
):
    executors_killed_mid_delivery(
        stripe_proxy, gateway, make_card, pooled, label="webhook executors SIGKILLed mid-delivery, through PgBouncer"
    )
    assert_within_pool(sampler)


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
    assert_within_pool(sampler)
