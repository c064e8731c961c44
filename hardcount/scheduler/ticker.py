"""One role's ticker thread: follow until the lease is free, then lead — tick every interval while it holds.

A follower looks at the lease every ``HARDCOUNT_LEASE_POLL_S`` (0.5 s, jittered) with a
lock-free read and tries to take it when free or expired. A leader heartbeats from a
separate thread (see :class:`~hardcount.scheduler.leadership.HeldLease`; the ``leases`` app's
store implements it) and ticks when the role is due:
the last completed tick (in the database) plus the role's interval, so a new leader keeps
its predecessor's cadence and resumes an interrupted tick at once. Between ticks it waits
in short, interruptible steps, re-checking ``alive()``; when the lease is lost, abandoned
or a stop is requested, it steps down and releases the lease.

Roles of one **family** (``role.family``, e.g. the billing shards ``billing:0`` …) spread over
the replicas: a ticker whose runtime already leads ``k`` roles of its family takes a free lease
only once it has seen it free for ``k × HARDCOUNT_LEASE_SPREAD_S``, so a replica leading fewer
takes it first; alone, a replica still takes them all, one after the other.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.db import DatabaseError, connection, connections

from hardcount.fencing import LeaseLost
from hardcount.logfmt import logfmt
from hardcount.logs import bound
from hardcount.scheduler.leadership import HeldLease, lease_store
from hardcount.scheduler.registry import Role, TickContext, TickFailed

logger = logging.getLogger("hardcount.scheduler")

# Longest uninterrupted wait of a leader between ticks: how quickly it notices a lost lease.
_LEADER_WAIT_STEP_S = 0.25
# A follower's wait after a database error (instead of the poll interval), so an outage is not a log flood.
_ERROR_BACKOFF_S = 2.0
# After a failed tick the next one comes after this long, or the interval if shorter: a database
# blip must not postpone an hourly billing tick by an hour.
FAILED_TICK_RETRY_S = 30.0


class Family:
    """The tickers of one runtime whose roles share a family: how many of the family's leases the runtime leads.

    ``lock`` is held from a sibling's count to its acquisition, so tickers started together
    cannot all count zero and take every lease of the family at once.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.tickers: list[Ticker] = []

    def led_by_siblings(self, ticker: Ticker) -> int:
        """How many of the family's leases the runtime's other tickers hold now."""
        return sum(1 for sibling in self.tickers if sibling is not ticker and sibling._lease is not None)


