"""Leader-lease operations (docs/reference/roles-and-leases.md) and :class:`LeaseFence`, a held lease and its heartbeat.

The functions run one statement of :mod:`leases.queries` each on the calling thread's
Django connection. :func:`try_acquire` is what the scheduler calls (through
:class:`leases.leadership.DatabaseLeaseStore`, the kernel's lease store): it returns a
:class:`LeaseFence` — the lease, held — which the role's code receives as its
:class:`~hardcount.fencing.Fence`.

Timing (settings, seconds): ``HARDCOUNT_LEASE_TTL_S`` (10) is how long a lease lives
without a heartbeat; ``HARDCOUNT_LEASE_HEARTBEAT_S`` (3) how often the holder extends it;
``HARDCOUNT_LEASE_ABANDON_S`` (6) how old the last successful heartbeat may be, on the
holder's own monotonic clock, before it stops writing. Abandoning at 6 s, before the
database would let a successor in at 10 s, leaves a margin for clock rate differences and
for the in-flight work to reach its next safe point.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction

from hardcount.fencing import LeaseLost
from hardcount.logfmt import logfmt
from hardcount.scheduler.leadership import LeaseStatus
from leases import queries

logger = logging.getLogger("hardcount.leases")


def new_holder_id() -> str:
    """A holder id unique to this runtime: ``<hostname>:<pid>:<8 random hex>``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _one(sql: str, params: dict) -> tuple | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


def _rowcount(sql: str, params: dict) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


@dataclass(frozen=True)
class Peek:
    """What a follower sees of a role's lease without locking it."""

    holder: str | None
    token: int
    free: bool


def peek(role: str) -> Peek | None:
    """The role's holder and token, and whether the lease is free or expired; None if never held."""
    row = _one(queries.PEEK, {"role": role})
    return None if row is None else Peek(holder=row[0], token=row[1], free=row[2])


def acquire(role: str, holder: str, *, ttl_s: float) -> int | None:
    """Take ``role`` for ``holder`` for ``ttl_s`` seconds if it is free, expired or ours.

    Returns the fencing token (unchanged when the lease was ours and live, incremented
    for a new tenure), or None when another holder's lease is live. May wait for the
    previous holder's in-flight fenced transactions to end (see :data:`queries.ACQUIRE`).
    """
    with transaction.atomic():
        row = _one(queries.ACQUIRE, {"role": role, "holder": holder, "ttl_s": ttl_s})
    return None if row is None else row[0]


def heartbeat(role: str, holder: str, token: int, *, ttl_s: float) -> bool:
    """Extend the lease to now() + ``ttl_s``; False when it is no longer ours (lost for good).

    Runs under a 2 s statement timeout; a timeout or connection failure raises
    :class:`django.db.DatabaseError` (the beat failed, the lease may still be ours).
    """
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(queries.HEARTBEAT_TIMEOUT)
            cursor.execute(queries.HEARTBEAT, {"role": role, "holder": holder, "token": token, "ttl_s": ttl_s})
            return cursor.fetchone() is not None


def release(role: str, holder: str, token: int) -> bool:
    """Free the lease if holder and token are still ours; True when it was."""
    return _rowcount(queries.RELEASE, {"role": role, "holder": holder, "token": token}) == 1


def stamp(role: str, holder: str, token: int) -> bool:
    """Write the liveness stamp (now()) if the lease is still ours; True when written."""
    return _rowcount(queries.STAMP, {"role": role, "holder": holder, "token": token}) == 1


def complete_tick(role: str, holder: str, token: int) -> bool:
    """Stamp liveness and ``last_tick_at`` (the next tick is due an interval later); True when written."""
    return _rowcount(queries.COMPLETE_TICK, {"role": role, "holder": holder, "token": token}) == 1


