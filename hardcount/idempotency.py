"""``Idempotency-Key`` on POST: replay the first response, refuse a different body (docs/reference/api.md).

Insert-first, as Stripe does (decision 0002). Before the view runs, one statement claims
the key for (tenant, mode, key) by inserting an in-flight record; the record is committed
at once, so a concurrent request with the same key finds it and gets 409
``idempotency_key_in_use`` instead of executing too. When the view has answered, the
response (status + body) is stored on the record; a later request with the same key and
the same fingerprint replays it verbatim (header ``Idempotent-Replayed: true``), one with
another fingerprint gets 422 ``idempotency_key_reused``.

Responses with a status of 500 or more, and unexpected exceptions, delete the in-flight
record, so the client may safely retry. An in-flight record older than
:data:`IN_FLIGHT_STALE` (its request died mid-way) and any record older than the retention
(:func:`key_retention`, ``HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS``, at least 24 hours) may
be claimed again; every claim, a takeover included, gets a fresh record id, so a request
that outlived its claim can no longer store or drop the record of the request that took it
over. :func:`prune_expired` deletes records past the retention (the
``idempotency_maintenance`` role, :mod:`hardcount.loops`; docs/decisions/0023).

A record never holds a secret in clear (docs/decisions/0125): a view names the response fields
that carry one (``ApiView.response_secrets``: a webhook endpoint's signing secret), the stored
body has :data:`SECRET_MARKER` in their place (:func:`redact_secrets`), and a replay reads each
one again from where it lives (:func:`restore_secrets`), so the client still gets the first
response byte for byte. :func:`display_body` is a stored body as the admin shows it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from rest_framework.renderers import JSONRenderer

from hardcount.errors import Conflict, InvalidParameters
from hardcount.fencing import NO_FENCE, Fence
from hardcount.models import IdempotencyRecord

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
# An in-flight record this old belongs to a request that died; its key may be claimed again.
IN_FLIGHT_STALE = timedelta(minutes=5)

# What a stored body holds in place of a secret field; a replay puts the secret back.
SECRET_MARKER = "[secret: not stored]"  # noqa: S105 (a placeholder, not a secret)

# Where a replay reads a secret field again: ``source(tenant_id, livemode, stored_body)``, the body
# being the stored JSON object (its ``id`` names the object the secret belongs to). None: it is gone.
SecretSource = Callable[[str, bool, Mapping[str, Any]], str | None]

_TABLE = IdempotencyRecord._meta.db_table

# claim_key: insert an in-flight record for (tenant, mode, key), or take over the existing
# one when it has expired (older than the retention) or its request died (in flight for
# longer than the stale threshold). The unique constraint on (tenant_id, livemode, key)
# makes two concurrent claims of one key serialise: exactly one of them gets a row back.
# A takeover draws a new id (nothing references these rows): complete() and abandon() act
# by id, so the request that was taken over — it may still be running — cannot overwrite or
# delete its successor's claim.
_CLAIM_SQL = f"""
INSERT INTO {_TABLE} AS r
    (tenant_id, livemode, key, request_fingerprint, response_status, response_body, created_at, completed_at)
VALUES (%(tenant)s, %(livemode)s, %(key)s, %(fingerprint)s, NULL, NULL, now(), NULL)
ON CONFLICT (tenant_id, livemode, key) DO UPDATE
    SET id = DEFAULT, request_fingerprint = EXCLUDED.request_fingerprint,
        response_status = NULL, response_body = NULL, created_at = now(), completed_at = NULL
    WHERE r.created_at < now() - %(retention)s
       OR (r.completed_at IS NULL AND r.created_at < now() - %(stale)s
           AND r.request_fingerprint = EXCLUDED.request_fingerprint)
