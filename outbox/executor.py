"""The webhook delivery executor: a leaderless claim-queue worker pool in every replica (docs/reference/webhooks.md).

Shape: one thread runs an asyncio loop with

- a **dispatcher** that claims due deliveries in one statement (``queries.CLAIM_DUE_RECORDING_LOST``,
  ``FOR UPDATE SKIP LOCKED``, which also records any attempt lost with an expired lease), never
  more than the pool's idle workers, and starts one worker task per claim; it sleeps until a
  worker frees up, an ``outbox_delivery`` notification arrives (inserts notify at commit) or
  the poll interval passes;
- **workers** (at most ``workers`` at a time), each sending one signed request with the
  outbound policy's client (:class:`hardcount.outbound.OutboundClient`, aiohttp: public targets
  only, checked at connect time; one client per executor, its connections kept alive and
  pooled) under a total timeout, then handing the outcome to the writer; a worker is busy
  until its outcome is written;
- a **writer** that records the outcomes that finished while its previous write ran, all in
  one statement (``queries.RECORD_OUTCOMES``: the rows, their attempt rows and the endpoints'
  circuit counts), each row predicated on its claim still being ours; if the statement fails,
  each outcome is written on its own, then with the minimal failed write;
- a **renewer** that extends the leases of all claims in flight, in one statement, every
  ``timeout_s / 2`` and cancels the request of any claim it could not renew (expired,
  reclaimed, or not renewed in time on the executor's own monotonic clock): the result of a
  lost claim is discarded;
- a **reaper** that re-queues deliveries whose lease expired (``queries.REAP_EXPIRED_CLAIMS``),
  its own replica's included, recording the lost attempt.

With ``dispatch="nats"`` (``HARDCOUNT_DELIVERY_DISPATCH``) the dispatcher takes delivery ids from a
stream (:mod:`outbox.stream`) instead of polling, claims their rows with the same predicate and lease
(``queries.CLAIM_IDS_RECORDING_LOST``), acks or naks each message once its outcome is written, and
sweeps on a timer for rows no message brought (``queries.CLAIM_AGED_RECORDING_LOST``); everything
below the dispatcher is the same (docs/decisions/0200-dispatch-through-a-stream.md).

The lease is ``claimed_by`` + ``claim_expires_at = now() + 2 × timeout_s``. Attempts are
spent at the claim and clamped to 1..8 (see :mod:`outbox.queries`), one
``DeliveryAttempt`` row each. Retry policy: :func:`classify` and :func:`retry_delay_s`;
the per-endpoint circuit breaker is in the SQL of :mod:`outbox.queries` and in
:meth:`Executor._handle`. Design records: ``docs/decisions/0030-webhook-delivery-executor.md``,
``docs/decisions/0190-executor-batches-and-httpx-kept.md`` (the batches),
``docs/decisions/0226-executor-client-aiohttp.md`` (the client).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg
from django.conf import settings
from django.db import connections
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from hardcount import outbound
from hardcount.ids import new_id
from outbox import queries
from outbox.metrics import DELIVERY_ATTEMPTS
from outbox.representations import event_body
from outbox.signing import HEADER, sign
from outbox.stream import DeliveryStream, StreamMessage, StreamUnavailable, stream_from_settings

log = logging.getLogger("outbox.executor")

MAX_ATTEMPTS = queries.MAX_ATTEMPTS
# Delay after failed attempt k (k = 1..7) before jitter: about x3 a step, 22 h 14 min in all,
# so the 8th and last attempt comes roughly a day after the first (docs/reference/webhooks.md: ~1 min to ~1 day).
RETRY_SCHEDULE_S = (60.0, 180.0, 600.0, 1800.0, 5400.0, 18000.0, 54000.0)
# 4xx answers that mean "try again later" rather than "never" (timeout, conflict, too early,
# rate limited); every other 4xx is permanent.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})
MAX_RETRY_AFTER_S = 86400.0
EXCERPT_BYTES = 1024
# A claim counts as ours on the executor's own clock for this share of the lease after the
# claim (or the last renewal) was sent; past it the request is cancelled before the
# database would let another executor reclaim the row.
LOCAL_LEASE_SHARE = 0.75

SUCCEEDED, FAILED, RETRYABLE, LEASE_LOST, CANCELED = "succeeded", "failed", "retryable", "lease_lost", "canceled"
# Most outcomes one statement of the writer records; more wait for the next.
WRITE_BATCH = 500
# An idle kept-alive connection to a receiver is closed after this long, s.
KEEPALIVE_EXPIRY_S = 5.0


def classify(status_code: int | None) -> str:
    """Outcome of an HTTP answer: ``succeeded`` (2xx), ``failed`` (permanent) or ``retryable``.

    ``None`` (no answer: timeout, connection error) is retryable. 4xx is permanent except
    408, 409, 425 and 429; 3xx (redirects are not followed), 5xx and anything else retry.
    """
    if status_code is None:
        return RETRYABLE
    if 200 <= status_code < 300:
        return SUCCEEDED
    if 400 <= status_code < 500 and status_code not in RETRYABLE_4XX:
        return FAILED
    return RETRYABLE


def retry_delay_s(attempt: int, *, jitter: float = 0.2, retry_after_s: float | None = None, rng=random) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1..7) before the next one.

    ``RETRY_SCHEDULE_S[attempt - 1]`` scaled by a uniform factor in ``[1 - jitter, 1 + jitter]``
    so deliveries that failed together do not retry together. A receiver's ``Retry-After``
    (seconds) lengthens the wait, up to a day, but never shortens it.
    """
    base = RETRY_SCHEDULE_S[max(1, min(attempt, len(RETRY_SCHEDULE_S))) - 1]
    delay = base * rng.uniform(1 - jitter, 1 + jitter)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, MAX_RETRY_AFTER_S))
    return delay


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return None  # HTTP-date form: ignored, the backoff applies