def check_fence(role: str, holder: str, token: int, *, idle_timeout_s: float | None = None) -> None:
    """The database half of the fence, inside the caller's open transaction.

    Locks the lease row ``FOR KEY SHARE`` where holder and token are ours and the lease is
    unexpired, and bounds how long this transaction may sit idle (default
    ``HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S``). Raises :class:`LeaseLost` when the row is not
    ours (the caller's transaction must roll back, which raising out of ``atomic`` does),
    and ``RuntimeError`` outside ``transaction.atomic()``, where the lock would end at once.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("a fence check must run inside transaction.atomic(), where its lock lasts")
    if idle_timeout_s is None:
        idle_timeout_s = settings.HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S
    params = {
        "role": role,
        "holder": holder,
        "token": token,
        "idle_timeout_ms": str(max(1, round(idle_timeout_s * 1000))),
    }
    if _one(queries.CHECK_FENCE, params) is None:
        raise LeaseLost(f"lease {role!r} token {token} is no longer held by {holder}")


def seconds_until_due(role: str, interval_s: float) -> float:
    """Seconds until ``role``'s next tick: last completed tick + ``interval_s`` - now(), at least 0."""
    row = _one(queries.SECONDS_UNTIL_DUE, {"role": role, "interval_s": interval_s})
    return 0.0 if row is None else float(row[0])


def lease_statuses() -> list[LeaseStatus]:
    """Every lease row, ordered by role (the kernel's :class:`~hardcount.scheduler.leadership.LeaseStatus`)."""
    with connection.cursor() as cursor:
        cursor.execute(queries.STATUS)
        return [LeaseStatus(*row) for row in cursor.fetchall()]


