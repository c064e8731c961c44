"""API rate limits: a token bucket per API key and bucket name, kept in PostgreSQL.

Every authenticated /v1 request takes one token from its key's bucket before the view runs
(:meth:`hardcount.api.ApiView.initial`, after authentication, before the idempotency step). A
bucket holds at most ``burst`` tokens and refills at ``per_s`` tokens a second; with no token
left the request is answered 429 ``rate_limited`` (type ``rate_limit_error``) with
``Retry-After`` and nothing else is written. GET, HEAD and OPTIONS take from ``read``, other methods from
``write``, and the routes of ``HARDCOUNT_RATE_LIMIT_ROUTES`` from their own bucket
(``POST /v1/billing/run``: ``billing_run``). Limits are ``HARDCOUNT_RATE_LIMITS`` unless the
key's tenant has a :class:`~hardcount.models.RateLimit` row for the bucket.

One statement decides (:data:`TAKE`): an ``INSERT … ON CONFLICT DO UPDATE … RETURNING`` on the
key's row that refills it by the database time elapsed since its last request and takes a token
if there is one. The row lock serialises concurrent requests of one key, so every worker and
replica shares the same bucket: over any interval of ``t`` seconds a key gets at most
``burst + per_s * t`` requests through (docs/decisions/0128-api-rate-limits.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from django.conf import settings
from django.db import connection as default_connection
from rest_framework import status

from hardcount.errors import ApiError

RATE_LIMIT_ERROR = "rate_limit_error"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# The bucket refilled to the time of this request, capped at its size. clock_timestamp(), not now():
# now() is the transaction's start, which a statement that waited for the row lock (or ran inside a
# longer transaction) would see as earlier than the row's last update. GREATEST keeps time moving forward.
_REFILLED = (
    "LEAST(EXCLUDED.burst, b.tokens + EXCLUDED.per_s"
    " * GREATEST(0, EXTRACT(EPOCH FROM EXCLUDED.updated_at - b.updated_at)::float8))"
)

TAKE = f"""
WITH lim AS (
    SELECT COALESCE(o.per_s, %(per_s)s) AS per_s, COALESCE(o.burst, %(burst)s) AS burst
    FROM (SELECT 1) AS one
    LEFT JOIN hardcount_ratelimit AS o ON o.tenant_id = %(tenant_id)s AND o.bucket = %(bucket)s
)
INSERT INTO hardcount_ratelimitbucket AS b (id, api_key_id, bucket, per_s, burst, tokens, allowed, updated_at)
SELECT %(id)s, %(api_key_id)s, %(bucket)s, lim.per_s, lim.burst, lim.burst - 1, true, clock_timestamp() FROM lim
ON CONFLICT (id) DO UPDATE SET
    tokens = CASE WHEN {_REFILLED} >= 1 THEN {_REFILLED} - 1 ELSE {_REFILLED} END,
    allowed = {_REFILLED} >= 1,
    per_s = EXCLUDED.per_s,
    burst = EXCLUDED.burst,
    updated_at = GREATEST(b.updated_at, EXCLUDED.updated_at)
RETURNING allowed, tokens, per_s, burst
"""


@dataclass(frozen=True)
class Decision:
    """The outcome of one :func:`take`: ``tokens`` left after it, and the limits it was measured against."""

    bucket: str
    allowed: bool
    tokens: float
    per_s: float
    burst: float

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the bucket holds a token again (at least 1); 0 when allowed."""
        if self.allowed:
            return 0
        return max(1, math.ceil((1 - self.tokens) / self.per_s))


class RateLimited(ApiError):
    """429: the key's bucket is empty. ``retry_after_s`` goes into the ``Retry-After`` header."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    error_type = RATE_LIMIT_ERROR
    default_code = "rate_limited"
    default_detail = "Too many requests with this API key."

    def __init__(self, decision: Decision):
        self.retry_after_s = decision.retry_after_s
        super().__init__(
            f"Too many {decision.bucket.replace('_', ' ')} requests with this API key (at most "
            f"{decision.burst:g} at once, {decision.per_s:g} per second sustained). "
            f"Retry after {self.retry_after_s} s."
        )


def bucket_for(method: str, route: str | None) -> str:
    """The bucket a request takes from: its route's own (``"POST /v1/billing/run"``), else read or write."""
    own = settings.HARDCOUNT_RATE_LIMIT_ROUTES.get(f"{method} /{route}") if route is not None else None
    if own is not None:
        return own
    return "read" if method in READ_METHODS else "write"


def take(*, api_key_id: str, tenant_id: str, bucket: str, using=None) -> Decision:
    """Take one token from the bucket of ``api_key_id``; returns the :class:`Decision` (never raises for a limit).

    ``using`` is the database connection (default: this thread's). Limits are the tenant's
    :class:`~hardcount.models.RateLimit` for ``bucket`` or ``HARDCOUNT_RATE_LIMITS[bucket]``
    (a ``KeyError`` for an unknown bucket). The statement commits at once unless a transaction
    is open on ``using``, which would hold the key's row lock until it ends.
    """
    default = settings.HARDCOUNT_RATE_LIMITS[bucket]
    params = {
        "id": f"{api_key_id}:{bucket}",
        "api_key_id": api_key_id,
        "tenant_id": tenant_id,
        "bucket": bucket,
        "per_s": float(default["per_s"]),
        "burst": int(default["burst"]),
    }
    with (using or default_connection).cursor() as cursor:
        cursor.execute(TAKE, params)
        allowed, tokens, per_s, burst = cursor.fetchone()
    return Decision(bucket=bucket, allowed=allowed, tokens=tokens, per_s=per_s, burst=burst)


def check(request) -> None:
    """Take a token for an authenticated API request (a DRF request whose ``auth`` is the ApiKey row).

    Raises :class:`RateLimited` (429) when the key's bucket is empty; does nothing when
    ``HARDCOUNT_RATE_LIMIT`` is off or the request carries no key.
    """
    api_key = getattr(request, "auth", None)
    if not settings.HARDCOUNT_RATE_LIMIT or api_key is None:
        return
    match = getattr(request, "resolver_match", None)
    bucket = bucket_for(request.method, match.route if match is not None else None)
    decision = take(api_key_id=api_key.pk, tenant_id=api_key.tenant_id, bucket=bucket)
    if not decision.allowed:
        raise RateLimited(decision)


__all__ = ["RATE_LIMIT_ERROR", "TAKE", "Decision", "RateLimited", "bucket_for", "check", "take"]