def conninfo_from_django(alias: str = "default") -> str:
    """A libpq connection string for Django's database ``alias`` (the test database under pytest)."""
    params = connections[alias].get_connection_params()
    ignored = {"cursor_factory", "context", "prepare_threshold", "server_side_binding", "pool", "isolation_level"}
    parts = {k: str(v) for k, v in params.items() if k not in ignored and v not in (None, "")}
    parts["application_name"] = "hardcount-outbox"
    return psycopg.conninfo.make_conninfo(**parts)


def lost_attempt_params(*, delivery_id: str, lost_claim: str, number: int, recorded_by: str) -> dict[str, Any]:
    """INSERT_ATTEMPT parameters for an attempt whose executor vanished with the lease."""
    return {
        "attempt_id": new_id("wha"),
        "delivery_id": delivery_id,
        "number": max(1, min(number, MAX_ATTEMPTS)),
        "outcome": LEASE_LOST,
        "status_code": None,
        "latency_ms": None,
        "error": f"lease expired: executor {lost_claim} stopped reporting; the request may or may not have been sent",
        "response_excerpt": "",
        "executor": recorded_by,
    }


@dataclass(frozen=True)
class ExecutorConfig:
    """Knobs of one executor; :meth:`from_settings` reads the ``HARDCOUNT_*`` settings.

    ``timeout_s`` is the total time one request may take (connect + send + first 1 KiB of
    the answer); ``connect_timeout_s`` bounds the TCP/TLS connect alone. The lease is
    ``2 × timeout_s``. The circuit opens after ``breaker_threshold`` consecutive failures of
    an endpoint, for ``breaker_cooldown_s`` doubling per further failure up to
    ``breaker_max_cooldown_s``.
    """

    workers: int = 8
    timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    poll_interval_s: float = 1.0
    renew_interval_s: float | None = None
    reap_interval_s: float | None = None
    shutdown_grace_s: float | None = None
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 60.0
    breaker_max_cooldown_s: float = 3600.0
    jitter: float = 0.2
    reap_batch: int = 500
    listen: bool = True
    # Connections go through a transaction-pooling PgBouncer (HARDCOUNT_DB_TRANSACTION_POOLING): no LISTEN
    # (a notification goes to whichever server connection listened, not to us) and no session settings.
    pooled: bool = False
    # False: the executor's sessions commit without waiting for the WAL flush (synchronous_commit = off), so
    # a server crash may lose its latest claims and outcomes and those deliveries go out again; not applied
    # when pooled (docs/decisions/0226).
    synchronous_commit: bool = False
    # "poll": claim due rows with the claim query; "nats": take ids from the stream (outbox.stream), and
    # every sweep_interval_s claim rows due for over sweep_age_s that no message brought (None: no
    # sweep, the negative control of the tests). While the stream is unreachable, poll.
    dispatch: str = "poll"
    sweep_interval_s: float | None = 5.0
    sweep_age_s: float = 5.0
    # How long an unreachable stream is left alone before the executor tries it again, s.
    stream_retry_s: float = 5.0
    # How long a fetch waits for the stream's first id, s: returns at once when ids are there. Not the poll
    # interval: on a loaded machine the stream's answer can take longer than a short poll, and a fetch
    # that timed out looks like an empty stream, which would hand a backlog to the sweep.
    fetch_wait_s: float = 1.0

    @property
    def lease_s(self) -> float:
        """The lease on a claimed delivery: twice the request timeout (docs/reference/webhooks.md)."""
        return 2 * self.timeout_s

    @property
    def renew_every_s(self) -> float:
        return self.renew_interval_s or self.timeout_s / 2

    @property
    def reap_every_s(self) -> float:
        return self.reap_interval_s or self.lease_s / 2

    @property
    def stream_ack_wait_s(self) -> float:
        """How long the stream waits for a handed-out id's ack before handing it out again: two leases."""
        return max(5.0, 2 * self.lease_s)

    @classmethod
    def from_settings(cls, **overrides: Any) -> ExecutorConfig:
        timeout_s = float(getattr(settings, "HARDCOUNT_DELIVERY_TIMEOUT_S", 10.0))
        base = cls(
            workers=int(getattr(settings, "HARDCOUNT_OUTBOX_WORKERS", 8)),
            timeout_s=timeout_s,
            connect_timeout_s=min(timeout_s, float(getattr(settings, "HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S", 5.0))),
            poll_interval_s=float(getattr(settings, "HARDCOUNT_OUTBOX_POLL_S", 1.0)),
            breaker_threshold=int(getattr(settings, "HARDCOUNT_OUTBOX_BREAKER_THRESHOLD", 5)),
            breaker_cooldown_s=float(getattr(settings, "HARDCOUNT_OUTBOX_BREAKER_COOLDOWN_S", 60.0)),
            shutdown_grace_s=getattr(settings, "HARDCOUNT_OUTBOX_SHUTDOWN_GRACE_S", None),
            listen=not getattr(settings, "HARDCOUNT_DB_TRANSACTION_POOLING", False),
            pooled=bool(getattr(settings, "HARDCOUNT_DB_TRANSACTION_POOLING", False)),
            synchronous_commit=bool(getattr(settings, "HARDCOUNT_DELIVERY_SYNCHRONOUS_COMMIT", False)),
            dispatch=getattr(settings, "HARDCOUNT_DELIVERY_DISPATCH", "poll"),
            sweep_interval_s=float(getattr(settings, "HARDCOUNT_DELIVERY_SWEEP_S", 5.0)),
            sweep_age_s=float(getattr(settings, "HARDCOUNT_DELIVERY_SWEEP_AGE_S", 5.0)),
        )
        return replace(base, **overrides)


