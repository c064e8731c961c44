"""The kernel's lease store, over ``leases_leaderlease``: what ``LeasesConfig.ready()`` registers.

The scheduler runtime, ``/health/ready`` and ``/metrics`` reach leases only through the
:class:`~hardcount.scheduler.leadership.LeaseStore` protocol (docs/decisions/0121); this is
its implementation. Each method calls the function of :mod:`leases.services` of the same
name when it is called, so the lease rules (timings, heartbeat thread, fencing, release) are
those of :mod:`leases.services` and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hardcount.scheduler.leadership import LeaseStatus
from leases import services
from leases.services import LeaseFence


class DatabaseLeaseStore:
    """Leader leases in PostgreSQL (:mod:`leases.services`, :mod:`leases.queries`)."""

    def new_holder_id(self) -> str:
        """``<hostname>:<pid>:<8 random hex>`` (:func:`leases.services.new_holder_id`)."""
        return services.new_holder_id()

    def try_acquire(self, role: str, holder: str, *, clock: Callable[[], float] = time.monotonic) -> LeaseFence | None:
        """The held :class:`~leases.services.LeaseFence`, or None (:func:`leases.services.try_acquire`)."""
        return services.try_acquire(role, holder, clock=clock)

    def is_free(self, role: str, holder: str) -> bool:
        """Whether ``holder`` could take ``role`` now, by the lock-free look of :func:`leases.services.peek`."""
        seen = services.peek(role)
        return seen is None or seen.free or seen.holder == holder

    def seconds_until_due(self, role: str, interval_s: float) -> float:
        """Seconds until the role's next tick, at least 0 (:func:`leases.services.seconds_until_due`)."""
        return services.seconds_until_due(role, interval_s)

    def lease_statuses(self) -> list[LeaseStatus]:
        """Every lease row, ordered by role (:func:`leases.services.lease_statuses`)."""
        return services.lease_statuses()
