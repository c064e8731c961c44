"""Billing shards: the scheduler's billing work of a mode split into ``HARDCOUNT_BILLING_SHARDS`` parts by tenant.

A tenant's shard is ``shard_of(tenant_id, count)``: the first four bytes of the SHA-256 of its id
(UTF-8), read as an unsigned big-endian integer, modulo ``count``. It depends on nothing but the id
and the count, so every replica, the database (:data:`SHARD_OF_SQL`, the same function in SQL) and
the doctor agree on it without any stored assignment. Each shard is drained under a leader lease of
its own (:func:`lease_role`): ``billing`` when there is one shard (as before shards existed),
``billing:0`` … ``billing:{count-1}`` otherwise (docs/decisions/0194-billing-shards.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# The lease role of the single billing shard, and the family name of the sharded ones (``billing:<index>``).
FAMILY = "billing"

# SHARD_OF_SQL: :func:`shard_of` in SQL over the column named by ``{column}``; ``%s`` is the shard count (``%%`` is
# the modulo, written for a statement with parameters). sha256() is PostgreSQL's own (11+); a bit(32) cast to bigint
# reads the four bytes unsigned.
SHARD_OF_SQL = (
    "((('x' || encode(substring(sha256(convert_to({column}, 'UTF8')) FROM 1 FOR 4), 'hex'))::bit(32)::bigint) %% %s)"
)


def configured_count() -> int:
    """``settings.HARDCOUNT_BILLING_SHARDS`` (default 1); ``ImproperlyConfigured`` unless it is an integer ≥ 1."""
    count = getattr(settings, "HARDCOUNT_BILLING_SHARDS", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ImproperlyConfigured(f"HARDCOUNT_BILLING_SHARDS must be an integer of at least 1, got {count!r}")
    return count


def shard_of(tenant_id: str, count: int) -> int:
    """The shard (``0 … count-1``) of the tenant ``tenant_id`` among ``count``; ``ValueError`` when ``count`` < 1."""
    if count < 1:
        raise ValueError(f"a shard count is at least 1, got {count}")
    return int.from_bytes(hashlib.sha256(tenant_id.encode()).digest()[:4], "big") % count


def lease_role(index: int, count: int) -> str:
    """The lease role of shard ``index`` of ``count``: ``billing`` for a single shard, else ``billing:<index>``."""
    return FAMILY if count == 1 else f"{FAMILY}:{index}"


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the tenants whose :func:`shard_of` is ``index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} is not one of 0..{self.count - 1}")

    @property
    def lease_role(self) -> str:
        """The leader lease this shard is drained under (:func:`lease_role`)."""
        return lease_role(self.index, self.count)

    @property
    def runs_singletons(self) -> bool:
        """Whether this shard's tick also runs billing's unsharded steps (the reconcilers, resumes): shard 0."""
        return self.index == 0

    def holds(self, tenant_id: str) -> bool:
        """Whether the tenant belongs to this shard."""
        return shard_of(tenant_id, self.count) == self.index

    def predicate(self, column: str) -> tuple[str, list[object]]:
        """The SQL condition "the tenant in ``column`` belongs to this shard" and its parameters; ``("", [])`` for a
        single shard (every tenant), so one shard's statements are those of an unsharded drain."""
        if self.count == 1:
            return "", []
        return f"{SHARD_OF_SQL.format(column=column)} = %s", [self.count, self.index]


def parse_lease_role(role: str) -> int | None:
    """The shard index of a billing lease role (``billing`` → 0, ``billing:3`` → 3); None for any other role."""
    if role == FAMILY:
        return 0
    family, _, index = role.partition(":")
    return int(index) if family == FAMILY and index.isdigit() else None


__all__ = ["FAMILY", "SHARD_OF_SQL", "Shard", "configured_count", "lease_role", "parse_lease_role", "shard_of"]