class Ticker:
    """The ticker thread of ``role`` in this replica, holding leases as ``holder``.

    ``family``: the runtime's tickers of the same role family (see the module's docstring), or None.
    """

    def __init__(
        self,
        role: Role,
        holder: str,
        *,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        family: Family | None = None,
    ) -> None:
        self.role = role
        self.holder = holder
        self.poll_s = settings.HARDCOUNT_LEASE_POLL_S if poll_s is None else poll_s
        self.family = family
        if family is not None:
            family.tickers.append(self)
        self._free_since: float | None = None
        self._clock = clock
        self._stop = threading.Event()
        self._lease: HeldLease | None = None
        self._lease_lock = threading.Lock()
        self.ticks_completed = 0
        self.thread = threading.Thread(target=self._run, name=f"scheduler-{role.name}", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop: a running tick stops at its next safe point, then the lease is released."""
        self._stop.set()
        with self._lease_lock:
            if self._lease is not None:
                self._lease.request_stop()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; True when it has."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    @property
    def is_leader(self) -> bool:
        """True while this ticker holds its role's lease and may write under it."""
        lease = self._lease
        return lease is not None and lease.alive()

    @property
    def token(self) -> int | None:
        """The fencing token of the lease held now, or None."""
        lease = self._lease
        return None if lease is None else lease.token

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        name = self.role.name
        logger.info(logfmt("ticker_started", role=name, holder=self.holder, interval_s=self.role.interval_s))
        try:
            while not self._stop.is_set():
                connection.close_if_unusable_or_obsolete()
                try:
                    lease = self._try_acquire()
                except DatabaseError as exc:
                    logger.warning(logfmt("acquire_failed", role=name, error=type(exc).__name__, detail=str(exc)[:200]))
                    connection.close()
                    self._stop.wait(max(self.poll_s, _ERROR_BACKOFF_S))
                    continue
                if lease is None:
                    # Jitter keeps replicas started together from polling in lockstep.
                    self._stop.wait(self.poll_s * random.uniform(0.8, 1.2))
                    continue
                self._lead(lease)
        finally:
            connections.close_all()
            logger.info(logfmt("ticker_stopped", role=name, holder=self.holder))

    def _try_acquire(self) -> HeldLease | None:
        """The role's lease if it is free (deferring to replicas that lead fewer of the family), or None."""
        store = lease_store()
        if self.family is None:
            return store.try_acquire(self.role.name, self.holder, clock=self._clock)
        with self.family.lock:
            led = self.family.led_by_siblings(self)
            if led:
                if not store.is_free(self.role.name, self.holder):
                    self._free_since = None
                    return None
                now = self._clock()
                if self._free_since is None:
                    self._free_since = now
                if now - self._free_since < led * settings.HARDCOUNT_LEASE_SPREAD_S:
                    return None
            lease = store.try_acquire(self.role.name, self.holder, clock=self._clock)
            self._free_since = None
            if lease is not None:
                with self._lease_lock:
                    self._lease = lease  # counted by the siblings from now on
            return lease

    def _lead(self, lease: HeldLease) -> None:
        name = self.role.name
        with self._lease_lock:
            self._lease = lease
            if self._stop.is_set():
                lease.request_stop()
        lease.start_heartbeat()
        logger.info(logfmt("lease_acquired", role=name, token=lease.token, holder=self.holder))
        try:
            deadline = self._clock() + lease_store().seconds_until_due(name, self.role.interval_s)
            while lease.alive():
                remaining = deadline - self._clock()
                if remaining > 0:
                    self._stop.wait(min(remaining, _LEADER_WAIT_STEP_S))
                    continue
                with bound(role=name):
                    succeeded = self._tick(lease)
                wait_s = self.role.interval_s if succeeded else min(self.role.interval_s, FAILED_TICK_RETRY_S)
                deadline = self._clock() + wait_s
        except DatabaseError as exc:
            logger.warning(logfmt("leader_db_error", role=name, token=lease.token, error=type(exc).__name__))
            connection.close()
        finally:
            with self._lease_lock:
                self._lease = None
            reason = "stop" if lease.stop_requested else ("lost" if lease.lost else "error")
            released = lease.close(release_lease=True)
            logger.info(logfmt("lease_released", role=name, token=lease.token, released=released, reason=reason))

    def _tick(self, lease: HeldLease) -> bool:
        """Run one tick; False when it failed (retried sooner than the interval)."""
        name = self.role.name
        ctx = TickContext(role=name, holder=self.holder, token=lease.token, fence=lease, stamp=lease.stamp)
        started = self._clock()
        # One INFO line per tick (its end); the start is a detail.
        logger.debug(logfmt("tick_started", role=name, token=lease.token))
        try:
            counts = self.role.tick(ctx) or {}
        except LeaseLost as exc:
            duration_s = self._clock() - started
            if lease.stop_requested and not lease.lost:
                # The role stopped at a safe point because we asked it to: the lease is still ours to release.
                logger.info(logfmt("tick_interrupted", role=name, token=lease.token, duration_s=duration_s))
                return True
            lease.mark_lost()
            logger.warning(
                logfmt("lease_lost", role=name, token=lease.token, reason="fence_refused", detail=str(exc)[:200])
            )
            return True
        except TickFailed as exc:
            logger.warning(
                logfmt("tick_failed", role=name, token=lease.token, duration_s=self._clock() - started, error=str(exc))
            )
            connection.close_if_unusable_or_obsolete()
            return False
        except Exception:
            logger.exception(logfmt("tick_failed", role=name, token=lease.token, duration_s=self._clock() - started))
            connection.close_if_unusable_or_obsolete()
            return False
        duration_s = self._clock() - started
        if not lease.alive():
            # Cut short at a safe point (stop or lost lease): not recorded as completed, so the
            # next leader ticks at once instead of an interval later.
            logger.info(logfmt("tick_interrupted", role=name, token=lease.token, duration_s=duration_s, **counts))
            return True
        recorded = lease.complete_tick()
        self.ticks_completed += 1
        logger.info(
            logfmt("tick_completed", role=name, token=lease.token, duration_s=duration_s, recorded=recorded, **counts)
        )
        return True
