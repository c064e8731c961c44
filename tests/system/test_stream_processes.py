"""The webhook-executor-kill experiment, dispatched through a stream (docs/decisions/0200).

The experiment of tests/system/test_failure_correctness.py (section 5: ``runscheduler`` replicas running the
delivery executor, SIGKILLed mid-delivery five times while receivers hang, fail, dawdle and drop the
connection; a billing drain writing the events meanwhile) with ``HARDCOUNT_DELIVERY_DISPATCH=nats``: the
drain and the topping-up writers in this process publish each delivery's id after commit to a NATS server
of the test's own (tests/outbox/natsserver.py), the replicas pull ids from the shared durable consumer.
The stream engine itself is SIGKILLed and restarted mid-run too (after the second executor kill), so ids
published while it was down are lost and messages handed to a killed executor come back. The same
checks must hold: every event reaches every subscribed endpoint, each delivery recorded succeeded once,
at most 8 attempts, the doctor finds nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from outbox import stream as stream_module
from outbox.stream import NatsDeliveryStream, Publisher
from tests.outbox.natsserver import nats_server  # noqa: F401  (fixture)
from tests.system.correctness import Replicas
from tests.system.test_failure_correctness import executors_killed_mid_delivery

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


@pytest.fixture
def streamed(settings, nats_server):  # noqa: F811
    """``streamed(env)``: replicas dispatching through the test's NATS server; this process publishes to it."""
    settings.HARDCOUNT_DELIVERY_DISPATCH = "nats"
    settings.HARDCOUNT_NATS_URL = nats_server.url
    fresh = Publisher()
    stream_module._publishers[:] = [fresh]
    made: list[Replicas] = []

    def make(env: dict[str, str]) -> Replicas:
        made.append(
            Replicas(
                {
                    **env,
                    "HARDCOUNT_DELIVERY_DISPATCH": "nats",
                    "HARDCOUNT_NATS_URL": nats_server.url,
                    "HARDCOUNT_DELIVERY_SWEEP_S": "0.2",
                    "HARDCOUNT_DELIVERY_SWEEP_AGE_S": "0.5",
                }
            )
        )
        return made[-1]

    yield make
    for pool in made:
        pool.stop_all()
    fresh.stop()
    stream_module._publishers[:] = []


def handed_out(url: str) -> int:
    """How far the executors' durable consumer has handed out the stream (its last stream sequence)."""

    async def read():
        stream = NatsDeliveryStream(url)
        try:
            js = await stream._connection(consume=True)
            return (await js.consumer_info(stream.stream, stream.consumer)).delivered.stream_seq
        finally:
            await stream.close()

    return asyncio.run(read())


def test_executors_and_the_stream_killed_mid_delivery_deliver_every_event_once_recorded(
    transactional_db,
    stripe_proxy,
    gateway,
    make_card,
    nats_server,  # noqa: F811
    streamed,
):
    def crash_the_stream(kills: int) -> None:
        if kills == 2:
            nats_server.restart(down_s=1.0)

    executors_killed_mid_delivery(
        stripe_proxy,
        gateway,
        make_card,
        streamed,
        label="webhook executors and the NATS stream SIGKILLed mid-delivery (dispatch through a stream)",
        after_kill=crash_the_stream,
    )
    assert nats_server.restarts == 1
    published = stream_module.publisher().published
    assert published > 20, f"only {published} ids published: the drain's writes did not go through the stream"
    assert handed_out(nats_server.url) > 0, "the executors took nothing from the stream"
