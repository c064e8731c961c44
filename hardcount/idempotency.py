"""``Idempotency-Key`` on POST: replay the first response, refuse a different body (SPEC §7).

Insert-first, as Stripe does (decision 0002). Before the view runs, one statement claims
the key for (tenant, mode, key) by inserting an in-flight record; the record is committed
at once, so a concurrent request with the same key finds it and gets 409
``idempotency_key_in_use`` instead of executing too. When the view has answered, the
response (status + body) is stored on the record; a later request with the same key and
the same fingerprint replays it verbatim (header ``Idempotent-Replayed: true``), one with
another fingerprint gets 422 ``idempotency_key_reused``.

Responses with a status of 500 or more, and unexpected exceptions, delete the in-flight
record, so the client may safely retry. An in-flight record older than
:data:`IN_FLIGHT_STALE` (its request died mid-way) and any record older than
:data:`KEY_RETENTION` may be claimed again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection

from hardcount.errors import Conflict, InvalidParameters
from hardcount.models import IdempotencyRecord

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
# How long a key is remembered (Stripe keeps keys for 24 hours).
KEY_RETENTION = timedelta(hours=24)
# An in-flight record this old belongs to a request that died; its key may be claimed again.
IN_FLIGHT_STALE = timedelta(minutes=5)

_TABLE = IdempotencyRecord._meta.db_table

# claim_key: insert an in-flight record for (tenant, mode, key), or take over the existing
# one when it has expired (older than the retention) or its request died (in flight for
# longer than the stale threshold). The unique constraint on (tenant_id, livemode, key)
# makes two concurrent claims of one key serialise: exactly one of them gets a row back.
_CLAIM_SQL = f"""
INSERT INTO {_TABLE} AS r
    (tenant_id, livemode, key, request_fingerprint, response_status, response_body, created_at, completed_at)
VALUES (%(tenant)s, %(livemode)s, %(key)s, %(fingerprint)s, NULL, NULL, now(), NULL)
ON CONFLICT (tenant_id, livemode, key) DO UPDATE
    SET request_fingerprint = EXCLUDED.request_fingerprint,
        response_status = NULL, response_body = NULL, created_at = now(), completed_at = NULL
    WHERE r.created_at < now() - %(retention)s
       OR (r.completed_at IS NULL AND r.created_at < now() - %(stale)s
           AND r.request_fingerprint = EXCLUDED.request_fingerprint)
RETURNING r.id
"""


@dataclass
class Claim:
    """An in-flight record this request owns: the view runs, then :func:`complete` or :func:`abandon`."""

    record_id: int


@dataclass
class Replay:
    """A completed record to answer with instead of running the view: the status and the exact body bytes."""

    status: int
    content: bytes


def validate_key(raw: str | None) -> str | None:
    """The header's value, or None when absent. Raises 422 for an empty, overlong or non-printable key."""
    if raw is None:
        return None
    if not raw or len(raw) > MAX_KEY_LENGTH or not raw.isprintable() or not raw.isascii():
        raise InvalidParameters(
            f"{HEADER} must be 1 to {MAX_KEY_LENGTH} printable ASCII characters.",
            code="idempotency_key_invalid",
            param=HEADER,
        )
    return raw


def fingerprint(method: str, path: str, body: bytes) -> str:
    """SHA-256 of the method, path and body; a JSON body is canonicalised (key order, spacing)."""
    try:
        canonical = json.dumps(json.loads(body or b"{}"), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        canonical = body
    digest = hashlib.sha256()
    for part in (method.encode(), b"\n", path.encode("utf-8", "backslashreplace"), b"\n", canonical):
        digest.update(part)
    return digest.hexdigest()


def begin(*, tenant_id: str, livemode: bool, key: str, request_fingerprint: str) -> Claim | Replay:
    """Claim ``key`` for this request, or return the stored response to replay.

    Raises :class:`~hardcount.errors.InvalidParameters` (422) when the key was used with
    another request, :class:`~hardcount.errors.Conflict` (409) while the first request
    with the key is still executing. Runs in autocommit: the claim is visible at once.
    """
    params = {
        "tenant": tenant_id,
        "livemode": livemode,
        "key": key,
        "fingerprint": request_fingerprint,
        "retention": KEY_RETENTION,
        "stale": IN_FLIGHT_STALE,
    }
    with connection.cursor() as cursor:
        cursor.execute(_CLAIM_SQL, params)
        row = cursor.fetchone()
    if row is not None:
        return Claim(record_id=row[0])
    existing = IdempotencyRecord.objects.filter(tenant_id=tenant_id, livemode=livemode, key=key).first()
    if existing is None:
        # Deleted by its abandoning request between our insert attempt and this read: try once more.
        return begin(tenant_id=tenant_id, livemode=livemode, key=key, request_fingerprint=request_fingerprint)
    if existing.request_fingerprint != request_fingerprint:
        raise InvalidParameters(
            "This Idempotency-Key was already used with a different request (method, path or body). "
            "Use a new key for a new request.",
            code="idempotency_key_reused",
            param=HEADER,
        )
    if existing.completed_at is None:
        raise Conflict(
            "A request with this Idempotency-Key is still being processed. Retry after it completes.",
            code="idempotency_key_in_use",
            param=HEADER,
        )
    return Replay(status=existing.response_status, content=existing.response_body.encode())


def complete(claim: Claim, *, status: int, content: bytes) -> None:
    """Store the response of the claimed request (or drop the claim when ``status`` >= 500).

    ``content`` is the rendered body; it is kept as one JSON string so a replay is byte-identical
    (a ``jsonb`` object would not keep key order).
    """
    if status >= 500:
        abandon(claim)
        return
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {_TABLE} SET response_status = %s, response_body = %s, completed_at = now() WHERE id = %s",
            [status, json.dumps(content.decode()), claim.record_id],
        )


def abandon(claim: Claim) -> None:
    """Delete the claimed in-flight record so a retry with the same key executes afresh."""
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {_TABLE} WHERE id = %s AND completed_at IS NULL", [claim.record_id])
