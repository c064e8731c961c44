"""Writing events: the transactional outbox's only entry point for other apps.

Every state change calls :func:`emit_event` inside the transaction that makes the change,
so the change and its event commit or roll back together (SPEC §6). The event fans out to
one delivery per enabled endpoint that subscribes to its type, in the same transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from outbox.models import Delivery, Event, WebhookEndpoint

# Every event type Hardcount emits; endpoints may subscribe to these, "*" or "prefix.*".
EVENT_TYPES = (
    "customer.created",
    "customer.updated",
    "customer.credit_granted",
    "price.created",
    "invoice.created",
    "invoice.finalized",
    "invoice.paid",
    "invoice.payment_failed",
    "invoice.voided",
    "invoice.marked_uncollectible",
    "subscription.created",
    "subscription.updated",
    "subscription.past_due",
    "subscription.billing_failed",
    "subscription.billing_parked",
    "subscription.canceled",
    "test_clock.created",
    "test_clock.advanced",
    "billing_run.completed",
    "dunning.retry_scheduled",
    "dunning.exhausted",
)


def event_type_matches(pattern: str, event_type: str) -> bool:
    """True when an endpoint's subscription ``pattern`` (``*``, ``invoice.*`` or exact) covers ``event_type``."""
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return event_type.startswith(pattern[:-1])
    return pattern == event_type


def emit_event(
    *, tenant_id: str, livemode: bool, type: str, data: dict[str, Any], created_at: datetime | None = None
) -> Event:
    """Insert event ``type`` with ``data`` (the object's API representation) and its deliveries.

    Must run inside the caller's transaction (raises ``RuntimeError`` otherwise), so the
    event exists exactly when the change it describes does. ``created_at`` is the billing
    time of the change (a test clock's time where one applies; default the wall clock).
    """
    if not connection.in_atomic_block:
        raise RuntimeError("emit_event must be called inside the transaction that makes the change")
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}")
    event = Event.objects.create(
        tenant_id=tenant_id, livemode=livemode, type=type, data=data, created_at=created_at or timezone.now()
    )
    endpoints = WebhookEndpoint.objects.filter(
        tenant_id=tenant_id, livemode=livemode, enabled=True, deleted_at__isnull=True
    ).only("id", "enabled_events")
    Delivery.objects.bulk_create(
        Delivery(event=event, endpoint=endpoint)
        for endpoint in endpoints
        if any(event_type_matches(p, type) for p in endpoint.enabled_events)
    )
    return event


__all__ = ["EVENT_TYPES", "emit_event", "event_type_matches"]