@dataclass
class _Claim:
    """One claimed delivery and everything needed to send it."""

    id: str
    claim: str
    attempts: int  # this attempt's number (spent at the claim, 1..MAX_ATTEMPTS)
    prev_attempts: int
    event_id: str
    event_type: str
    event_data: Any
    event_created_at: datetime
    livemode: bool
    sequence: int
    endpoint_id: str
    url: str
    secret: str
    endpoint_active: bool
    circuit: str  # closed | open | half_open, as the claim saw it
    local_deadline: float
    task: asyncio.Task | None = None
    send_task: asyncio.Task | None = None
    lost: bool = False
    shutting_down: bool = False
    # Stream dispatch: the message that brought this claim, and what to tell the stream once the
    # claim is finished: ("ack", 0) or ("nak", seconds until the row is due again). None: the write
    # was lost or never made; the message is handed back for a lease, when the row is settled.
    message: StreamMessage | None = None
    settle: tuple[str, float] | None = None


@dataclass
class _Result:
    outcome: str
    status_code: int | None = None
    latency_ms: int | None = None
    error: str = ""
    excerpt: str = ""
    retry_after_s: float | None = None


# The columns of one row of ``queries.RECORD_OUTCOMES``, in :meth:`_Outcome.row`'s order.
_OUTCOME_COLUMNS = (
    "ids",
    "claims",
    "statuses",
    "attempts",
    "errors",
    "delays_s",
    "attempt_ids",
    "numbers",
    "outcomes",
    "status_codes",
    "latencies_ms",
    "attempt_errors",
    "excerpts",
    "endpoint_ids",
    "effects",
)


_EVIDENCE_KEYS = ("attempt_id", "number", "outcome", "status_code", "latency_ms", "error", "response_excerpt")


@dataclass
class _Outcome:
    """One claim's finishing write, waiting for the writer's next batch.

    ``sql``/``params`` are the one-by-one statement (``RECORD_SUCCEEDED``, ``RECORD_FAILED`` or
    ``RECORD_RETRY``) the batch row stands for, kept for the writer's fallback; ``done``
    resolves to True when a probe's success closed the endpoint's circuit.
    """

    claim: _Claim
    sql: str
    params: dict[str, Any]
    attempt: dict[str, Any] | None
    result: _Result | None
    probe: bool
    done: asyncio.Future

    def row(self) -> tuple:
        c, a, r = self.claim, self.attempt, self.result
        if self.sql is queries.RECORD_SUCCEEDED:
            status, attempts, error, delay_s = "succeeded", None, "", 0.0
        elif self.sql is queries.RECORD_FAILED:
            status, attempts, error, delay_s = "failed", self.params["attempts"], self.params["error"], 0.0
        else:
            status, attempts, error, delay_s = "retrying", None, self.params["error"], self.params["delay_s"]
        if r is None:
            effect = None
        elif r.status_code == 410:
            effect = "gone"
        elif r.outcome in (SUCCEEDED, FAILED):
            effect = "reset"
        elif r.outcome == RETRYABLE:
            effect = "fail"
        else:
            effect = None  # canceled at shutdown: says nothing about the endpoint
        if a is None:
            evidence = (None,) * 7
        else:
            evidence = tuple(a[k] for k in _EVIDENCE_KEYS)
        return (c.id, c.claim, status, attempts, error, delay_s, *evidence, c.endpoint_id, effect)


class _ClaimLost(Exception):
    """The write matched no row: the claim is no longer ours, so its result is discarded."""


@dataclass
class ExecutorStats:
    """Counters for logs, tests and benchmarks (per executor, since start)."""

    counts: collections.Counter = field(default_factory=collections.Counter)

    def __getitem__(self, key: str) -> int:
        return self.counts[key]