class LeaseFence:
    """A lease this process holds: the real :class:`~hardcount.fencing.Fence`, plus its heartbeat.

    ``check()`` (inside a write transaction) raises :class:`LeaseLost` once the lease is
    lost or abandoned, and otherwise locks the lease row so the write commits only under
    our token (:func:`check_fence`). ``alive()`` is the database-free safe-point test: False
    once the heartbeat found the lease gone, once the last successful heartbeat is older
    than ``abandon_s`` on ``clock`` (monotonic seconds), or once a graceful stop was requested.
    A stop request makes ``alive()`` False but not ``check()``: work already past its safe
    point (a charge being recorded) still commits, and the role stops at the next one.

    The heartbeat runs on its own thread and database connection
    (:meth:`start_heartbeat`); :meth:`close` stops it and releases the lease.
    """

    def __init__(
        self,
        role: str,
        holder: str,
        token: int,
        *,
        ttl_s: float | None = None,
        heartbeat_s: float | None = None,
        abandon_s: float | None = None,
        idle_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        last_good_at: float | None = None,
    ) -> None:
        self.role = role
        self.holder = holder
        self.token = token
        self.ttl_s = settings.HARDCOUNT_LEASE_TTL_S if ttl_s is None else ttl_s
        self.heartbeat_s = settings.HARDCOUNT_LEASE_HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.abandon_s = settings.HARDCOUNT_LEASE_ABANDON_S if abandon_s is None else abandon_s
        self.idle_timeout_s = settings.HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
        self._clock = clock
        # Measured from *before* the statement that took or extended the lease was sent: the
        # database's expiry is at least that late, so abandoning on this clock is conservative.
        self._last_good_at = clock() if last_good_at is None else last_good_at
        self._lost = False
        self._stop_requested = False
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<LeaseFence {self.role} token={self.token} holder={self.holder}>"

    # -- the Fence protocol ---------------------------------------------------------------

    def check(self) -> None:
        """Inside a write transaction: raise :class:`LeaseLost` unless the lease is still ours (locks its row)."""
        if self._lost or self.heartbeat_age_s() >= self.abandon_s:
            raise LeaseLost(f"lease {self.role!r} token {self.token} abandoned by {self.holder}")
        check_fence(self.role, self.holder, self.token, idle_timeout_s=self.idle_timeout_s)

    def alive(self) -> bool:
        """False once the role must stop at its next safe point (lost, abandoned or stopping)."""
        return not (self._stop_requested or self._lost or self.heartbeat_age_s() >= self.abandon_s)

    # -- state ----------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        """True once the lease is known not to be ours any more (heartbeat refused, or abandoned)."""
        return self._lost or self.heartbeat_age_s() >= self.abandon_s

    @property
    def stop_requested(self) -> bool:
        """True once :meth:`request_stop` was called."""
        return self._stop_requested

    def heartbeat_age_s(self) -> float:
        """Seconds on the monotonic clock since the last successful heartbeat (or the acquire)."""
        return self._clock() - self._last_good_at

    def request_stop(self) -> None:
        """Graceful stop: ``alive()`` turns False so the role stops at its next safe point."""
        self._stop_requested = True

    def mark_lost(self) -> None:
        """Record that the lease is gone (e.g. a fenced write was refused); ``alive()`` turns False."""
        self._lost = True

    # -- writes under the lease -----------------------------------------------------------

    def stamp(self, *_args: object) -> bool:
        """The liveness stamp; accepts and ignores arguments so it can be a drain's ``on_page``.

        True when written; False (and nothing written) once the lease is not ours.
        """
        if self.lost:
            return False
        return stamp(self.role, self.holder, self.token)

    def complete_tick(self) -> bool:
        """Stamp a completed tick (liveness and ``last_tick_at``); True when written."""
        if self.lost:
            return False
        return complete_tick(self.role, self.holder, self.token)

    # -- heartbeat ------------------------------------------------------------------------

    def heartbeat_once(self) -> bool:
        """One heartbeat on this thread's connection; True when extended.

        False marks the lease lost (it is not ours any more). A database error (timeout,
        lost connection) is logged and leaves the lease as it was: the next beat retries, and
        the abandon threshold decides if they keep failing.
        """
        if self._lost:
            return False
        started = self._clock()
        try:
            extended = heartbeat(self.role, self.holder, self.token, ttl_s=self.ttl_s)
        except DatabaseError as exc:
            logger.warning(
                logfmt(
                    "heartbeat_failed",
                    role=self.role,
                    token=self.token,
                    error=type(exc).__name__,
                    age_s=self.heartbeat_age_s(),
                )
            )
            connection.close()  # reconnect on the next beat
            return False
        if extended:
            self._last_good_at = started
            return True
        self._lost = True
        logger.warning(logfmt("lease_lost", role=self.role, token=self.token, reason="heartbeat_refused"))
        return False

    def start_heartbeat(self) -> None:
        """Start the heartbeat thread (every ``heartbeat_s``; failed beats retried after 1 s at most)."""
        if self._heartbeat_thread is not None:
            return
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"lease-heartbeat-{self.role}", daemon=True
        )
        self._heartbeat_thread.start()

    def _heartbeat_loop(self) -> None:
        wait_s = self.heartbeat_s
        try:
            while not self._heartbeat_stop.wait(wait_s):
                connection.close_if_unusable_or_obsolete()
                if self.heartbeat_once():
                    wait_s = self.heartbeat_s
                elif self._lost:
                    return
                else:
                    wait_s = min(1.0, self.heartbeat_s)
        finally:
            connections.close_all()

    def stop_heartbeat(self, timeout_s: float = 5.0) -> None:
        """Stop the heartbeat thread and wait for it (up to ``timeout_s``: a beat may be in flight)."""
        self._heartbeat_stop.set()
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def close(self, *, release_lease: bool = True) -> bool:
        """Stop heartbeating and, with ``release_lease``, release the lease; True when it was released.

        Safe to call when the lease is already lost: the release is fenced and changes nothing.
        """
        self.request_stop()
        self.stop_heartbeat()
        if not release_lease:
            return False
        try:
            released = release(self.role, self.holder, self.token)
        except DatabaseError as exc:
            logger.warning(logfmt("release_failed", role=self.role, token=self.token, error=type(exc).__name__))
            connection.close()
            return False
        self._lost = True
        return released


def try_acquire(role: str, holder: str, *, clock: Callable[[], float] = time.monotonic) -> LeaseFence | None:
    """Take ``role`` for ``holder`` if free or expired (settings' TTL); the held :class:`LeaseFence`, or None.

    Looks first without locking (:func:`peek`), so a follower polling a held role costs one
    read. Does not start the heartbeat: call :meth:`LeaseFence.start_heartbeat`.
    """
    seen = peek(role)
    if seen is not None and not seen.free and seen.holder != holder:
        return None
    started = clock()
    token = acquire(role, holder, ttl_s=settings.HARDCOUNT_LEASE_TTL_S)
    if token is None:
        return None
    return LeaseFence(role, holder, token, clock=clock, last_good_at=started)
