"""Claim distribution through a stream engine (docs/reference/webhooks.md#dispatch-through-a-stream, decision 0200).

With ``HARDCOUNT_DELIVERY_DISPATCH=nats`` the writer of deliveries publishes each new delivery's id,
after its transaction commits, to a stream keyed by tenant, and executors pull ids from one durable
consumer they all share instead of polling the claim query. PostgreSQL stays the source of truth: a
message only says which row to *try* to lease. The lease, the writes predicated on it, the attempts
clamp and the reaper are the claim queue's, unchanged (``outbox.executor``), so what the stream
loses, duplicates or reorders costs latency, never a delivery or a second terminal write: a lost id
is found by the executors' sweep, a duplicate finds the row held or finished and is acknowledged.

The adapter is one small interface, :class:`DeliveryStream` (publish ids; fetch a batch; ack; nak
with a delay), with a NATS JetStream implementation, :class:`NatsDeliveryStream`. Kafka would be a
second implementation of the same interface (decision 0200 says how).

:class:`Publisher` is the writer's side in a synchronous process (web workers, the scheduler): the
transaction's ``on_commit`` hands the ids to a background thread, which publishes them; the commit
never waits for the stream, and an id it could not publish is left to the sweep.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from outbox.metrics import STREAM_IDS

log = logging.getLogger("outbox.stream")

# The stream keeps a message at most this long (a week: longer than the retry schedule's day and an
# open circuit's hour); one it drops is found by the sweep like any lost id.
MAX_AGE_S = 7 * 86400.0
# The executors' shared durable consumer.
CONSUMER = "hardcount-executors"


class StreamUnavailable(Exception):
    """The stream engine cannot be reached (or refused the operation): fall back to the claim query."""


@dataclass
class StreamMessage:
    """One delivery id as the stream handed it to an executor.

    ``handle`` is the engine's own message, acknowledged through the stream that fetched it;
    ``deliveries`` is how many times the stream has handed this message out (1 the first time).
    """

    delivery_id: str
    handle: Any
    deliveries: int = 1


class DeliveryStream(Protocol):
    """The whole adapter between the claim queue and a stream engine (async; one per event loop).

    Every method raises :class:`StreamUnavailable` when the engine cannot be reached; the caller then
    relies on PostgreSQL alone (the sweep, or the claim query).
    """

    async def publish(self, deliveries: Sequence[tuple[str, str]]) -> int:
        """Publish ``(tenant_id, delivery_id)`` pairs, keyed by tenant; returns how many the engine stored."""
        ...

    async def fetch(self, limit: int, timeout_s: float) -> list[StreamMessage]:
        """Up to ``limit`` ids for this executor alone, waiting at most ``timeout_s`` for the first ([] if none)."""
        ...

    async def ack(self, message: StreamMessage) -> None:
        """The id's row is finished or not ours to try: the engine may forget the message."""
        ...

    async def nak(self, message: StreamMessage, delay_s: float) -> None:
        """Hand the message back, to be handed out again (to any executor) no sooner than ``delay_s`` seconds."""
        ...

    async def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


def subject_for(prefix: str, tenant_id: str) -> str:
    """The subject of a tenant's delivery ids: ``<prefix>.<tenant_id>`` (ids have no dots or wildcards)."""
    return f"{prefix}.{tenant_id}"