class Executor:
    """The delivery worker pool of one replica. ``start()`` runs it in a thread; ``stop()`` ends it.

    Any number of executors (threads, processes, replicas) may run against one database:
    they coordinate only through the delivery rows. ``stop()`` stops claiming, lets
    requests in flight finish for ``shutdown_grace_s`` (default ``timeout_s``), then cancels
    the rest, recording each as a ``canceled`` attempt to be retried.
    """

    def __init__(
        self,
        config: ExecutorConfig | None = None,
        *,
        executor_id: str | None = None,
        conninfo=None,
        stream: DeliveryStream | None = None,
    ):
        self.config = config or ExecutorConfig.from_settings()
        if self.config.dispatch not in ("poll", "nats"):
            raise ValueError(f"unknown dispatch {self.config.dispatch!r}: 'poll' or 'nats'")
        self._stream = stream
        self.executor_id = executor_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._conninfo = conninfo or conninfo_from_django()
        self.stats = ExecutorStats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._inflight: dict[str, _Claim] = {}
        self._outcomes: list[_Outcome] = []
        self._rng = random.Random()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, *, wait_s: float = 15.0) -> Executor:
        """Start the pool's thread; returns once it is connected. Raises if it could not start."""
        if self._thread is not None:
            raise RuntimeError("executor already started")
        self._thread = threading.Thread(target=self._run, name=f"outbox-executor-{self.executor_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(wait_s):
            raise RuntimeError("outbox executor did not start in time")
        if self._startup_error is not None:
            raise RuntimeError("outbox executor could not start") from self._startup_error
        log.info("outbox executor started executor=%s workers=%d", self.executor_id, self.config.workers)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop claiming, finish or cancel requests in flight, close connections; waits for the thread."""
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:
                pass  # loop already closed
        if thread is not None:
            grace = self.config.shutdown_grace_s or self.config.timeout_s
            thread.join(timeout_s if timeout_s is not None else grace + 15)
        log.info("outbox executor stopped executor=%s stats=%s", self.executor_id, dict(self.stats.counts))

    @property
    def running(self) -> bool:
        """True while the executor's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # the thread must not die silently
            if not self._ready.is_set():
                self._startup_error = exc
                self._ready.set()
            log.exception("outbox executor crashed executor=%s", self.executor_id)

    async def _main(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._worker_done = asyncio.Event()
        self._work_available = asyncio.Event()
        self._outcomes_ready = asyncio.Event()
        pool = AsyncConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=cfg.workers + 3,
            open=False,
            # prepare_threshold None: never a server-side prepared statement (a pooler's next transaction
            # may land on a server connection that does not have it).
            kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": None},
            configure=(
                _configure_pooled_connection
                if cfg.pooled
                else functools.partial(_configure_connection, synchronous_commit=cfg.synchronous_commit)
            ),
            name=f"outbox-{self.executor_id}",
        )
        try:
            await pool.open(wait=True, timeout=10)
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            await pool.close()
            return
        self._pool = pool
        # The outbound policy's client: targets are checked at connect time, redirects never followed.
        # One for the loop, so connections stay alive between deliveries; at most one per worker.
        client = outbound.OutboundClient(
            timeout_s=cfg.timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_connections=cfg.workers,
            keepalive_s=KEEPALIVE_EXPIRY_S,
        )
        async with client:
            self._client = client
            helpers = [
                asyncio.create_task(self._renew_loop()),
                asyncio.create_task(self._reap_loop()),
                asyncio.create_task(self._write_loop()),
            ]
            if cfg.dispatch == "nats" and self._stream is None:
                self._stream = stream_from_settings(ack_wait_s=cfg.stream_ack_wait_s)
            if cfg.listen and cfg.dispatch == "poll":
                self._listening = asyncio.Event()
                helpers.append(asyncio.create_task(self._listen_loop()))
                # Ready once LISTEN is in place, so a delivery committed after start() wakes us.
                await self._wait(self._listening, 10.0)
            self._ready.set()
            try:
                if cfg.dispatch == "nats":
                    await self._dispatch_stream_loop()
                else:
                    await self._dispatch_loop()
            finally:
                await self._drain_inflight()
                for task in helpers:
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
                if self._stream is not None:
                    await self._stream.close()
        await pool.close()

    # -- dispatcher --------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        cfg = self.config
        while not self._stopping.is_set():
            # Cleared before claiming, so a signal that arrives during the claim is not lost.
            self._worker_done.clear()
            self._work_available.clear()
            idle = cfg.workers - len(self._inflight)
            claimed = 0
            if idle > 0:
                try:
                    claims = await self._claim(idle)
                except Exception:
                    log.exception("outbox claim failed executor=%s", self.executor_id)
                    await self._wait(self._stopping, cfg.poll_interval_s)
                    continue
                claimed = len(claims)
                for claim in claims:
                    self._inflight[claim.claim] = claim
                    claim.task = asyncio.create_task(self._deliver(claim))
            if claimed and claimed == idle:
                await self._wait(self._worker_done, cfg.poll_interval_s)  # every worker busy: wait for one
            elif idle <= 0:
                await self._wait(self._worker_done, cfg.poll_interval_s)
            else:
                await self._wait(self._work_available, cfg.poll_interval_s)  # queue drained: wait for news

    async def _wait(self, event: asyncio.Event, timeout_s: float) -> None:
        waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stopping.wait())}
        _, pending = await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    async def _claim(self, limit: int, sql: str = queries.CLAIM_DUE_RECORDING_LOST, **more: Any) -> list[_Claim]:
        cfg = self.config
        local_deadline = time.monotonic() + cfg.lease_s * LOCAL_LEASE_SHARE
        params = {
            "limit": limit,
            "executor": self.executor_id,
            "lease_s": float(cfg.lease_s),
            "attempt_ids": [new_id("wha") for _ in range(limit)],
            **more,
        }
        # One statement: the claim and the evidence of any attempt lost with an expired lease.
        async with self._pool.connection() as conn:
            rows = await (await conn.execute(sql, params)).fetchall()
        lost = sum(1 for r in rows if r["lost_claim"] and r["prev_attempts"] >= 1)
        if lost:
            DELIVERY_ATTEMPTS.labels(outcome=LEASE_LOST).inc(lost)
        self.stats.counts["claimed"] += len(rows)
        return [
            _Claim(
                id=r["id"],
                claim=r["claimed_by"],
                attempts=r["attempts"],
                prev_attempts=min(r["prev_attempts"], MAX_ATTEMPTS),
                event_id=r["event_id"],
                event_type=r["event_type"],
                event_data=r["event_data"],
                event_created_at=r["event_created_at"],
                livemode=r["livemode"],
                sequence=r["sequence"],
                endpoint_id=r["endpoint_id"],
                url=r["url"],
                secret=r["secret"],
                endpoint_active=r["endpoint_active"],
                circuit=r["circuit"],
                local_deadline=local_deadline,
            )
            for r in rows
        ]

    # -- dispatch through a stream (HARDCOUNT_DELIVERY_DISPATCH=nats) ----------------------

    async def _dispatch_stream_loop(self) -> None:
        """Fill idle workers with the rows of the ids the stream hands over; sweep on a timer; poll while it is down.

        The sweep (``queries.CLAIM_AGED_RECORDING_LOST``) claims rows due for over ``sweep_age_s``:
        what no message brought, whatever the reason. It runs every ``sweep_interval_s``, and again at
        once while it fills every idle worker and the stream has nothing to hand over (a backlog the
        stream lost or never saw); while the stream brings work, the sweep takes at most the workers
        idle at its tick, so a backlog the stream does hold is worked through the stream. While the
        stream is unreachable the claim query is the whole dispatch, as in poll mode.
        """
        cfg = self.config
        next_sweep = time.monotonic()  # rows left from before this executor started: at once
        down_until = 0.0
        # The last fetch found nothing. Not assumed at start: a backlog the stream holds must not be
        # drained by sweeps that never leave a worker idle for a fetch.
        stream_idle = False
        while not self._stopping.is_set():
            self._worker_done.clear()
            idle = cfg.workers - len(self._inflight)
            if idle <= 0:
                await self._wait(self._worker_done, cfg.poll_interval_s)
                continue
            now = time.monotonic()
            stream_up = now >= down_until
            if not stream_up or (cfg.sweep_interval_s is not None and now >= next_sweep):
                min_age_s = cfg.sweep_age_s if stream_up else 0.0
                try:
                    claims = await self._claim(idle, queries.CLAIM_AGED_RECORDING_LOST, min_age_s=float(min_age_s))
                except Exception:
                    log.exception("outbox sweep claim failed executor=%s", self.executor_id)
                    await self._wait(self._stopping, cfg.poll_interval_s)
                    continue
                self.stats.counts["swept" if stream_up else "polled"] += len(claims)
                self._start(claims)
                if cfg.sweep_interval_s is not None and (len(claims) < idle or not stream_idle):
                    next_sweep = now + cfg.sweep_interval_s
                if not stream_up:
                    if len(claims) < idle:
                        await self._wait(self._stopping, cfg.poll_interval_s)
                    continue
                idle -= len(claims)
                if idle <= 0:
                    continue
            timeout_s = cfg.fetch_wait_s
            if cfg.sweep_interval_s is not None:
                timeout_s = min(timeout_s, max(cfg.fetch_wait_s / 2, next_sweep - time.monotonic()))
            try:
                messages = await self._stream.fetch(idle, timeout_s)
            except StreamUnavailable as exc:
                self.stats.counts["stream_unavailable"] += 1
                log.warning("outbox stream unavailable; polling for %g s: %s", cfg.stream_retry_s, exc)
                down_until = time.monotonic() + cfg.stream_retry_s
                continue
            stream_idle = not messages
            if messages:
                await self._claim_messages(messages)

    def _start(self, claims: list[_Claim]) -> None:
        for claim in claims:
            self._inflight[claim.claim] = claim
            claim.task = asyncio.create_task(self._deliver(claim))

    async def _claim_messages(self, messages: list[StreamMessage]) -> None:
        """Try to lease the rows of ``messages``' ids; settle at once the messages whose row is not claimable."""
        cfg = self.config
        by_id: dict[str, list[StreamMessage]] = {}
        for m in messages:
            by_id.setdefault(m.delivery_id, []).append(m)
        self.stats.counts["stream_messages"] += len(messages)
        try:
            claims = await self._claim(len(by_id), queries.CLAIM_IDS_RECORDING_LOST, ids=list(by_id))
        except Exception:
            log.exception("outbox claim of streamed ids failed executor=%s", self.executor_id)
            for m in messages:
                await self._tell(m, "nak", cfg.poll_interval_s)
            return
        self.stats.counts["stream_claimed"] += len(claims)
        for claim in claims:
            first, *again = by_id.pop(claim.id)
            claim.message = first
            for m in again:  # the same id twice in one batch: the claim's own message stands for both
                self.stats.counts["stream_duplicates"] += 1
                await self._tell(m, "ack", 0.0)
        self._start(claims)
        if not by_id:
            return
        try:
            async with self._pool.connection() as conn:
                rows = await (await conn.execute(queries.STREAM_LOOKUP, {"ids": list(by_id)})).fetchall()
        except Exception:
            log.exception("outbox lookup of unclaimed streamed ids failed executor=%s", self.executor_id)
            rows = None
        found = {r["id"]: r for r in rows or ()}
        for delivery_id, held in by_id.items():
            row = found.get(delivery_id)
            if rows is None:
                verb, delay_s = "nak", cfg.poll_interval_s
            elif row is None or row["status"] in ("succeeded", "failed"):
                verb, delay_s = "ack", 0.0  # finished (or gone): the message has done its work
                self.stats.counts["stream_duplicates"] += 1
            elif row["lease_left_s"] is not None:
                # Held by a live claim: back when that lease has surely ended (finished, or reclaimable).
                verb, delay_s = "nak", row["lease_left_s"] + cfg.poll_interval_s
            elif row["due_in_s"] > 0:
                verb, delay_s = "nak", row["due_in_s"]  # a retry or a deferral: back when it is due
            else:
                verb, delay_s = "nak", cfg.poll_interval_s  # due and free, but locked by someone just now
            for m in held:
                await self._tell(m, verb, delay_s)

    async def _settle(self, c: _Claim) -> None:
        """Tell the stream how the claim ended: ack once the row is finished, else nak until it is due again."""
        verb, delay_s = c.settle or ("nak", self.config.lease_s)
        await self._tell(c.message, verb, delay_s)

    async def _tell(self, message: StreamMessage, verb: str, delay_s: float) -> None:
        try:
            if verb == "ack":
                await self._stream.ack(message)
            else:
                await self._stream.nak(message, delay_s)
            self.stats.counts[f"stream_{verb}"] += 1
        except StreamUnavailable as exc:
            # The message comes back after the stream's ack wait and finds its row settled.
            log.warning("outbox could not %s delivery=%s: %s", verb, message.delivery_id, exc)

    # -- one delivery ------------------------------------------------------------------

    async def _deliver(self, c: _Claim) -> None:
        try:
            await self._handle(c)
        except Exception:
            # A bug or a lost database: leave the row claimed; its lease expires and the
            # reaper (in any replica) re-queues it, so nothing is lost.
            log.exception("outbox delivery crashed delivery=%s claim=%s", c.id, c.claim)
            self.stats.counts["crashed"] += 1
        finally:
            try:
                if c.message is not None:
                    await self._settle(c)
            finally:
                self._inflight.pop(c.claim, None)
                self._worker_done.set()

    async def _handle(self, c: _Claim) -> None:
        if c.prev_attempts >= MAX_ATTEMPTS:
            # The 8th attempt's executor vanished: nothing is left to spend.
            error = f"gave up: all {MAX_ATTEMPTS} attempts spent (the last one's executor stopped reporting)"
            await self._submit(c, queries.RECORD_FAILED, {"attempts": MAX_ATTEMPTS, "error": error}, None)
            return
        if not c.endpoint_active:
            error = "webhook endpoint disabled or deleted before delivery"
            await self._submit(c, queries.RECORD_FAILED, {"attempts": c.prev_attempts, "error": error}, None)
            return
        probe = False
        if c.circuit == "open":
            await self._defer(c)
            return
        if c.circuit == "half_open":
            if not await self._take_probe(c):
                await self._defer(c)
                return
            probe = True
        if self._stopping.is_set():
            if await self._write_or_discard(c, queries.RELEASE, {"attempts": c.prev_attempts}):
                c.settle = ("nak", 0.0)
            self.stats.counts["released"] += 1
            return
        c.send_task = asyncio.create_task(self._send(c))
        await asyncio.wait({c.send_task})
        if c.send_task.cancelled():
            if c.lost or not c.shutting_down:
                self.stats.counts["lease_lost"] += 1
                log.warning("outbox lease lost mid-request: result discarded delivery=%s claim=%s", c.id, c.claim)
                return
            result = _Result(CANCELED, error="canceled: the executor shut down mid-request")
        else:
            result = c.send_task.result()
        await self._record(c, result, probe=probe)

    async def _send(self, c: _Claim) -> _Result:
        body = json.dumps(
            event_body(
                id=c.event_id,
                type=c.event_type,
                created_at=c.event_created_at,
                livemode=c.livemode,
                sequence=c.sequence,
                data=c.event_data,
            ),
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "Hardcount-Webhooks/1.0",
            HEADER: sign(body, c.secret),  # signed afresh for every attempt
            "Hardcount-Event-Id": c.event_id,
            "Hardcount-Delivery-Id": c.id,
            "Hardcount-Attempt": str(c.attempts),
        }
        started = time.monotonic()
        timeout_s = self.config.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self._client.post(c.url, body, headers, max_bytes=EXCERPT_BYTES)
        except TimeoutError:
            return _Result(RETRYABLE, latency_ms=_ms_since(started), error=f"timed out after {timeout_s:g} s")
        except (outbound.OutboundFailure, ValueError) as exc:
            return _Result(RETRYABLE, latency_ms=_ms_since(started), error=_transport_error(exc, self.config))
        status_code = answer.status
        retry_after = _parse_retry_after(answer.headers.get("retry-after"))
        text = answer.excerpt[:EXCERPT_BYTES].decode("utf-8", errors="replace").replace("\x00", "\ufffd")
        outcome = classify(status_code)
        return _Result(
            outcome,
            status_code=status_code,
            latency_ms=_ms_since(started),
            error="" if outcome == SUCCEEDED else f"HTTP {status_code}",
            excerpt=text,
            retry_after_s=retry_after,
        )

    async def _record(self, c: _Claim, r: _Result, *, probe: bool) -> None:
        """Write the attempt's outcome in one transaction, predicated on the claim being ours."""
        params: dict[str, Any]
        if r.outcome == SUCCEEDED:
            sql, params = queries.RECORD_SUCCEEDED, {}
        elif r.outcome == FAILED or c.attempts >= MAX_ATTEMPTS:
            error = r.error if r.outcome == FAILED else f"{r.error}; gave up after {MAX_ATTEMPTS} attempts"
            sql, params = queries.RECORD_FAILED, {"attempts": c.attempts, "error": error}
        else:
            delay = (
                0.0 if r.outcome == CANCELED else retry_delay_s(c.attempts, jitter=self.config.jitter, rng=self._rng)
            )
            if r.retry_after_s is not None:
                delay = max(delay, min(r.retry_after_s, MAX_RETRY_AFTER_S))
            sql, params = queries.RECORD_RETRY, {"error": r.error, "delay_s": float(delay)}
        attempt = {
            "attempt_id": new_id("wha"),
            "delivery_id": c.id,
            "number": c.attempts,
            "outcome": r.outcome,
            "status_code": r.status_code,
            "latency_ms": r.latency_ms,
            "error": r.error,
            "response_excerpt": r.excerpt,
            "executor": self.executor_id,
        }
        await self._submit(c, sql, params, attempt, result=r, probe=probe)

    async def _submit(
        self,
        c: _Claim,
        sql: str,
        params: dict[str, Any],
        attempt: dict[str, Any] | None,
        *,
        result: _Result | None = None,
        probe: bool = False,
    ) -> None:
        """Hand the claim's finishing write to the writer; returns once its batch is written (or discarded)."""
        outcome = _Outcome(c, sql, params, attempt, result, probe, asyncio.get_running_loop().create_future())
        self._outcomes.append(outcome)
        self._outcomes_ready.set()
        if await outcome.done:
            await self._pull_in_deferred(c)

    async def _write_loop(self) -> None:
        """The writer: whatever finished while the last batch was being written goes out as the next batch."""
        try:
            while True:
                await self._outcomes_ready.wait()
                self._outcomes_ready.clear()
                while self._outcomes:
                    batch, self._outcomes = self._outcomes[:WRITE_BATCH], self._outcomes[WRITE_BATCH:]
                    await self._write_batch(batch)
        finally:
            for outcome in self._outcomes:
                outcome.done.cancel()

    async def _write_batch(self, batch: list[_Outcome]) -> None:
        """Write ``batch`` with ``queries.RECORD_OUTCOMES``; resolve each outcome's future with "pull in deferred".

        The statement writes only the claims still ours; the others were lost and are discarded.
        If the statement fails, each outcome is written on its own (``_finish``), so one
        delivery's bad write drives that delivery alone to ``failed``.
        """
        cfg = self.config
        columns: dict[str, list[Any]] = {name: [] for name in _OUTCOME_COLUMNS}
        for outcome in batch:
            for name, value in zip(_OUTCOME_COLUMNS, outcome.row(), strict=True):
                columns[name].append(value)
        params = {
            **columns,
            "executor": self.executor_id,
            "threshold": cfg.breaker_threshold,
            "base_s": float(cfg.breaker_cooldown_s),
            "max_s": float(cfg.breaker_max_cooldown_s),
        }
        try:
            async with self._pool.connection() as conn:
                written = await (await conn.execute(queries.RECORD_OUTCOMES, params)).fetchone()
        except Exception:
            log.warning("outbox batch write failed; writing its %d outcomes one by one", len(batch), exc_info=True)
            for outcome in batch:
                o = outcome
                closed = await self._finish(o.claim, o.sql, o.params, o.attempt, result=o.result, probe=o.probe)
                if not outcome.done.done():
                    outcome.done.set_result(closed)
            return
        recorded, closed = set(written["recorded"]), set(written["closed"])
        self.stats.counts["batches"] += 1
        for outcome in batch:
            c = outcome.claim
            if c.id in recorded:
                c.settle = _settle_after(outcome.sql, outcome.params)
                self._count(outcome.sql, outcome.attempt)
                pull_in = outcome.probe and c.endpoint_id in closed
            else:
                self.stats.counts["lease_lost"] += 1
                log.warning("outbox claim lost before the outcome was written: discarded delivery=%s", c.id)
                pull_in = False
            if not outcome.done.done():
                outcome.done.set_result(pull_in)

    def _count(self, sql: str, attempt: dict[str, Any] | None) -> None:
        if attempt is not None:
            DELIVERY_ATTEMPTS.labels(outcome=attempt["outcome"]).inc()
            self.stats.counts[attempt["outcome"]] += 1
        elif sql is queries.RECORD_FAILED:
            self.stats.counts["failed_without_attempt"] += 1

    async def _finish(
        self,
        c: _Claim,
        sql: str,
        params: dict[str, Any],
        attempt: dict[str, Any] | None,
        *,
        result: _Result | None = None,
        probe: bool = False,
    ) -> bool:
        """One claim's terminal/retry transaction (the writer's fallback); True when a probe closed the circuit.

        A write that matches no row (the claim was lost) rolls back and is discarded. Any
        other failure of the transaction drives the delivery to ``failed`` with the minimal
        ``FORCE_FAILED`` write (docs/reference/webhooks.md).
        """
        cfg = self.config
        closed_circuit = False
        try:
            # Pipelined: the statements go out together and their results come back together
            # (one round trip); a claim found lost afterwards rolls all of them back.
            async with self._pool.connection() as conn, conn.pipeline() as pipeline, conn.transaction():
                finish = await conn.execute(sql, {"id": c.id, "claim": c.claim, **params})
                if attempt is not None:
                    await conn.execute(queries.INSERT_ATTEMPT, attempt)
                reset = None
                if result is not None and result.status_code == 410:
                    reason = f"receiver answered 410 Gone to delivery {c.id}"
                    await conn.execute(queries.ENDPOINT_DISABLE, {"endpoint_id": c.endpoint_id, "reason": reason})
                elif result is not None and result.outcome in (SUCCEEDED, FAILED):
                    reset = await conn.execute(queries.ENDPOINT_SUCCEEDED, {"endpoint_id": c.endpoint_id})
                elif result is not None and result.outcome == RETRYABLE:
                    await conn.execute(
                        queries.ENDPOINT_FAILED,
                        {
                            "endpoint_id": c.endpoint_id,
                            "threshold": cfg.breaker_threshold,
                            "base_s": float(cfg.breaker_cooldown_s),
                            "max_s": float(cfg.breaker_max_cooldown_s),
                        },
                    )
                await pipeline.sync()
                if await finish.fetchone() is None:
                    raise _ClaimLost
                closed_circuit = probe and reset is not None and reset.rowcount > 0
        except _ClaimLost:
            self.stats.counts["lease_lost"] += 1
            log.warning("outbox claim lost before the outcome was written: discarded delivery=%s", c.id)
            return False
        except Exception as exc:
            log.exception("outbox terminal write failed delivery=%s claim=%s", c.id, c.claim)
            await self._force_failed(
                c, f"terminal write failed: {type(exc).__name__}: {exc}"[:1000], sent=attempt is not None
            )
            return False
        c.settle = _settle_after(sql, params)
        self._count(sql, attempt)
        return closed_circuit

    async def _force_failed(self, c: _Claim, error: str, *, sent: bool) -> None:
        """The minimal write to ``failed``; then, best effort, the evidence row of the attempt made."""
        try:
            async with self._pool.connection() as conn:
                cur = await conn.execute(queries.FORCE_FAILED, {"id": c.id, "claim": c.claim, "error": error})
                if cur.rowcount == 0:
                    return  # no longer ours: whoever holds it now records what happens
            c.settle = ("ack", 0.0)
            self.stats.counts["forced_failed"] += 1
        except Exception:
            # The lease will expire; the reaper re-queues the row (delivered at least once).
            log.exception("outbox minimal failed write also failed delivery=%s", c.id)
            return
        if not sent:
            return
        evidence = {
            "attempt_id": new_id("wha"),
            "delivery_id": c.id,
            "number": c.attempts,
            "outcome": FAILED,
            "status_code": None,
            "latency_ms": None,
            "error": f"the attempt's outcome could not be recorded ({error})"[:1000],
            "response_excerpt": "",
            "executor": self.executor_id,
        }
        try:
            async with self._pool.connection() as conn:
                await conn.execute(queries.INSERT_ATTEMPT, evidence)
        except Exception:
            log.warning("outbox could not record the failed attempt either delivery=%s", c.id, exc_info=True)

    async def _write_or_discard(self, c: _Claim, sql: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """Run one write predicated on the claim; its returned row, or None when the claim was no longer ours."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, {"id": c.id, "claim": c.claim, **params})
            return await cur.fetchone()

    async def _defer(self, c: _Claim) -> None:
        jitter_s = self._rng.uniform(0, max(0.0, self.config.breaker_cooldown_s) * 0.1)
        row = await self._write_or_discard(c, queries.DEFER, {"attempts": c.prev_attempts, "jitter_s": jitter_s})
        if row is not None:
            c.settle = ("nak", max(0.0, row["due_in_s"]))
            self.stats.counts["deferred"] += 1

    async def _take_probe(self, c: _Claim) -> bool:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                queries.TAKE_PROBE, {"endpoint_id": c.endpoint_id, "probe_s": float(self.config.lease_s)}
            )
            return cur.rowcount > 0

    async def _pull_in_deferred(self, c: _Claim) -> None:
        try:
            async with self._pool.connection() as conn:
                await conn.execute(queries.PULL_IN_DEFERRED, {"endpoint_id": c.endpoint_id})
            self._work_available.set()
        except Exception:
            log.exception("outbox could not pull in deferred deliveries endpoint=%s", c.endpoint_id)

    # -- leases ------------------------------------------------------------------------

    def _lose(self, c: _Claim, why: str) -> None:
        if c.lost:
            return
        c.lost = True
        log.warning("outbox lease lost delivery=%s claim=%s (%s)", c.id, c.claim, why)
        if c.send_task is not None and not c.send_task.done():
            c.send_task.cancel()

    async def _renew_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.renew_every_s)
            now = time.monotonic()
            for c in list(self._inflight.values()):
                if now > c.local_deadline:
                    self._lose(c, "lease not renewed in time on the executor's clock")
            held = [c for c in self._inflight.values() if not c.lost]
            if not held:
                continue
            sent_at = time.monotonic()
            try:
                async with self._pool.connection() as conn:
                    cur = await conn.execute(
                        queries.RENEW_CLAIMS, {"claims": [c.claim for c in held], "lease_s": float(cfg.lease_s)}
                    )
                    renewed = {row["claimed_by"] for row in await cur.fetchall()}
            except Exception:
                log.warning("outbox lease renewal failed executor=%s", self.executor_id, exc_info=True)
                continue
            for c in held:
                if c.claim in renewed:
                    c.local_deadline = sent_at + cfg.lease_s * LOCAL_LEASE_SHARE
                elif c.claim in self._inflight and c.send_task is not None and not c.send_task.done():
                    # Still sending but the row is no longer ours: expired or reclaimed.
                    self._lose(c, "lease expired or taken over")

    async def _reap_loop(self) -> None:
        while True:
            try:
                async with self._pool.connection() as conn:
                    reaped = await reap_expired_claims_async(conn, self.executor_id, limit=self.config.reap_batch)
                if reaped:
                    self.stats.counts["reaped"] += reaped
                    self._work_available.set()
            except Exception:
                log.warning("outbox reaper failed executor=%s", self.executor_id, exc_info=True)
            await asyncio.sleep(self.config.reap_every_s)

    async def _listen_loop(self) -> None:
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                async with conn:
                    await conn.execute("LISTEN outbox_delivery")
                    self._listening.set()
                    self._work_available.set()  # anything inserted while we were not listening
                    async for _ in conn.notifies():
                        self._work_available.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("outbox listener lost its connection; polling meanwhile", exc_info=True)
                await asyncio.sleep(max(1.0, self.config.poll_interval_s))

    async def _drain_inflight(self) -> None:
        """On stop: give requests in flight the grace period, then cancel and record them."""
        grace = self.config.shutdown_grace_s if self.config.shutdown_grace_s is not None else self.config.timeout_s
        tasks = [c.task for c in self._inflight.values() if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                for c in list(self._inflight.values()):
                    c.shutting_down = True
                    if c.send_task is not None and not c.send_task.done():
                        c.send_task.cancel()
                await asyncio.wait(pending, timeout=10)


def _settle_after(sql: str, params: dict[str, Any]) -> tuple[str, float]:
    """What to tell the stream once a finishing write ``sql`` was recorded: a retry comes back when due."""
    if sql is queries.RECORD_RETRY:
        return ("nak", float(params["delay_s"]))
    return ("ack", 0.0)


async def reap_expired_claims_async(conn: psycopg.AsyncConnection, reaper_id: str, *, limit: int = 500) -> int:
    """Re-queue deliveries whose lease expired and record each lost attempt; returns how many."""
    async with conn.transaction():
        rows = await (await conn.execute(queries.REAP_EXPIRED_CLAIMS, {"limit": limit})).fetchall()
        evidence = [
            lost_attempt_params(
                delivery_id=r["id"], lost_claim=r["lost_claim"], number=r["prev_attempts"], recorded_by=reaper_id
            )
            for r in rows
            if r["prev_attempts"] >= 1
        ]
        if evidence:
            async with conn.cursor() as cur:
                await cur.executemany(queries.INSERT_ATTEMPT, evidence)
    if evidence:
        DELIVERY_ATTEMPTS.labels(outcome=LEASE_LOST).inc(len(evidence))
    if rows:
        log.info("outbox reaper re-queued %d deliveries with expired leases reaper=%s", len(rows), reaper_id)
    return len(rows)


async def _configure_connection(conn: psycopg.AsyncConnection, *, synchronous_commit: bool = True) -> None:
    # UTC sessions; statements bounded so a stuck query cannot hold a worker forever.
    await conn.execute("SET TIME ZONE 'UTC'")
    if not synchronous_commit:
        # Our bookkeeping only: a lost tail of it after a server crash means deliveries sent again (at least once).
        await conn.execute("SET synchronous_commit = off")
    await conn.execute("SET statement_timeout = '15s'")
    await conn.execute("SET idle_in_transaction_session_timeout = '15s'")


async def _configure_pooled_connection(conn: psycopg.AsyncConnection) -> None:
    # Only the time zone, which PgBouncer carries from client to server connection itself; the pooler's
    # query_timeout and idle_transaction_timeout bound statements and idle transactions instead.
    await conn.execute("SET TIME ZONE 'UTC'")


def _transport_error(exc: Exception, cfg: ExecutorConfig) -> str:
    """The coarse error an attempt without an answer records (docs/decisions/0123-outbound-requests-policy.md).

    The socket or TLS detail would tell a tenant which ports are open; it goes to our log only.
    """
    kind = outbound.failure_class(exc)
    detail = exc.__cause__ or exc
    log.info("outbox request failed: %s (%s: %s)", kind, type(detail).__name__, detail)
    if kind == outbound.TIMEOUT:
        bound_s = cfg.connect_timeout_s if getattr(exc, "connecting", False) else cfg.timeout_s
        return f"timed out after {bound_s:g} s"
    return kind


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


__all__ = [
    "MAX_ATTEMPTS",
    "RETRYABLE_4XX",
    "RETRY_SCHEDULE_S",
    "Executor",
    "ExecutorConfig",
    "classify",
    "conninfo_from_django",
    "reap_expired_claims_async",
    "retry_delay_s",
]
