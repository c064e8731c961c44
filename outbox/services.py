"""Writing events: the transactional outbox's only entry point for other apps.

Every state change calls :func:`emit_event` (or :func:`emit_for`, its form for an event about
one object) inside the transaction that makes the change, so the change and its event commit or
roll back together (docs/reference/webhooks.md). The event fans out to
one delivery per enabled endpoint that subscribes to its type, in the same transaction.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import connection, transaction
from django.utils import timezone

from hardcount import outbound
from hardcount.bulk import array_literal, copy_models
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError
from outbox import queries
from outbox.models import Delivery, Event, WebhookEndpoint
from outbox.signing import generate_secret
from outbox.stream import publish_on_commit

# Every event type Hardcount emits; endpoints may subscribe to these, "*" or "prefix.*".
EVENT_TYPES = (
    "customer.created",
    "customer.updated",
    "customer.credit_granted",
    "customer.discount.created",
    "customer.discount.deleted",
    "coupon.created",
    "coupon.deleted",
    "price.created",
    "billing.meter.created",
    "invoice.created",
    "invoice.finalized",
    "invoice.paid",
    "invoice.payment_failed",
    "invoice.payment_action_required",
    "invoice.voided",
    "invoice.marked_uncollectible",
    "invoiceitem.created",
    "subscription.created",
    "subscription.updated",
    "subscription.past_due",
    "subscription.billing_failed",
    "subscription.billing_parked",
    "subscription.canceled",
    "subscription.paused",
    "subscription.resumed",
    "test_clock.created",
    "test_clock.advanced",
    "test_clock.deleted",
    "billing_run.completed",
    "dunning.retry_scheduled",
    "dunning.exhausted",
    "charge.refunded",
    "charge.dispute.created",
    "credit_note.created",
    "credit_note.voided",
    "invoice.refunded",
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
    Inside :func:`deferred_events` the rows are written when that block ends (still in the
    transaction) and the returned event is not saved yet.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("emit_event must be called inside the transaction that makes the change")
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}")
    event = Event(tenant_id=tenant_id, livemode=livemode, type=type, data=data, created_at=created_at or timezone.now())
    batch = getattr(_deferred, "batch", None)
    if batch is not None and len(connection.savepoint_ids) == _deferred.depth:
        batch.append(event)
        return event
    # Not deferred, or in a savepoint nested in the block, which may roll back on its own: written now.
    _write_events([event])
    return event


class TenantObject(Protocol):
    """Anything an event can be about: a row of one tenant in one mode (``tenant_id``, ``livemode``)."""

    tenant_id: str
    livemode: bool


def emit_for(obj: TenantObject, type: str, data: dict[str, Any], *, created_at: datetime | None = None) -> Event:
    """:func:`emit_event` for an event about ``obj``: the event's tenant and mode are the object's.

    ``data`` is the object's API representation (each app builds its own; billing's per-kind
    helpers are in ``billing.events``); ``created_at`` and the rules are :func:`emit_event`'s.
    """
    return emit_event(tenant_id=obj.tenant_id, livemode=obj.livemode, type=type, data=data, created_at=created_at)


# The events of the current deferred_events() block, per thread (Django's connections are per thread).
_deferred = threading.local()


@contextmanager
def deferred_events():
    """Within a transaction: write the block's events and deliveries together when it ends, not one by one.

    Each :func:`emit_event` costs three statements (event, endpoint lookup, deliveries); a
    block that emits several (a billing close emits four) writes them all with three. Use it
    inside the transaction, so the rows still commit or roll back with the change:
    ``with transaction.atomic(), deferred_events(): ...``. Events emitted in a savepoint nested in
    the block are written at once, since the savepoint may roll back alone (so their sequence
    numbers come before those of the block's own events); an exception discards the block's
    events with its transaction. A nested block joins the outer one.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("deferred_events must be used inside a transaction")
    if getattr(_deferred, "batch", None) is not None:
        yield
        return
    _deferred.batch, _deferred.depth = [], len(connection.savepoint_ids)
    try:
        yield
        batch = _deferred.batch
    finally:
        _deferred.batch = None
    # One statement however many events (a page close emits hundreds): never COPY in a fenced
    # transaction, where a stopped process mid-COPY would hold the lease row past the idle timeout.
    _write_events(batch, copy_from=None)


def _write_events(events: list[Event], *, copy_from: int | None = 100) -> None:
    """Insert ``events`` (in order) and a delivery per enabled, subscribed endpoint.

    One statement (:data:`outbox.queries.INSERT_EVENTS_WITH_DELIVERIES`) below ``copy_from``
    events, or always when it is None; ``COPY`` from ``copy_from`` events on (a seeded book: a
    COPY keeps its statement open while the client streams rows, which only writers outside a
    fenced transaction may do — the server's idle-transaction bound does not end it).
    """
    if not events:
        return
    publish = streaming()
    if copy_from is None or len(events) < copy_from:
        with connection.cursor() as cursor:
            cursor.execute(
                queries.INSERT_EVENTS_WITH_DELIVERIES_RETURNING_DELIVERIES
                if publish
                else queries.INSERT_EVENTS_WITH_DELIVERIES,
                {
                    "ids": array_literal(e.id for e in events),
                    "tenant_ids": array_literal(e.tenant_id for e in events),
                    "livemodes": array_literal(e.livemode for e in events),
                    "types": array_literal(e.type for e in events),
                    "data": array_literal((e.data for e in events), json_values=True),
                    "created_at": array_literal(e.created_at for e in events),
                },
            )
            rows = cursor.fetchall()
        sequences = {row[0]: row[1] for row in rows}
        for event in events:
            event.sequence = sequences[event.id]
            event._state.adding, event._state.db = False, connection.alias
        if publish:
            tenants = {e.id: e.tenant_id for e in events}
            publish_on_commit([(tenants[row[0]], delivery_id) for row in rows for delivery_id in row[2]])
        return
    endpoints: dict[tuple[str, bool], list[WebhookEndpoint]] = {}
    for key in dict.fromkeys((e.tenant_id, e.livemode) for e in events):
        endpoints[key] = list(
            WebhookEndpoint.objects.filter(
                tenant_id=key[0], livemode=key[1], enabled=True, deleted_at__isnull=True
            ).only("id", "enabled_events")
        )
    copy_models(Event, events)
    deliveries = [
        Delivery(event=event, endpoint=endpoint)
        for event in events
        for endpoint in endpoints[(event.tenant_id, event.livemode)]
        if any(event_type_matches(p, event.type) for p in endpoint.enabled_events)
    ]
    copy_models(Delivery, deliveries)
    if publish:
        publish_on_commit([(d.event.tenant_id, d.id) for d in deliveries])


def streaming() -> bool:
    """True when executors take their work from a stream (``HARDCOUNT_DELIVERY_DISPATCH=nats``), so writers publish."""
    return getattr(settings, "HARDCOUNT_DELIVERY_DISPATCH", "poll") == "nats"


def emit_events(
    events: list[tuple[str, dict[str, Any], datetime | None]], *, tenant_id: str, livemode: bool, batch_size: int = 2000
) -> int:
    """Insert many events of one tenant and mode, with their deliveries, in bulk; returns how many.

    ``events`` are ``(type, data, created_at)`` tuples, as :func:`emit_event` takes them, written
    in list order (their ids and sequence numbers follow it). The same rules hold: inside the
    caller's transaction (``RuntimeError`` otherwise), known types only (``ValueError``), one
    delivery per enabled, subscribed endpoint. For writers of many rows at once (the demo book's
    seed), where one :func:`emit_event` per row would cost three statements each: rows go in with
    ``COPY`` (:func:`hardcount.bulk.copy_models`).
    """
    if not connection.in_atomic_block:
        raise RuntimeError("emit_events must be called inside the transaction that makes the changes")
    unknown = {type_ for type_, _, _ in events if type_ not in EVENT_TYPES}
    if unknown:
        raise ValueError(f"unknown event types {sorted(unknown)!r}")
    wall_clock = timezone.now()
    for start in range(0, len(events), batch_size):
        _write_events(
            [
                Event(
                    tenant_id=tenant_id, livemode=livemode, type=type_, data=data, created_at=created_at or wall_clock
                )
                for type_, data, created_at in events[start : start + batch_size]
            ]
        )
    return len(events)


MAX_ENABLED_EVENTS = 100
# 422 codes for rules a JSON schema cannot state exactly (what makes a URL valid; https in
# live mode): schema-valid input may still be refused with these.
BUSINESS_RULE_CODES = frozenset({"url_invalid", "url_insecure", "url_not_public"})
MAX_URL_LENGTH = 2000


def event_type_patterns() -> list[str]:
    """Every value ``enabled_events`` accepts: ``*``, each ``prefix.*`` and each event type."""
    prefixes = sorted({t.split(".", 1)[0] + ".*" for t in EVENT_TYPES})
    return ["*", *prefixes, *EVENT_TYPES]


def validate_enabled_events(patterns: list[str], *, param: str = "enabled_events") -> list[str]:
    """Check subscription patterns; returns them de-duplicated in order.

    Accepts ``*``, ``prefix.*`` for a prefix some event type has (``invoice.*``) and exact
    event types. Raises :class:`~hardcount.errors.InvalidRequestError` (422) for an empty
    list, more than 100 entries or any unknown name, so a typo never silently subscribes
    to nothing.
    """
    if not patterns:
        raise InvalidRequestError("enabled_events must name at least one event type, or '*'.", param=param)
    if len(patterns) > MAX_ENABLED_EVENTS:
        raise InvalidRequestError(f"enabled_events takes at most {MAX_ENABLED_EVENTS} entries.", param=param)
    known = set(event_type_patterns())
    for i, pattern in enumerate(patterns):
        if pattern not in known:
            raise InvalidRequestError(
                f"Unknown event type {pattern!r}: use '*', a prefix such as 'invoice.*', or one of the event types.",
                code="event_type_unknown",
                param=f"{param}.{i}",
            )
    return list(dict.fromkeys(patterns))


def validate_endpoint_url(url: str, *, livemode: bool, param: str = "url", public_only: bool | None = None) -> str:
    """An absolute ``http(s)`` URL of at most 2000 characters; live mode requires ``https`` (as Stripe does).

    With ``public_only`` (default: in live mode; the API asks for it in both modes) the host
    must not be a literal non-public IP or an obviously local name, unless the operator's
    ``HARDCOUNT_OUTBOUND_ALLOW`` names it (:func:`hardcount.outbound.registration_refusal`).
    Names are not resolved here: every request is checked again at connect time, so a name
    that resolves to a private address is refused then (docs/decisions/0123-outbound-requests-policy.md).
    Raises :class:`~hardcount.errors.InvalidRequestError` (422).
    """
    if len(url) > MAX_URL_LENGTH:
        raise InvalidRequestError(f"url is longer than {MAX_URL_LENGTH} characters.", code="url_invalid", param=param)
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise InvalidRequestError(
            "url must be an absolute http:// or https:// URL.", code="url_invalid", param=param
        ) from None
    if livemode and not url.lower().startswith("https://"):
        raise InvalidRequestError("Live-mode webhook endpoints must use https://.", code="url_insecure", param=param)
    check_public = livemode if public_only is None else public_only
    if check_public:
        try:
            refusal = outbound.registration_refusal(url)
        except ValueError:
            raise InvalidRequestError(
                "url must be an absolute http:// or https:// URL.", code="url_invalid", param=param
            ) from None
        if refusal is not None:
            raise InvalidRequestError(
                "Webhook endpoints must be on a public host, not this machine or a private, loopback, link-local, "
                f"multicast or reserved address: {refusal}.",
                code="url_not_public",
                param=param,
            )
    return url


def _endpoint_for_update(tenant_id: str, livemode: bool, endpoint_id: str) -> WebhookEndpoint:
    endpoint = (
        WebhookEndpoint.objects.select_for_update()
        .filter(tenant_id=tenant_id, livemode=livemode, deleted_at__isnull=True, pk=endpoint_id)
        .first()
    )
    if endpoint is None:
        raise NotFoundError(f"No such webhook endpoint: '{endpoint_id}'.")
    return endpoint


def create_webhook_endpoint(
    *,
    tenant_id: str,
    livemode: bool,
    url: str,
    enabled_events: list[str],
    description: str = "",
    public_only: bool | None = None,
) -> tuple[WebhookEndpoint, str]:
    """Create an enabled endpoint; returns ``(endpoint, secret)``.

    The secret (``whsec_…``) is returned here and never again: the API shows it once.
    Deliveries are created for events emitted from now on. Raises 422 on a bad url or an
    unknown event type; ``public_only`` as in :func:`validate_endpoint_url`.
    """
    url = validate_endpoint_url(url, livemode=livemode, public_only=public_only)
    patterns = validate_enabled_events(enabled_events)
    secret = generate_secret()
    endpoint = WebhookEndpoint.objects.create(
        tenant_id=tenant_id,
        livemode=livemode,
        url=url,
        enabled_events=patterns,
        description=description,
        secret=secret,
    )
    return endpoint, secret


def find_webhook_endpoint(*, tenant_id: str, livemode: bool, url: str) -> WebhookEndpoint | None:
    """The oldest enabled, not deleted endpoint of the tenant and mode at exactly ``url``, or None."""
    return (
        WebhookEndpoint.objects.filter(
            tenant_id=tenant_id, livemode=livemode, url=url, enabled=True, deleted_at__isnull=True
        )
        .order_by("created_at", "id")
        .first()
    )


def update_webhook_endpoint(
    *,
    tenant_id: str,
    livemode: bool,
    endpoint_id: str,
    url: str | None = None,
    enabled_events: list[str] | None = None,
    description: str | None = None,
    enabled: bool | None = None,
    public_only: bool | None = None,
) -> WebhookEndpoint:
    """Change an endpoint's url, subscriptions, description or enabled flag (only what is given).

    Re-enabling an endpoint (after a 410, or by hand) clears its disabled reason and closes
    its circuit. Raises 404 for an unknown or deleted endpoint, 422 on bad values;
    ``public_only`` as in :func:`validate_endpoint_url`.
    """
    with transaction.atomic():
        endpoint = _endpoint_for_update(tenant_id, livemode, endpoint_id)
        if url is not None:
            endpoint.url = validate_endpoint_url(url, livemode=livemode, public_only=public_only)
        if enabled_events is not None:
            endpoint.enabled_events = validate_enabled_events(enabled_events)
        if description is not None:
            endpoint.description = description
        if enabled is not None and enabled != endpoint.enabled:
            endpoint.enabled = enabled
            endpoint.disabled_reason = "" if enabled else "disabled through the API"
            if enabled:
                endpoint.consecutive_failures = 0
                endpoint.circuit_open_until = None
        endpoint.save()
    return endpoint


def reset_circuit(*, tenant_id: str, livemode: bool, endpoint_id: str) -> tuple[WebhookEndpoint, int]:
    """Close an enabled endpoint's circuit by hand: zero its failure count, and make the deliveries
    deferred behind the circuit due now, as a successful probe does (``PULL_IN_DEFERRED``).

    Returns ``(endpoint, deliveries made due)``. For an operator who knows the receiver is back
    before the cool-down ends. Raises 404 for an unknown or deleted endpoint and 409
    ``endpoint_disabled`` for a disabled one (re-enable it instead: that closes the circuit too).
    """
    with transaction.atomic():
        endpoint = _endpoint_for_update(tenant_id, livemode, endpoint_id)
        if not endpoint.enabled:
            raise StateConflictError(
                f"Webhook endpoint {endpoint_id} is disabled; enable it, which also closes its circuit.",
                code="endpoint_disabled",
            )
        endpoint.consecutive_failures = 0
        endpoint.circuit_open_until = None
        endpoint.save(update_fields=["consecutive_failures", "circuit_open_until"])
        with connection.cursor() as cursor:
            cursor.execute(queries.PULL_IN_DEFERRED, {"endpoint_id": endpoint.id})
            pulled = cursor.rowcount
    return endpoint, pulled


def events_with_deliveries(
    *, tenant_id: str, livemode: bool, object_id: str, types: tuple[str, ...], limit: int = 20
) -> list[tuple[Event, list[Delivery]]]:
    """The first ``limit`` events of ``types`` about the object ``object_id`` (its id in the event's
    data), oldest first, each with its deliveries (endpoints selected), for an object's admin page.

    Two statements: the events through ``event_type_idx`` (tenant, mode, type) filtered on the
    data's id, then their deliveries by event.
    """
    events = list(
        Event.objects.filter(tenant_id=tenant_id, livemode=livemode, type__in=types, data__id=object_id).order_by(
            "sequence"
        )[:limit]
    )
    by_event: dict[str, list[Delivery]] = {event.pk: [] for event in events}
    for delivery in Delivery.objects.filter(event__in=events).select_related("endpoint").order_by("pk"):
        by_event[delivery.event_id].append(delivery)
    return [(event, by_event[event.pk]) for event in events]


def delete_webhook_endpoint(*, tenant_id: str, livemode: bool, endpoint_id: str) -> WebhookEndpoint:
    """Delete an endpoint: it gets no new deliveries; its queued ones fail without a request.

    The row stays (soft delete) so its delivery history remains readable. 404 if unknown.
    """
    with transaction.atomic():
        endpoint = _endpoint_for_update(tenant_id, livemode, endpoint_id)
        endpoint.deleted_at = timezone.now()
        endpoint.enabled = False
        endpoint.disabled_reason = "deleted"
        endpoint.save(update_fields=["deleted_at", "enabled", "disabled_reason"])
    return endpoint


def replay_delivery(*, tenant_id: str, livemode: bool, delivery_id: str) -> Delivery:
    """Send a finished delivery's event to its endpoint again, as a new delivery (decision 0031).

    Allowed for a ``succeeded`` or ``failed`` delivery; the new delivery (``replay_of`` the
    original) is due at once and gets its own 8 attempts; the event id is unchanged so the
    receiver can de-duplicate. Raises 404 (unknown delivery), 409 ``delivery_in_progress``
    when the delivery is still queued, 409 ``endpoint_unavailable`` when its endpoint is
    disabled or deleted.
    """
    with transaction.atomic():
        original = (
            Delivery.objects.select_for_update(of=("self",))
            .select_related("endpoint")
            .filter(pk=delivery_id, event__tenant_id=tenant_id, event__livemode=livemode)
            .first()
        )
        if original is None:
            raise NotFoundError(f"No such webhook delivery: '{delivery_id}'.")
        if original.status not in (Delivery.SUCCEEDED, Delivery.FAILED):
            raise StateConflictError(
                f"Delivery {delivery_id} is still {original.status}: it will be attempted again without a replay.",
                code="delivery_in_progress",
            )
        endpoint = original.endpoint
        if endpoint.deleted_at is not None or not endpoint.enabled:
            raise StateConflictError(
                f"Webhook endpoint {endpoint.id} is {'deleted' if endpoint.deleted_at else 'disabled'}; "
                "enable it before replaying.",
                code="endpoint_unavailable",
            )
        replay = Delivery.objects.create(event_id=original.event_id, endpoint=endpoint, replay_of=original)
        if streaming():
            publish_on_commit([(endpoint.tenant_id, replay.id)])
        return replay


def due_backlog() -> int:
    """Deliveries due now and not held by a live claim (``hardcount_outbox_deliveries_due_backlog``)."""
    with connection.cursor() as cursor:
        cursor.execute(queries.DUE_BACKLOG)
        return int(cursor.fetchone()[0])


__all__ = [
    "BUSINESS_RULE_CODES",
    "EVENT_TYPES",
    "TenantObject",
    "create_webhook_endpoint",
    "delete_webhook_endpoint",
    "due_backlog",
    "emit_event",
    "emit_for",
    "event_type_matches",
    "event_type_patterns",
    "events_with_deliveries",
    "replay_delivery",
    "reset_circuit",
    "update_webhook_endpoint",
    "validate_enabled_events",
    "validate_endpoint_url",
]
