"""What the scheduler runtime, ``/health/ready`` and ``/metrics`` need from leader leases, as a protocol.

The kernel imports no app (docs/decisions/0121-kernel-ops-and-devstack.md): the runtime's
tickers take, heartbeat and release their leases through a :class:`LeaseStore`, which the
``leases`` app implements and registers from ``LeasesConfig.ready()`` with
:func:`register_lease_store` (``leases.leadership.DatabaseLeaseStore``). The lease rules —
timings, the heartbeat thread, fencing, the release on shutdown — are the store's
(docs/reference/roles-and-leases.md, docs/decisions/0020); the runtime only calls them.

A held lease is a :class:`HeldLease`: the :class:`~hardcount.fencing.Fence` a role's code
receives, plus what the ticker does with it (heartbeat, stamps, stop, close).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured

from hardcount.fencing import Fence


@dataclass(frozen=True)
class LeaseStatus:
    """One lease row as /health/ready and /metrics show it (times are the database's, ages in seconds)."""

    role: str
    holder: str | None
    token: int
    acquired_at: datetime | None
    heartbeat_at: datetime | None
    expires_at: datetime | None
    held: bool
    last_stamp_at: datetime | None
    last_stamp_holder: str
    last_tick_at: datetime | None
    stamp_age_s: float | None
    db_now: datetime


class HeldLease(Fence, Protocol):
    """A lease this process holds: a :class:`~hardcount.fencing.Fence` with its heartbeat and stamps.

    ``token`` is the fencing token of this tenure. ``lost`` turns True once the lease is known
    not to be ours; ``stop_requested`` once :meth:`request_stop` was called.
    """

    token: int

    @property
    def lost(self) -> bool: ...

    @property
    def stop_requested(self) -> bool: ...

    def start_heartbeat(self) -> None:
        """Start extending the lease in the background until :meth:`close`."""

    def request_stop(self) -> None:
        """Graceful stop: ``alive()`` turns False so the role stops at its next safe point."""

    def mark_lost(self) -> None:
        """Record that the lease is gone (a fenced write was refused)."""

    def stamp(self, *_args: object) -> bool:
        """Write the liveness stamp (arguments ignored: usable as a drain's ``on_page``); True when written."""

    def complete_tick(self) -> bool:
        """Stamp a completed tick; True when written."""

    def close(self, *, release_lease: bool = True) -> bool:
        """Stop the heartbeat and, with ``release_lease``, release the lease; True when it was released."""


class LeaseStore(Protocol):
    """Leader leases as the runtime, health and metrics use them."""

    def new_holder_id(self) -> str:
        """A holder id unique to one runtime (two runtimes compete like two replicas)."""

    def try_acquire(self, role: str, holder: str, *, clock: Callable[[], float]) -> HeldLease | None:
        """Take ``role`` for ``holder`` if it is free or expired; the held lease (heartbeat not started), or None.

        ``clock`` is the monotonic clock (seconds) the lease's abandon threshold is measured on.
        Raises ``django.db.DatabaseError`` when the database cannot answer.
        """

    def is_free(self, role: str, holder: str) -> bool:
        """Whether ``holder`` could take ``role`` now (never held, released, expired, or its own), read lock-free."""

    def seconds_until_due(self, role: str, interval_s: float) -> float:
        """Seconds until ``role``'s next tick (its last completed tick + ``interval_s``), at least 0."""

    def lease_statuses(self) -> list[LeaseStatus]:
        """Every lease row, ordered by role, read on the calling thread's connection."""


_lock = threading.Lock()
_store: LeaseStore | None = None


def register_lease_store(store: LeaseStore) -> None:
    """Make ``store`` the process's lease store (call from ``AppConfig.ready()``; a later call replaces it)."""
    global _store  # noqa: PLW0603 - one lease store per process, set by the app that owns the leases
    with _lock:
        _store = store


def lease_store() -> LeaseStore:
    """The registered :class:`LeaseStore`; ``ImproperlyConfigured`` when no app registered one."""
    store = _store
    if store is None:
        raise ImproperlyConfigured("no lease store is registered: is the 'leases' app in INSTALLED_APPS?")
    return store
