"""Dispatch through a stream (HARDCOUNT_DELIVERY_DISPATCH=nats): writers publish ids after commit, executors
pull them from one durable consumer, PostgreSQL decides (docs/reference/webhooks.md#dispatch-through-a-stream,
docs/decisions/0200-dispatch-through-a-stream.md).

Each test runs its own ``nats-server -js`` (tests/outbox/natsserver.py) and real executors in this process
against the test database and a real receiver. The stream is made to lose ids (never published, purged),
to duplicate them (published again and again) and to crash mid-run; the lease and the sweep must still
give every delivery exactly one recorded terminal outcome, and the receiver each event.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from django.db import transaction

from outbox import executor as executor_module
from outbox import queries
from outbox import stream as stream_module
from outbox.metrics import STREAM_IDS
from outbox.models import Delivery, DeliveryAttempt
from outbox.services import emit_event
from outbox.stream import NatsDeliveryStream, Publisher

from .conftest import Answer, assert_outbox_invariants, emit, make_endpoint, wait_until
from .natsserver import nats_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db(transaction=True)

# Test-sized stream dispatch: no sweep unless a test asks for one.
STREAMED = {"dispatch": "nats", "sweep_interval_s": None, "stream_retry_s": 0.5}
SWEEPING = {"dispatch": "nats", "sweep_interval_s": 0.2, "sweep_age_s": 0.5, "stream_retry_s": 0.5}


@pytest.fixture
def nats_dispatch(settings, nats_server):  # noqa: F811
    """Writers in this process publish to the test's own NATS server; a fresh publisher, stopped at the end."""
    settings.HARDCOUNT_DELIVERY_DISPATCH = "nats"
    settings.HARDCOUNT_NATS_URL = nats_server.url
    fresh = Publisher()
    stream_module._publishers[:] = [fresh]
    yield nats_server
    fresh.stop()
    stream_module._publishers[:] = []


def _run(coro_fn, url: str):
    async def go():
        stream = NatsDeliveryStream(url)
        try:
            return await coro_fn(stream)
        finally:
            await stream.close()

    return asyncio.run(go())


def consumer_state(url: str) -> dict[str, int]:
    """The executors' durable consumer: messages waiting, handed out and not acked, handed out in all."""

    async def read(stream):
        js = await stream._connection(consume=True)
        info = await js.consumer_info(stream.stream, stream.consumer)
        return {
            "pending": info.num_pending,
            "unacked": info.num_ack_pending,
            "delivered": info.delivered.stream_seq,
        }

    return _run(read, url)