RETURNING r.id
"""

# prune_expired_batch: delete up to %(limit)s records past the retention, oldest first, in
# one short statement. Two guards keep it from ever taking a key that is still owed to a
# client: a record younger than the retention stays (it would still replay or refuse), and
# an in-flight record younger than the stale threshold stays whatever the retention (its
# request may still be running and about to store its response; its duplicates must keep
# getting 409). The conditions are repeated on the outer DELETE so that a row a concurrent
# claim has just taken over (created_at = now()) is rechecked on its new version and kept;
# SKIP LOCKED leaves rows an API request is writing to the next batch or tick. Uses the
# index on created_at, so a batch reads about %(limit)s index entries.
# The batch is a MATERIALIZED CTE, evaluated exactly once: as an ``IN (subquery)`` the planner may
# re-run a ``LIMIT … SKIP LOCKED`` subquery, and one batch then deletes more than its limit.
_PRUNE_BATCH_SQL = f"""
WITH batch AS MATERIALIZED (
    SELECT id FROM {_TABLE}
    WHERE created_at < now() - %(retention)s
      AND (completed_at IS NOT NULL OR created_at < now() - %(stale)s)
    ORDER BY created_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {_TABLE} AS r
USING batch
WHERE r.id = batch.id
  AND r.created_at < now() - %(retention)s
  AND (r.completed_at IS NOT NULL OR r.created_at < now() - %(stale)s)
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


def key_retention() -> timedelta:
    """How long a key's record is kept after its first request: ``HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS``.

    At least 24 hours (settings refuse less), Stripe's documented minimum. Within it the key
    replays or refuses; after it the key is free, whether or not the record is pruned yet.
    """
    return timedelta(hours=settings.HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS)


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


def begin(
    *,
    tenant_id: str,
    livemode: bool,
    key: str,
    request_fingerprint: str,
    secrets: Mapping[str, SecretSource] | None = None,
) -> Claim | Replay:
    """Claim ``key`` for this request, or return the stored response to replay.

    ``secrets`` maps the view's secret response fields to their sources: a replay's body has
    them read again (:func:`restore_secrets`). Raises :class:`~hardcount.errors.InvalidParameters`
    (422) when the key was used with another request, :class:`~hardcount.errors.Conflict` (409)
    while the first request with the key is still executing, or when a secret of the stored
    response can no longer be read. Runs in autocommit: the claim is visible at once.
    """
    params = {
        "tenant": tenant_id,
        "livemode": livemode,
        "key": key,
        "fingerprint": request_fingerprint,
        "retention": key_retention(),
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
        return begin(
            tenant_id=tenant_id, livemode=livemode, key=key, request_fingerprint=request_fingerprint, secrets=secrets
        )
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
    content = existing.response_body.encode()
    if secrets:
        content = restore_secrets(content, secrets, tenant_id=tenant_id, livemode=livemode)
    return Replay(status=existing.response_status, content=content)


def complete(claim: Claim, *, status: int, content: bytes, secrets: Iterable[str] = ()) -> None:
    """Store the response of the claimed request (or drop the claim when ``status`` >= 500).

    ``content`` is the rendered body; it is kept as one JSON string so a replay is byte-identical
    (a ``jsonb`` object would not keep key order). The top-level fields named in ``secrets`` are
    stored as :data:`SECRET_MARKER` (:func:`redact_secrets`), never in clear.
    """
    if status >= 500:
        abandon(claim)
        return
    content = redact_secrets(content, secrets)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {_TABLE} SET response_status = %s, response_body = %s, completed_at = now() WHERE id = %s",
            [status, json.dumps(content.decode()), claim.record_id],
        )


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _render(body: dict[str, Any]) -> bytes:
    # The API's own renderer: a body it rendered, parsed and rendered again, is the same bytes.
    return JSONRenderer().render(body)


def redact_secrets(content: bytes, fields: Iterable[str]) -> bytes:
    """``content`` (a rendered JSON body) with each top-level string field of ``fields`` set to :data:`SECRET_MARKER`.

    The rest of the body keeps its bytes (it is rendered again by the API's JSON renderer); a
    redacted value found anywhere else in the text is replaced by the marker too, so no copy
    of it is stored. A body that is not a JSON object, or has none of ``fields``, is returned
    unchanged.
    """
    body = _json_object(content) if fields else None
    if body is None:
        return content
    values = []
    for name in fields:
        value = body.get(name)
        if isinstance(value, str) and value != SECRET_MARKER:
            values.append(value)
            body[name] = SECRET_MARKER
    if not values:
        return content
    redacted = _render(body)
    for value in values:
        escaped = json.dumps(value, ensure_ascii=False)[1:-1].encode()
        if escaped:
            redacted = redacted.replace(escaped, SECRET_MARKER.encode())
    return redacted


def restore_secrets(content: bytes, sources: Mapping[str, SecretSource], *, tenant_id: str, livemode: bool) -> bytes:
    """A stored body with each top-level field of ``sources`` that holds :data:`SECRET_MARKER` read again.

    ``sources[name](tenant_id, livemode, body)`` gives the secret; the body is rendered again as
    the API rendered it, so a replay is the first response byte for byte. Raises
    :class:`~hardcount.errors.Conflict` (409 ``idempotency_secret_unavailable``) when a source
    returns None (the object that holds the secret no longer exists).
    """
    body = _json_object(content)
    names = [name for name in sources if body is not None and body.get(name) == SECRET_MARKER]
    if not names:
        return content
    for name in names:
        secret = sources[name](tenant_id, livemode, body)
        if secret is None:
            raise Conflict(
                "The response stored under this Idempotency-Key carried a secret that can no longer be read. "
                "Use a new key for a new request.",
                code="idempotency_secret_unavailable",
                param=HEADER,
            )
        body[name] = secret
    return _render(body)


# Field names whose values the admin never shows, whatever view stored the body (records written
# before decision 0125 kept secrets in clear until their retention ran out).
_SECRET_NAME = re.compile(r"(^|_)(secret|password|token|key_hash|api_key)($|_)", re.IGNORECASE)


def _mask(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: (SECRET_MARKER if isinstance(k, str) and _SECRET_NAME.search(k) and v is not None else _mask(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def display_body(stored: str | None) -> str:
    """A record's stored body for the operators' console: indented JSON, secret-named fields masked at any depth.

    Fields whose name says secret (``secret``, ``*_secret``, ``password``, ``token``,
    ``key_hash``, ``api_key``) show :data:`SECRET_MARKER`; a body that is not JSON is not shown
    (it could hold anything). ``""`` for a record still in flight.
    """
    if stored is None:
        return ""
    try:
        body = json.loads(stored)
    except (ValueError, RecursionError):
        return "(not JSON: not shown)"
    return json.dumps(_mask(body), indent=2, ensure_ascii=False)


def abandon(claim: Claim) -> None:
    """Delete the claimed in-flight record so a retry with the same key executes afresh."""
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {_TABLE} WHERE id = %s AND completed_at IS NULL", [claim.record_id])


def prune_expired(
    *,
    fence: Fence = NO_FENCE,
    batch_size: int | None = None,
    retention: timedelta | None = None,
    on_batch: Callable[..., object] | None = None,
) -> int:
    """Delete the records whose key has passed its retention; returns how many were deleted.

    A record goes once ``created_at`` is older than ``retention`` (default
    :func:`key_retention`) by PostgreSQL's ``now()``; an in-flight record also needs to be
    older than :data:`IN_FLIGHT_STALE`, whatever the retention. Works in batches of
    ``batch_size`` rows (default ``HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH``, 1000), each one short
    transaction that first calls ``fence.check()``, repeated until a batch comes back short
    (nothing left, or only rows an API request holds locked right now). Between batches it
    stops early when ``fence.alive()`` is False and calls ``on_batch(deleted)`` (the role's
    liveness stamp). Raises :class:`hardcount.fencing.LeaseLost` when the lease is gone (that
    batch rolls back; earlier ones stay, which is harmless: the work is idempotent), and
    ``ValueError`` for a batch size below 1.
    """
    size = settings.HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH if batch_size is None else batch_size
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, got {size}")
    params = {"retention": key_retention() if retention is None else retention, "stale": IN_FLIGHT_STALE, "limit": size}
    deleted = 0
    while fence.alive():
        with transaction.atomic(), connection.cursor() as cursor:
            fence.check()
            cursor.execute(_PRUNE_BATCH_SQL, params)
            count = cursor.rowcount
        deleted += count
        if on_batch is not None:
            on_batch(count)
        if count < size:
            break
    return deleted
