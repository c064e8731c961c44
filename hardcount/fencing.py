"""Fencing: how a role's writes prove they are still made by the lease holder.

A role's code receives a :class:`Fence`. Inside every write transaction it calls
``fence.check()`` first; the check locks the lease row ``FOR KEY SHARE`` and requires the
holder and fencing token to still be ours and unexpired, or raises :class:`LeaseLost`,
rolling the transaction back. ``FOR KEY SHARE`` does not block the holder's own heartbeat
(a non-key ``UPDATE``), but it does block a new holder's takeover (which locks the row
``FOR UPDATE``) until the fenced transaction ends, and a takeover that commits first makes
the check fail: so no write of a deposed leader can commit after its successor took over.

Between transactions, ``fence.alive()`` is the cheap, database-free safe-point test: it
turns False once the last successful heartbeat is older than the abandon threshold (6 s)
on the holder's own monotonic clock.

The takeover's ``FOR UPDATE`` is explicit: an upsert alone would take only ``FOR NO KEY
UPDATE`` and not wait (docs/decisions/0020). The real fence is
:class:`leases.services.LeaseFence`; the statements are in :mod:`leases.queries`.
"""

from __future__ import annotations

from typing import Protocol


class LeaseLost(Exception):
    """The lease is no longer ours: the current transaction must not commit, the role must stop."""


class Fence(Protocol):
    """What a role's code needs from its lease."""

    token: int | None

    def check(self) -> None:
        """Inside an open transaction: lock-check the lease row; raise :class:`LeaseLost` if it is not ours."""

    def alive(self) -> bool:
        """No database access: False once the holder must stop at the next safe point."""


class NoFence:
    """The fence of work not done under a lease (API-triggered drains, tests): always passes."""

    token = None

    def check(self) -> None:
        return None

    def alive(self) -> bool:
        return True


NO_FENCE = NoFence()