def publish_again(url: str, pairs: list[tuple[str, str]]) -> int:
    """Publish ``pairs`` by hand; a stream that stored none of them (a server just started, whose JetStream is
    not answering yet, on a loaded machine) is asked again for up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _run(lambda stream: stream.publish(pairs), url)
        except stream_module.StreamUnavailable as exc:
            if " of " in str(exc) and not str(exc).startswith(f"{len(pairs)} of {len(pairs)}"):
                raise  # some were stored: asking again would add copies the test did not mean
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def purge(url: str) -> None:
    """The stream loses everything it holds."""

    async def go(stream):
        js = await stream._connection(consume=False)
        await js.purge_stream(stream.stream)

    _run(go, url)


def emit_many(tenant, n: int, prefix: str = "in") -> list:
    with transaction.atomic():
        return [
            emit_event(tenant_id=tenant.id, livemode=False, type="invoice.paid", data={"id": f"{prefix}_{i}"})
            for i in range(n)
        ]


def assert_each_once(receiver, path: str, events) -> None:
    """Every delivery to ``path`` succeeded with one succeeded attempt; the receiver got every event."""
    deliveries = list(Delivery.objects.filter(event__in=events))
    assert len(deliveries) == len(events)
    assert {d.status for d in deliveries} == {"succeeded"}
    assert all(1 <= d.attempts <= 8 for d in deliveries)
    for d in deliveries:
        assert DeliveryAttempt.objects.filter(delivery=d, outcome="succeeded").count() == 1
    assert {r.json["id"] for r in receiver.received(path)} == {e.id for e in events}


def test_a_committed_delivery_is_published_and_delivered_through_the_stream(
    nats_dispatch, tenant_t, receiver, make_executor
):
    make_endpoint(tenant_t, receiver.url("/hook"))
    executor = make_executor(**STREAMED)
    published_before = STREAM_IDS.labels(result="published")._value.get()
    with pytest.raises(RuntimeError), transaction.atomic():
        emit_event(tenant_id=tenant_t.id, livemode=False, type="invoice.paid", data={"id": "in_rolled_back"})
        raise RuntimeError("rolled back: nothing is published")
    event = emit(tenant_t, "invoice.paid")
    receiver.wait_for(1, "/hook", timeout_s=10)
    delivery = wait_until(lambda: Delivery.objects.filter(event=event, status="succeeded").first(), what="recorded")
    assert stream_module.publisher().published == 1  # the committed one; the rolled-back one never
    assert STREAM_IDS.labels(result="published")._value.get() - published_before == 1
    # No sweep, no poll: the stream brought it, and the message was acked once the outcome was written.
    wait_until(lambda: executor.stats["stream_ack"] == 1, timeout_s=10, what="the ack")
    assert (executor.stats["stream_claimed"], executor.stats["swept"], executor.stats["polled"]) == (1, 0, 0)
    assert consumer_state(nats_dispatch.url) == {"pending": 0, "unacked": 0, "delivered": 1}
    assert [r.json["id"] for r in receiver.received("/hook")] == [event.id]
    assert delivery.attempts == 1
    assert_outbox_invariants()


def test_lost_ids_are_delivered_by_the_sweep_and_never_without_it(
    nats_dispatch, settings, tenant_t, receiver, make_executor
):
    make_endpoint(tenant_t, receiver.url("/hook"))
    # Lost two ways: never published (written while writers did not publish), and dropped by the stream.
    settings.HARDCOUNT_DELIVERY_DISPATCH = "poll"
    never_published = emit_many(tenant_t, 3, "never")
    settings.HARDCOUNT_DELIVERY_DISPATCH = "nats"
    dropped = emit_many(tenant_t, 3, "dropped")
    assert stream_module.publisher().flush(10) and stream_module.publisher().published == 3
    purge(nats_dispatch.url)
    lost = never_published + dropped

    # Negative control: without the sweep, an executor that only listens to the stream never sends them,
    # though it delivers what the stream does bring.
    deaf = make_executor(executor_id="no-sweep", **STREAMED)
    control = emit(tenant_t, "invoice.paid", data={"id": "in_control"})
    wait_until(lambda: Delivery.objects.filter(event=control, status="succeeded").exists(), what="the control")
    time.sleep(2.0)
    assert Delivery.objects.filter(event__in=lost, status="pending", attempts=0).count() == 6
    assert {r.json["id"] for r in receiver.received("/hook")} == {control.id}
    deaf.stop()

    sweeping = make_executor(executor_id="sweeper", **SWEEPING)
    wait_until(
        lambda: Delivery.objects.filter(event__in=lost, status="succeeded").count() == 6, what="the sweep's deliveries"
    )
    assert sweeping.stats["swept"] == 6 and sweeping.stats["stream_claimed"] == 0
    assert_each_once(receiver, "/hook", [*lost, control])
    assert_outbox_invariants()


def test_a_backlog_the_stream_holds_is_worked_through_the_stream_not_the_sweep(
    nats_dispatch, tenant_t, receiver, make_executor
):
    """Rows due for longer than the sweep age when the executor starts, their ids in the stream: the sweep
    takes the idle workers at its tick, the stream everything else (a sweep that never left a worker idle
    for a fetch would have drained the whole backlog with the claim query)."""
    make_endpoint(tenant_t, receiver.url("/hook"))
    events = emit_many(tenant_t, 40)
    assert stream_module.publisher().flush(10) and stream_module.publisher().published == 40
    time.sleep(1.0)  # every row is now due for longer than the sweep age
    executor = make_executor(**{**SWEEPING, "sweep_interval_s": 30.0})
    wait_until(lambda: Delivery.objects.filter(event__in=events, status="succeeded").count() == 40, what="delivered")
    assert executor.stats["swept"] <= executor.config.workers  # the sweep at start, once
    assert executor.stats["stream_claimed"] == 40 - executor.stats["swept"]
    assert_each_once(receiver, "/hook", events)


def test_ids_duplicated_by_the_stream_deliver_each_delivery_once(nats_dispatch, tenant_t, receiver, make_executor):
    make_endpoint(tenant_t, receiver.url("/hook"))
    # A slow receiver keeps rows held while their duplicates arrive at the other executor.
    receiver.behave("/hook", lambda r, n: Answer(delay_s=0.1))
    executors = [make_executor(executor_id=f"dup-{i}", **STREAMED) for i in range(2)]
    events = emit_many(tenant_t, 12)
    assert stream_module.publisher().flush(10)
    pairs = [(tenant_t.id, d) for d in Delivery.objects.filter(event__in=events).values_list("id", flat=True)]
    assert publish_again(nats_dispatch.url, pairs * 3) == 36  # every id four times in all
    wait_until(lambda: Delivery.objects.filter(event__in=events, status="succeeded").count() == 12, what="delivered")
    # Every duplicate is acked once its row is found finished (or is naked until the holder's lease ends).
    wait_until(
        lambda: consumer_state(nats_dispatch.url) == {"pending": 0, "unacked": 0, "delivered": 48},
        timeout_s=30,
        what="every copy acked",
    )
    assert sum(e.stats["stream_claimed"] for e in executors) == 12
    assert sum(e.stats["stream_messages"] for e in executors) >= 48
    assert len(receiver.received("/hook")) == 12  # the receiver saw each event once: no copy was sent
    assert_each_once(receiver, "/hook", events)
    assert all(d.attempts == 1 for d in Delivery.objects.filter(event__in=events))
    assert_outbox_invariants()


def test_a_retry_comes_back_through_the_stream_when_it_is_due(
    nats_dispatch, monkeypatch, tenant_t, receiver, make_executor
):
    monkeypatch.setattr(executor_module, "RETRY_SCHEDULE_S", (1.5,) * 7)
    receiver.behave("/hook", lambda r, n: Answer(500, b"later") if n == 1 else Answer())
    make_endpoint(tenant_t, receiver.url("/hook"))
    executor = make_executor(jitter=0.0, **STREAMED)
    event = emit(tenant_t, "invoice.paid")
    receiver.wait_for(1, "/hook", timeout_s=10)
    retrying = wait_until(lambda: Delivery.objects.filter(event=event, status="retrying").first(), what="retrying")
    wait_until(lambda: executor.stats["stream_nak"] == 1, timeout_s=5, what="the nak with the backoff")
    second = receiver.wait_for(2, "/hook", timeout_s=10)[1]
    # It came back no sooner than the row was due (the nak's delay is the backoff the row was given),
    # through the stream alone: this executor has no sweep.
    assert second.wall >= retrying.fire_after.timestamp() - 0.05
    wait_until(lambda: Delivery.objects.filter(event=event, status="succeeded").exists(), what="succeeded")
    assert executor.stats["stream_claimed"] == 2 and executor.stats["swept"] == 0
    wait_until(lambda: consumer_state(nats_dispatch.url)["unacked"] == 0, timeout_s=10, what="acked")
    assert [a.outcome for a in DeliveryAttempt.objects.filter(delivery__event=event).order_by("number")] == [
        "retryable",
        "succeeded",
    ]
    assert_outbox_invariants()


def test_the_stream_restarted_mid_run_loses_no_delivery_and_repeats_none(
    nats_dispatch, tenant_t, receiver, make_executor
):
    make_endpoint(tenant_t, receiver.url("/hook"))
    receiver.behave("/hook", lambda r, n: Answer(delay_s=0.05))
    executors = [make_executor(executor_id=f"restart-{i}", **SWEEPING) for i in range(2)]
    publisher = stream_module.publisher()
    dropped_before = STREAM_IDS.labels(result="dropped")._value.get()

    before = emit_many(tenant_t, 30, "before")
    receiver.wait_for(10, "/hook", timeout_s=20)
    nats_dispatch.kill()  # SIGKILL mid-run, deliveries in flight
    during = emit_many(tenant_t, 30, "during")  # committed while the stream is down: never confirmed
    assert publisher.flush(15)
    assert publisher.dropped == 30 and STREAM_IDS.labels(result="dropped")._value.get() - dropped_before == 30
    wait_until(lambda: sum(e.stats["stream_unavailable"] for e in executors) >= 2, what="both executors polling")
    nats_dispatch.start()  # the same port and store
    after = emit_many(tenant_t, 30, "after")
    events = before + during + after
    wait_until(
        lambda: Delivery.objects.filter(event__in=events, status="succeeded").count() == 90,
        timeout_s=60,
        what="all 90 delivered",
    )
    claims = {k: sum(e.stats[k] for e in executors) for k in ("stream_claimed", "swept", "polled")}
    assert sum(claims.values()) == 90, claims  # one claim per delivery: nothing was sent twice
    assert claims["swept"] + claims["polled"] >= 30, claims  # what the stream never had
    assert claims["stream_claimed"] >= 10, claims
    assert len(receiver.received("/hook")) == 90
    assert_each_once(receiver, "/hook", events)
    assert_outbox_invariants()


@pytest.mark.parametrize("lease", ["kept", "negative control: ignored"])
def test_a_copy_handed_out_while_the_row_is_held_is_not_sent_again(
    nats_dispatch, settings, monkeypatch, tenant_t, receiver, make_executor, lease
):
    """Each id published twice in a row: two executors of one worker each get the two copies at once.

    The claim's lease predicate refuses the second copy while the first is in flight (it is naked until
    the lease ends, then acked as finished). The negative control claims streamed ids without that
    predicate, as a consumer that trusts its message would: the receiver then gets events twice.
    """
    if lease != "kept":
        trusting = queries.CLAIM_IDS_RECORDING_LOST.replace(
            "AND (d.claim_expires_at IS NULL OR d.claim_expires_at < now())", ""
        )
        assert trusting != queries.CLAIM_IDS_RECORDING_LOST
        monkeypatch.setattr(queries, "CLAIM_IDS_RECORDING_LOST", trusting)
    # Long enough that the second copy reaches the other executor while the first is still in flight, even on a
    # loaded machine (at 0.5 s the negative control sometimes found the row already succeeded); the executors'
    # request timeout is raised to match.
    receiver.behave("/hook", lambda r, n: Answer(delay_s=1.5))
    make_endpoint(tenant_t, receiver.url("/hook"))
    settings.HARDCOUNT_DELIVERY_DISPATCH = "poll"  # published by hand below, in pairs
    events = emit_many(tenant_t, 4)
    ids = list(Delivery.objects.filter(event__in=events).order_by("id").values_list("id", flat=True))
    executors = [make_executor(executor_id=f"one-worker-{i}", workers=1, timeout_s=6.0, **STREAMED) for i in range(2)]
    assert publish_again(nats_dispatch.url, [(tenant_t.id, d) for d in ids for _ in range(2)]) == 8
    wait_until(
        lambda: Delivery.objects.filter(event__in=events, status="succeeded").count() == 4,
        timeout_s=40,
        what="delivered",
    )
    if lease != "kept":
        wait_until(lambda: len(receiver.received("/hook")) > 4, timeout_s=30, what="a copy sent again")
        return
    wait_until(lambda: consumer_state(nats_dispatch.url)["unacked"] == 0, timeout_s=40, what="every copy acked")
    assert sum(e.stats["stream_nak"] for e in executors) >= 1  # a copy did arrive while its row was held
    assert len(receiver.received("/hook")) == 4
    assert_each_once(receiver, "/hook", events)
    assert_outbox_invariants()


def test_an_unknown_dispatch_is_refused_at_start():
    """A typo in HARDCOUNT_DELIVERY_DISPATCH stops the settings from loading; an executor refuses one too."""
    env = {**os.environ, "HARDCOUNT_DELIVERY_DISPATCH": "kafka", "DJANGO_SETTINGS_MODULE": "hardcount.settings"}
    loaded = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert loaded.returncode != 0
    assert "HARDCOUNT_DELIVERY_DISPATCH must be 'poll' or 'nats', not 'kafka'" in loaded.stderr
    with pytest.raises(ValueError, match="unknown dispatch"):
        executor_module.Executor(executor_module.ExecutorConfig(dispatch="kafka"), conninfo="dbname=unused")
