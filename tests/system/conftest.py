"""System-test fixtures: localstripe behind the fault-injecting proxy, and the book builder, from the billing tests;
the armed gateway and the replica pools of the failure-correctness experiments (tests/system/correctness.py)."""

import pytest

from tests.billing.conftest import (  # noqa: F401 - fixtures
    Book,
    localstripe_base,
    make_card,
    proxy_session,
    stripe_client,
    stripe_proxy,
)
from tests.system.correctness import GATEWAY_DELAY_S, Replicas


@pytest.fixture
def gateway(stripe_proxy):  # noqa: F811 - the fixture imported above, as pytest passes it
    """The proxy with the failure-correctness faults armed: 500 for gateway-failing cards, a small delay
    (``GATEWAY_DELAY_S``) on every PaymentIntent call.

    Returns the set of failing payment methods (seeding adds to it).
    """
    failing: set[str] = set()
    stripe_proxy.fail_next(
        "500",
        times=10**9,
        match=lambda r: r.line.startswith("POST /v1/payment_intents") and r.params.get("payment_method") in failing,
    )
    stripe_proxy.fail_next("delay", times=10**9, match="POST /v1/payment_intents", delay_s=GATEWAY_DELAY_S)
    return failing


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