class NatsDeliveryStream:
    """:class:`DeliveryStream` on NATS JetStream (``nats-py``).

    One stream ``stream`` holds the subjects ``<subject_prefix>.<tenant_id>`` in file storage with
    work-queue retention (a message is deleted once acknowledged) and a maximum age of
    :data:`MAX_AGE_S`; one durable pull consumer ``consumer``, explicit acks, no limit on
    redeliveries or on acks pending (a retry waits in the stream as a message nak'd with its backoff),
    ``ack_wait_s`` before an unacknowledged message is handed out again. Both are created when
    missing. The client reconnects by itself; a connection found closed or broken is dropped and
    made anew at the next call.
    """

    def __init__(
        self,
        url: str,
        *,
        stream: str = "HARDCOUNT_DELIVERIES",
        subject_prefix: str = "hardcount.deliveries",
        consumer: str = CONSUMER,
        ack_wait_s: float = 60.0,
        connect_timeout_s: float = 2.0,
        request_timeout_s: float = 2.0,
    ):
        self.url = url
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.consumer = consumer
        self.ack_wait_s = ack_wait_s
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._lock = asyncio.Lock()
        self._opening: asyncio.Future | None = None
        self._failed = False

    async def _open(self) -> tuple[Any, Any]:
        """Connect and make sure the stream exists; ``(client, JetStream context)``. Raises StreamUnavailable."""
        import nats
        from nats.js import api

        async def quiet(exc: Exception) -> None:
            log.debug("nats connection error: %s", exc)

        nc = nats.NATS()
        try:
            # max_reconnect_attempts=-1: once connected, reconnect forever (a restarted server is picked up
            # again); the first connect is bounded here instead.
            await asyncio.wait_for(
                nc.connect(
                    self.url,
                    connect_timeout=self.connect_timeout_s,
                    reconnect_time_wait=0.5,
                    max_reconnect_attempts=-1,
                    error_cb=quiet,
                    name=f"hardcount-outbox-{os.getpid()}",
                ),
                self.connect_timeout_s + 1,
            )
            js = nc.jetstream(timeout=self.request_timeout_s)
            try:
                await js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                await js.add_stream(
                    api.StreamConfig(
                        name=self.stream,
                        subjects=[f"{self.subject_prefix}.>"],
                        retention=api.RetentionPolicy.WORK_QUEUE,
                        storage=api.StorageType.FILE,
                        max_age=MAX_AGE_S,
                    )
                )
        except asyncio.CancelledError:
            await _close_quietly(nc)
            raise
        except Exception as exc:
            await _close_quietly(nc)
            raise StreamUnavailable(f"nats at {self.url}: {type(exc).__name__}: {exc}") from exc
        return nc, js

    async def _connection(self, *, consume: bool) -> Any:
        """The JetStream context (with the pull subscription when ``consume``), connecting when needed.

        The first connect is awaited; after one failed, the next is made in the background and
        callers get :class:`StreamUnavailable` at once until it succeeds, so an executor polling
        while the stream is down is not held up by connect timeouts.
        """
        from nats.js import api

        async with self._lock:
            if self._nc is not None and self._nc.is_closed:
                self._nc = self._js = self._sub = None
            if self._nc is None:
                if self._opening is None:
                    self._opening = asyncio.ensure_future(self._open())
                    self._opening.add_done_callback(lambda f: f.cancelled() or f.exception())
                opening = self._opening
                if self._failed and not opening.done():
                    raise StreamUnavailable(f"nats at {self.url}: connecting")
                try:
                    self._nc, self._js = await asyncio.shield(opening)
                except StreamUnavailable:
                    self._failed = True
                    raise
                finally:
                    if opening.done():
                        self._opening = None
                self._failed = False
            if consume and self._sub is None:
                try:
                    self._sub = await self._js.pull_subscribe(
                        f"{self.subject_prefix}.>",
                        durable=self.consumer,
                        stream=self.stream,
                        config=api.ConsumerConfig(
                            ack_policy=api.AckPolicy.EXPLICIT,
                            ack_wait=self.ack_wait_s,
                            max_deliver=-1,
                            max_ack_pending=-1,
                            max_waiting=4096,
                        ),
                    )
                except Exception as exc:
                    await self._drop()
                    raise StreamUnavailable(f"nats consumer {self.consumer}: {type(exc).__name__}: {exc}") from exc
            return self._js

    async def _drop(self) -> None:
        nc, self._nc, self._js, self._sub = self._nc, None, None, None
        if nc is not None:
            await _close_quietly(nc)

    async def publish(self, deliveries: Sequence[tuple[str, str]]) -> int:
        """See :meth:`DeliveryStream.publish`; all pairs are sent before any acknowledgement is awaited."""
        if not deliveries:
            return 0
        js = await self._connection(consume=False)
        prefix = self.subject_prefix
        results = await asyncio.gather(
            *(js.publish(subject_for(prefix, tenant), delivery.encode()) for tenant, delivery in deliveries),
            return_exceptions=True,
        )
        stored = sum(1 for r in results if not isinstance(r, BaseException))
        if stored < len(deliveries):
            first = next(r for r in results if isinstance(r, BaseException))
            if not self._nc.is_connected:
                await self._drop()
            raise StreamUnavailable(
                f"{len(deliveries) - stored} of {len(deliveries)} ids not stored: {type(first).__name__}: {first}"
            )
        return stored

    async def fetch(self, limit: int, timeout_s: float) -> list[StreamMessage]:
        """See :meth:`DeliveryStream.fetch`."""
        import nats

        await self._connection(consume=True)
        sub = self._sub
        try:
            messages = await sub.fetch(limit, timeout=max(0.05, timeout_s))
        except (TimeoutError, nats.errors.TimeoutError):
            if not self._nc.is_connected:
                raise StreamUnavailable(f"nats at {self.url}: disconnected") from None
            return []
        except Exception as exc:
            await self._drop()
            raise StreamUnavailable(f"nats fetch: {type(exc).__name__}: {exc}") from exc
        out = []
        for m in messages:
            try:
                deliveries = m.metadata.num_delivered
            except Exception:
                deliveries = 1
            out.append(StreamMessage(m.data.decode(), m, deliveries))
        return out

    async def ack(self, message: StreamMessage) -> None:
        """See :meth:`DeliveryStream.ack`."""
        try:
            await message.handle.ack()
        except Exception as exc:
            raise StreamUnavailable(f"nats ack: {type(exc).__name__}: {exc}") from exc

    async def nak(self, message: StreamMessage, delay_s: float) -> None:
        """See :meth:`DeliveryStream.nak`: JetStream's nak with a delay."""
        try:
            await message.handle.nak(delay=max(0.0, delay_s) or None)
        except Exception as exc:
            raise StreamUnavailable(f"nats nak: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        """See :meth:`DeliveryStream.close`."""
        opening, self._opening = self._opening, None
        if opening is not None:
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
            elif not opening.cancelled() and opening.exception() is None:
                await _close_quietly(opening.result()[0])
        await self._drop()


async def _close_quietly(nc: Any) -> None:
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except Exception:
        log.debug("nats close failed", exc_info=True)


def stream_from_settings(**overrides: Any) -> DeliveryStream:
    """The configured stream (``HARDCOUNT_NATS_URL``, ``HARDCOUNT_NATS_STREAM``, ``HARDCOUNT_NATS_SUBJECT_PREFIX``)."""
    from django.conf import settings

    options = {
        "stream": getattr(settings, "HARDCOUNT_NATS_STREAM", "HARDCOUNT_DELIVERIES"),
        "subject_prefix": getattr(settings, "HARDCOUNT_NATS_SUBJECT_PREFIX", "hardcount.deliveries"),
        **overrides,
    }
    return NatsDeliveryStream(getattr(settings, "HARDCOUNT_NATS_URL", "nats://127.0.0.1:4222"), **options)


# -- the writer's side ------------------------------------------------------------------------------


class Publisher:
    """Publishes committed deliveries' ids from a background thread with its own event loop.

    :meth:`submit` never blocks and never raises: it queues the ids (at most ``max_queued``; past
    that the oldest are dropped) for the thread, which publishes whatever is queued in one batch.
    Ids it could not publish (stream down, queue full, the process killed first) are dropped and
    counted: the executors' sweep finds their rows in PostgreSQL. One whose acknowledgement timed out
    may still be stored later (the client sends what it buffered while reconnecting): a duplicate.
    """

    def __init__(self, make_stream=stream_from_settings, *, max_queued: int = 100_000):
        self._make_stream = make_stream
        self._queue: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_queued)
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.published = 0
        self.dropped = 0
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False

    def submit(self, deliveries: Sequence[tuple[str, str]]) -> None:
        """Queue ``(tenant_id, delivery_id)`` pairs for publishing (after commit)."""
        if not deliveries:
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._start()  # after a fork (gunicorn's workers) the parent's thread is not ours
            overflow = max(0, len(self._queue) + len(deliveries) - (self._queue.maxlen or 0))
            self.dropped += overflow
            if overflow:
                STREAM_IDS.labels(result="dropped").inc(overflow)
            self._queue.extend(deliveries)
            self._idle.clear()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (what is still queued is dropped: the sweep finds it) and close its connection."""
        self._stopping = True
        loop, wake, thread = self._loop, self._wake, self._thread
        if loop is not None and wake is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(wake.set)
            thread.join(timeout_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far was published or dropped; False on timeout."""
        return self._idle.wait(timeout_s)

    def _start(self) -> None:
        ready = threading.Event()
        self._pid = os.getpid()
        self._loop = None
        self._thread = threading.Thread(target=self._run, args=(ready,), name="outbox-publisher", daemon=True)
        self._thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            stream = self._make_stream()
            while not self._stopping:
                await self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    break
                while True:
                    with self._lock:
                        batch = [self._queue.popleft() for _ in range(min(len(self._queue), 1000))]
                    if not batch:
                        break
                    try:
                        published = await stream.publish(batch)
                        self.published += published
                        STREAM_IDS.labels(result="published").inc(published)
                    except StreamUnavailable as exc:
                        self.dropped += len(batch)
                        STREAM_IDS.labels(result="dropped").inc(len(batch))
                        log.warning("outbox publish failed; %d ids left to the sweep: %s", len(batch), exc)
                    except Exception:
                        self.dropped += len(batch)
                        STREAM_IDS.labels(result="dropped").inc(len(batch))
                        log.exception("outbox publish crashed; %d ids left to the sweep", len(batch))
                with self._lock:
                    if not self._queue:
                        self._idle.set()
            await stream.close()
            self._idle.set()

        asyncio.run(main())


_publishers: list[Publisher] = []
_publisher_lock = threading.Lock()


def publisher() -> Publisher:
    """This process's :class:`Publisher` (made on first use)."""
    with _publisher_lock:
        if not _publishers:
            _publishers.append(Publisher())
        return _publishers[0]


def publish_on_commit(deliveries: Sequence[tuple[str, str]]) -> None:
    """After the current transaction commits, publish ``(tenant_id, delivery_id)`` pairs (nothing if it rolls back)."""
    from django.db import transaction

    if not deliveries:
        return
    pairs = list(deliveries)
    transaction.on_commit(lambda: publisher().submit(pairs))


__all__ = [
    "CONSUMER",
    "DeliveryStream",
    "NatsDeliveryStream",
    "Publisher",
    "StreamMessage",
    "StreamUnavailable",
    "publish_on_commit",
    "publisher",
    "stream_from_settings",
    "subject_for",
]
