"""The drain's gateway calls: many in flight at once, on threads that hold no database connection.

A charge spends its time waiting on the gateway (a few hundred milliseconds at Stripe), a close's
database steps a millisecond or two. The drain (:mod:`billing.services.drain`) therefore runs the
steps that write on its own connection and a few close threads, and hands each step 2
(:class:`billing.services.payments.GatewayCall`, bound to its account on the caller's connection) to
a :class:`ChargePool`: up to ``HARDCOUNT_BILLING_CHARGES_IN_FLIGHT`` sender threads that only wait on
sockets. A sender never opens a database connection; one that does is counted
(:attr:`ChargePool.connections_opened`) and its connection closed, so a test sees it.

Each gateway account's calls are bounded by that account's rate limit
(:func:`billing.gateway_accounts.requests_per_s`): a token bucket per account, in requests per
second (a call costs the requests it will make, :attr:`~billing.services.payments.GatewayCall.requests`),
holding at most one second of requests. A call whose account has no tokens waits in its
account's queue while other accounts' calls go ahead, so one tenant's limit never slows another's
charges. The buckets are per process (:data:`ACCOUNT_LIMITS`), shared by every drain in it.
docs/decisions/0186-charges-in-flight-without-connections.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connections

from billing.gateway_accounts import requests_per_s

log = logging.getLogger("billing.charge_pool")


@dataclass
class _Bucket:
    rate: float  # requests per second; 0: unbounded
    tokens: float
    at: float


class AccountLimits:
    """Token buckets of requests per second, one per gateway account; ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, account: str, rate: float, cost: int) -> float:
        """Take ``cost`` requests of ``account``'s bucket (``rate`` per second, 0 unbounded); 0.0 when taken,
        else the seconds until they can be (nothing is taken then). A call dearer than the bucket holds
        waits for a full bucket and leaves it in debt."""
        if rate <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get(account)
            if bucket is None or bucket.rate != rate:
                bucket = self._buckets[account] = _Bucket(rate, rate, now)
            bucket.tokens = min(rate, bucket.tokens + (now - bucket.at) * rate)
            bucket.at = now
            need = min(cost, rate)
            if bucket.tokens >= need:
                bucket.tokens -= cost
                return 0.0
            return (need - bucket.tokens) / rate

    def clear(self) -> None:
        """Forget every bucket (tests)."""
        with self._lock:
            self._buckets.clear()


ACCOUNT_LIMITS = AccountLimits()


class Pending:
    """A call handed to the pool: :meth:`result` waits for its value (or the exception it raised)."""

    def __init__(self):
        self._done = threading.Event()
        self._value: object = None

    def set_result(self, value: object) -> None:
        """Hand the call's value (or the exception it raised) to whoever waits on :meth:`result`."""
        self._value = value
        self._done.set()

    def result(self) -> object:
        """The call's return value, or the exception (any ``BaseException``) it raised, returned not raised."""
        self._done.wait()
        return self._value


@dataclass
class _Job:
    fn: Callable[[], object]
    cost: int
    rate: float
    pending: Pending


class ChargePool:
    """Up to ``size`` sender threads running calls with no database connection, bounded per gateway account.

    ``submit(fn, account=…, livemode=…, requests=…)`` queues ``fn`` (no arguments; it must not touch
    the database) under ``account``'s rate limit and returns a :class:`Pending`. Calls of one account
    start in submission order. Threads start on demand and end at :meth:`shutdown`, which lets the
    calls already queued finish.
    """

    def __init__(self, size: int, *, limits: AccountLimits = ACCOUNT_LIMITS):
        self.size = max(1, size)
        self.limits = limits
        self.connections_opened = 0
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._queued = 0
        self._busy = 0
        self._stopping = False

    def submit(self, fn: Callable[[], object], *, account: str, livemode: bool, requests: int = 1) -> Pending:
        """Queue ``fn`` for ``account`` (it costs ``requests`` of the account's limit in ``livemode``)."""
        job = _Job(fn, max(1, requests), requests_per_s(livemode), Pending())
        with self._cond:
            self._queues.setdefault(account, deque()).append(job)
            self._queued += 1
            if self._busy + self._queued > len(self._threads) and len(self._threads) < self.size:
                thread = threading.Thread(target=self._worker, name=f"billing-charge-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        return job.pending

    def _next(self) -> tuple[_Job | None, float | None]:
        """The first account's next call that its bucket allows (that account moves to the back), or the
        shortest wait; called under the condition's lock."""
        wait = None
        for account, jobs in list(self._queues.items()):
            job = jobs[0]
            delay = self.limits.take(account, job.rate, job.cost)
            if delay:
                wait = delay if wait is None else min(wait, delay)
                continue
            jobs.popleft()
            if jobs:
                self._queues.move_to_end(account)
            else:
                del self._queues[account]
            self._queued -= 1
            return job, None
        return None, wait

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    job, wait = self._next()
                    if job is not None or (self._stopping and not self._queued):
                        break
                    self._cond.wait(wait)
                if job is None:
                    return
                self._busy += 1
            try:
                job.pending.set_result(job.fn())
            except BaseException as exc:  # handed to the caller, which decides
                job.pending.set_result(exc)
            finally:
                with self._cond:
                    self._busy -= 1
                self._no_connection()

    def _no_connection(self) -> None:
        opened = [c for c in connections.all(initialized_only=True) if c.connection is not None]
        if opened:
            with self._cond:
                self.connections_opened += 1
            log.warning("a gateway call opened a database connection on a sender thread; closed")
            connections.close_all()

    def shutdown(self) -> None:
        """Let the queued calls finish, then end the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
