"""The public JSON shape of outbox objects: events (also the webhook body), endpoints, deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hardcount.times import iso


def event_body(
    *, id: str, type: str, created_at: datetime, livemode: bool, sequence: int, data: dict[str, Any]
) -> dict[str, Any]:
    """An event as the API shows it and as a webhook delivers it (docs/reference/webhooks.md).

    ``id`` is stable across retries and replays so receivers can de-duplicate;
    ``sequence`` increases with every event and orders one tenant's events.
    """
    return {
        "id": id,
        "object": "event",
        "type": type,
        "created": iso(created_at),
        "livemode": livemode,
        "sequence": sequence,
        "data": data,
    }


def event_data(event) -> dict[str, Any]:
    """:func:`event_body` of an :class:`~outbox.models.Event` row."""
    return event_body(
        id=event.id,
        type=event.type,
        created_at=event.created_at,
        livemode=event.livemode,
        sequence=event.sequence,
        data=event.data,
    )


def webhook_endpoint_data(endpoint, *, secret: str | None = None) -> dict[str, Any]:
    """An endpoint; ``secret`` is included only when given (once, in the creation response)."""
    body = {
        "id": endpoint.id,
        "object": "webhook_endpoint",
        "livemode": endpoint.livemode,
        "url": endpoint.url,
        "description": endpoint.description,
        "enabled_events": list(endpoint.enabled_events),
        "status": "enabled" if endpoint.enabled else "disabled",
        "disabled_reason": endpoint.disabled_reason or None,
        "consecutive_failures": endpoint.consecutive_failures,
        "circuit_open_until": iso(endpoint.circuit_open_until),
        "created": iso(endpoint.created_at),
    }
    if secret is not None:
        body["secret"] = secret
    return body


def delivery_attempt_data(attempt) -> dict[str, Any]:
    """One attempt's evidence: outcome, HTTP status (None without an answer), latency, error, 1 KiB excerpt."""
    return {
        "id": attempt.id,
        "object": "webhook_delivery_attempt",
        "number": attempt.number,
        "outcome": attempt.outcome,
        "status_code": attempt.status_code,
        "latency_ms": attempt.latency_ms,
        "error": attempt.error or None,
        "response_excerpt": attempt.response_excerpt or None,
        "created": iso(attempt.created_at),
    }


def delivery_data(delivery, attempts=None) -> dict[str, Any]:
    """A delivery with its attempts (``attempts`` may be passed to avoid a query)."""
    if attempts is None:
        attempts = sorted(delivery.attempt_rows.all(), key=lambda a: a.number)
    return {
        "id": delivery.id,
        "object": "webhook_delivery",
        "livemode": delivery.event.livemode,
        "event": delivery.event_id,
        "event_type": delivery.event.type,
        "webhook_endpoint": delivery.endpoint_id,
        "status": delivery.status,
        "attempt_count": delivery.attempts,
        "next_attempt_at": iso(delivery.fire_after) if delivery.status in ("pending", "retrying") else None,
        "last_error": delivery.last_error or None,
        "replay_of": delivery.replay_of_id,
        "created": iso(delivery.created_at),
        "completed_at": iso(delivery.completed_at),
        "attempts": [delivery_attempt_data(a) for a in attempts],
    }
