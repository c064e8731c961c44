"""System-test fixtures: localstripe behind the fault-injecting proxy, and the book builder, from the billing tests;
the armed gateway and the replica pools of the failure-correctness experiments (tests/system/correctness.py);
PgBouncer in transaction mode, replica pools through it, and the sampler of both its sides (tests/system/pgbouncer.py).
"""

import pytest

from tests.billing.conftest import (  # noqa: F401 - fixtures
    Book,
    localstripe_base,
    make_card,
    proxy_session,
    stripe_client,
    stripe_proxy,
)
from tests.system.correctness import GATEWAY_DELAY_S, Replicas, arm_gateway
from tests.system.pgbouncer import PgBouncer, PooledReplicas, SessionSampler, mark_direct_sessions


@pytest.fixture
def gateway(stripe_proxy):  # noqa: F811 - the fixture imported above, as pytest passes it
    """The proxy with the failure-correctness faults armed: 500 for gateway-failing cards, a small delay
    (``GATEWAY_DELAY_S``) on every PaymentIntent call.

    Returns the set of failing payment methods (seeding adds to it).
    """
    return arm_gateway(stripe_proxy, GATEWAY_DELAY_S)


@pytest.fixture
def replicas():
    """A factory of :class:`Replicas` pools (``replicas(env)``); every pool made is stopped at the end.

    tests/system/test_scheduler_processes.py has a ``replicas`` fixture of its own (scratch-role
    processes), which takes precedence there.
    """
    made: list[Replicas] = []

    def make(env: dict[str, str]) -> Replicas:
        made.append(Replicas(env))
        return made[-1]

    yield make
    for pool in made:
        pool.stop_all()


@pytest.fixture
def bouncer():
    """A :class:`PgBouncer` (transaction mode, pool :data:`~tests.system.pgbouncer.POOL`); this process's own
    sessions are marked direct meanwhile."""
    restore = mark_direct_sessions()
    started = PgBouncer()
    yield started
    started.stop()
    restore()


@pytest.fixture
def pooled(bouncer):
    """``pooled(env, web=False)``: a :class:`PooledReplicas` pool through ``bouncer``; every pool made is stopped
    at the end."""
    made: list[PooledReplicas] = []

    def make(env: dict[str, str], *, web: bool = False) -> PooledReplicas:
        made.append(PooledReplicas(env, bouncer, web=web))
        return made[-1]

    yield make
    for pool in made:
        pool.stop_all()


@pytest.fixture
def sampler(bouncer):
    """A :class:`SessionSampler` of ``bouncer`` running for the whole test."""
    watching = SessionSampler(bouncer)
    yield watching
    watching.stop()
