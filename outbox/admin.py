"""Operators' admin for the outbox: events, webhook endpoints, deliveries (with a replay action) and attempts.

Signing secrets are never shown here (they are shown once, at creation, by the API). Replay
calls :func:`outbox.services.replay_delivery`, as ``POST /v1/webhook_deliveries/{id}/replay``
does: a new delivery of the same event, with its own attempts.
"""

from django.contrib import admin, messages
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.html import format_html

from hardcount import audit
from hardcount.admin import (
    ReadOnlyAdmin,
    ReadOnlyInline,
    choices_filter,
    id_link,
    mode_filter,
    prefixed_search,
    short_time,
    truncated,
)
from hardcount.errors import ServiceError
from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from outbox.services import EVENT_TYPES, replay_delivery, reset_circuit, update_webhook_endpoint

# Each replay and endpoint operation is recorded in the audit log, one entry per row with its outcome.
REPLAY = "delivery.replay"
REENABLE, RESET_CIRCUIT = "webhook_endpoint.reenable", "webhook_endpoint.reset_circuit"
AUDIT_ACTIONS = audit.actions(REPLAY, REENABLE, RESET_CIRCUIT)


def _circuit_open(endpoint: WebhookEndpoint) -> bool:
    return endpoint.circuit_open_until is not None and endpoint.circuit_open_until > timezone.now()


def endpoint_state(endpoint: WebhookEndpoint) -> str:
    """``deleted``, ``disabled (reason)``, ``circuit open until …`` or ``healthy`` (with recent failures)."""
    if endpoint.deleted_at is not None:
        return "deleted"
    if not endpoint.enabled:
        return f"disabled ({endpoint.disabled_reason or 'no reason recorded'})"
    if _circuit_open(endpoint):
        return (
            f"circuit open until {short_time(endpoint.circuit_open_until)} after "
            f"{endpoint.consecutive_failures} failures in a row: deliveries wait"
        )
    if endpoint.consecutive_failures:
        return f"receiving, {endpoint.consecutive_failures} failures in a row"
    return "healthy"


def pending_short(delivery: Delivery) -> tuple[str, bool]:
    """``(a few words, is it trouble)`` for a list column: why a queued delivery waits (``—`` once finished)."""
    if delivery.status not in (Delivery.PENDING, Delivery.RETRYING):
        return "—", False
    endpoint = delivery.endpoint
    if endpoint.deleted_at is not None or not endpoint.enabled:
        return "endpoint disabled", True
    now = timezone.now()
    if delivery.claim_expires_at is not None and delivery.claim_expires_at > now:
        return "sending now", False
    if _circuit_open(endpoint):
        return f"circuit open until {endpoint.circuit_open_until:%H:%M} UTC", True
    if delivery.fire_after > now:
        return f"next attempt {short_time(delivery.fire_after)}", False
    return "due now", False


class EndpointFilter(admin.SimpleListFilter):
    """Deliveries by endpoint, named by URL (the endpoints table is small; the deliveries table is not read)."""

    title = "endpoint"
    parameter_name = "endpoint__id__exact"
    MAX_ENDPOINTS = 100

    def lookups(self, request, model_admin):
        endpoints = WebhookEndpoint.objects.order_by("url", "pk").values_list("pk", "url")[: self.MAX_ENDPOINTS]
        return tuple((pk, url if len(url) <= 48 else url[:47] + "…") for pk, url in endpoints)

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(endpoint_id=self.value())


def pending_reason(delivery: Delivery) -> str:
    """Why a pending or retrying delivery has not been delivered yet, in words ("" once it is finished)."""
    if delivery.status not in (Delivery.PENDING, Delivery.RETRYING):
        return ""
    endpoint = delivery.endpoint
    if endpoint.deleted_at is not None or not endpoint.enabled:
        return f"its endpoint is {endpoint_state(endpoint)}: it fails without a request when next claimed"
    now = timezone.now()
    if delivery.claim_expires_at is not None and delivery.claim_expires_at > now:
        return f"being sent now by {delivery.claimed_by}"
    if _circuit_open(endpoint):
        return f"the endpoint's circuit is open until {short_time(endpoint.circuit_open_until)}; it waits behind it"
    if delivery.fire_after > now:
        after = f" after {delivery.attempts} attempts" if delivery.attempts else ""
        return f"next attempt at {short_time(delivery.fire_after)}{after}" + (
            f" (last error: {delivery.last_error[:120]})" if delivery.last_error else ""
        )
    return "due now: waiting for a free delivery worker"


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("id", "type", "tenant", "livemode", "sequence", "created")
    list_filter = (mode_filter(), choices_filter("type", EVENT_TYPES, title="type"), "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id",)
    search_help_text = "Exact event id (evt_…)."
    ordering = ("-sequence",)
    sortable_by = ("sequence",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"evt_": "pk"})

    def object_label(self, event: Event) -> str:
        return f"Event {event.type} ({event.id})"

    @admin.display(description="created")
    def created(self, event: Event) -> str:
        return short_time(event.created_at)


class CircuitFilter(admin.SimpleListFilter):
    """Endpoints whose circuit is open now (the database's ``now()``), or closed."""

    title = "circuit"
    parameter_name = "circuit"

    def lookups(self, request, model_admin):
        return (("open", "open"), ("closed", "closed"))

    def queryset(self, request, queryset):
        if self.value() == "open":
            return queryset.filter(circuit_open_until__gt=Now())
        if self.value() == "closed":
            return queryset.exclude(circuit_open_until__gt=Now())
        return queryset


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ReadOnlyAdmin):
    """Webhook endpoints with their state in words; re-enable a disabled one or reset an open circuit."""

    list_display = ("id", "url_short", "tenant", "livemode", "state")
    list_filter = (mode_filter(), "enabled", CircuitFilter, "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "url")
    # The state first: it is what an operator opens the page for (the signing secret is never shown).
    fields = (
        "id",
        "url",
        "state",
        "backlog",
        "tenant",
        "livemode",
        "description",
        "enabled_events",
        "enabled",
        "disabled_reason",
        "consecutive_failures",
        "circuit_open_until",
        "created_at",
        "deleted_at",
    )
    exclude = ("secret",)
    readonly_fields = ("state", "backlog")
    actions = ["reenable", "reset_circuit"]
    object_actions = (("reenable", "Re-enable"), ("reset_circuit", "Reset circuit (deliver now)"))

    def object_label(self, endpoint: WebhookEndpoint) -> str:
        return f"Webhook endpoint {endpoint.url} ({endpoint.id})"

    def object_action_applies(self, endpoint: WebhookEndpoint, action: str) -> bool:
        if endpoint.deleted_at is not None:
            return False
        if action == "reenable":
            return not endpoint.enabled
        return endpoint.enabled and (endpoint.circuit_open_until is not None or endpoint.consecutive_failures > 0)

    @admin.display(description="url")
    def url_short(self, endpoint: WebhookEndpoint):
        return truncated(endpoint.url, 56)

    @admin.display(description="state")
    def state(self, endpoint: WebhookEndpoint):
        text = endpoint_state(endpoint)
        if text == "healthy":
            return text
        return format_html('<span class="hc-alert">{}</span>', text)

    @admin.display(description="queued deliveries")
    def backlog(self, endpoint: WebhookEndpoint):
        from django.urls import reverse

        queued = Delivery.objects.filter(endpoint=endpoint, status__in=(Delivery.PENDING, Delivery.RETRYING))
        count = queued.order_by()[:10_001].count()
        url = (
            reverse("admin:outbox_delivery_changelist")
            + f"?endpoint__id__exact={endpoint.pk}&status__in=pending,retrying"
        )
        return format_html(
            '<a href="{}">{}{} pending or retrying</a>', url, "more than " if count > 10_000 else "", min(count, 10_000)
        )

    @admin.action(description="Re-enable (disabled endpoints; closes the circuit)", permissions=["operate"])
    def reenable(self, request, queryset):
        """Enable each disabled endpoint, as ``POST /v1/webhook_endpoints/{id}`` with ``enabled=true``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        for endpoint in rows:
            if endpoint.enabled:
                self.message_user(request, f"{endpoint.id}: already enabled.", messages.INFO)
                continue
            try:
                update_webhook_endpoint(
                    tenant_id=endpoint.tenant_id, livemode=endpoint.livemode, endpoint_id=endpoint.id, enabled=True
                )
            except ServiceError as exc:
                self.message_user(request, f"{endpoint.id}: not re-enabled. {exc.message}", messages.WARNING)
                self.record_action(request, REENABLE, endpoint, f"Refused: {exc.message}")
                continue
            self.message_user(request, f"{endpoint.id}: re-enabled; its circuit is closed.", messages.SUCCESS)
            self.record_action(request, REENABLE, endpoint, "Re-enabled.")
        return self.after_action(request, rows)

    @admin.action(description="Reset circuit (deliver what waits behind it now)", permissions=["operate"])
    def reset_circuit(self, request, queryset):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        for endpoint in rows:
            try:
                _endpoint, pulled = reset_circuit(
                    tenant_id=endpoint.tenant_id, livemode=endpoint.livemode, endpoint_id=endpoint.id
                )
            except ServiceError as exc:
                self.message_user(request, f"{endpoint.id}: circuit not reset. {exc.message}", messages.WARNING)
                self.record_action(request, RESET_CIRCUIT, endpoint, f"Refused: {exc.message}")
                continue
            message = f"{endpoint.id}: circuit closed; {pulled} waiting deliveries are due now."
            self.message_user(request, message, messages.SUCCESS)
            self.record_action(request, RESET_CIRCUIT, endpoint, message)
        return self.after_action(request, rows)


class DeliveryAttemptInline(ReadOnlyInline):
    model = DeliveryAttempt
    fields = ("number", "outcome", "status_code", "latency_ms", "error_short", "response_short", "executor", "at")
    readonly_fields = fields
    ordering = ("number",)

    @admin.display(description="error")
    def error_short(self, attempt: DeliveryAttempt):
        return truncated(attempt.error, 60)

    @admin.display(description="response")
    def response_short(self, attempt: DeliveryAttempt):
        return truncated(attempt.response_excerpt, 60)

    @admin.display(description="at")
    def at(self, attempt: DeliveryAttempt) -> str:
        return short_time(attempt.created_at)


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "event_type",
        "endpoint_link",
        "status",
        "attempts",
        "waiting",
        "completed_at_display",
    )
    list_filter = (
        "status",
        choices_filter("event__type", EVENT_TYPES, title="event type"),
        mode_filter("event__livemode"),
        EndpointFilter,
    )
    fields = (
        "id",
        "event_link",
        "endpoint_link",
        "endpoint_state_display",
        "status",
        "why_waiting",
        "attempts",
        "fire_after",
        "last_error",
        "claimed_by",
        "claim_expires_at",
        "created_at",
        "completed_at",
        "replay_of_link",
    )
    list_select_related = ("event", "endpoint")
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact delivery id (whd_…), event id (evt_…) or endpoint id (we_…)."
    inlines = [DeliveryAttemptInline]
    actions = ["replay"]
    object_actions = (("replay", "Replay"),)
    readonly_fields = fields

    def object_label(self, delivery: Delivery) -> str:
        return f"Delivery of {delivery.event.type} ({delivery.event_id}) to {delivery.endpoint.url} · {delivery.status}"

    def object_links(self, delivery: Delivery) -> list[tuple[str, str]]:
        from django.urls import reverse

        return [
            (reverse("admin:outbox_event_change", args=[delivery.event_id]), "Its event"),
            (reverse("admin:outbox_webhookendpoint_change", args=[delivery.endpoint_id]), "Its endpoint"),
        ]

    @admin.display(description="why it waits")
    def why_waiting(self, delivery: Delivery):
        reason = pending_reason(delivery)
        if not reason:
            return "—"
        if "circuit is open" in reason or "endpoint is" in reason:
            return format_html('<span class="hc-alert">{}</span>', reason)
        return reason

    @admin.display(description="why it waits")
    def waiting(self, delivery: Delivery):
        text, trouble = pending_short(delivery)
        css = "hc-alert" if trouble else ""
        return format_html('<span title="{}" class="{}">{}</span>', pending_reason(delivery), css, text)

    @admin.display(description="endpoint state")
    def endpoint_state_display(self, delivery: Delivery) -> str:
        return endpoint_state(delivery.endpoint)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"whd_": "pk", "evt_": "event_id", "we_": "endpoint_id"})

    def object_action_applies(self, delivery: Delivery, action: str) -> bool:
        return delivery.status in (Delivery.SUCCEEDED, Delivery.FAILED)

    @admin.display(description="event")
    def event_link(self, delivery: Delivery):
        return id_link(Event, delivery.event_id, text=f"{delivery.event.type} ({delivery.event_id})")

    @admin.display(description="completed")
    def completed_at_display(self, delivery: Delivery) -> str:
        return short_time(delivery.completed_at)

    @admin.display(description="event type")
    def event_type(self, delivery: Delivery) -> str:
        return delivery.event.type

    @admin.display(description="endpoint")
    def endpoint_link(self, delivery: Delivery):
        return id_link(WebhookEndpoint, delivery.endpoint_id, text=truncated(delivery.endpoint.url, 32))

    @admin.display(description="replay of")
    def replay_of_link(self, delivery: Delivery):
        return id_link(Delivery, delivery.replay_of_id) if delivery.replay_of_id else ""

    @admin.action(
        description="Replay selected deliveries (each as a new delivery of the same event)", permissions=["operate"]
    )
    def replay(self, request, queryset):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        replayed, refused = 0, []
        for delivery in rows:
            try:
                replay = replay_delivery(
                    tenant_id=delivery.event.tenant_id, livemode=delivery.event.livemode, delivery_id=delivery.id
                )
                replayed += 1
            except ServiceError as exc:
                refused.append(f"{delivery.id}: {exc.message}")
                self.record_action(
                    request, REPLAY, delivery, f"Refused: {exc.message}", tenant_id=delivery.event.tenant_id
                )
                continue
            self.record_action(
                request, REPLAY, delivery, f"Replayed as {replay.id}.", tenant_id=delivery.event.tenant_id
            )
        self.message_user(request, f"Replayed {replayed} deliver{'y' if replayed == 1 else 'ies'}.")
        for reason in refused:
            self.message_user(request, reason, level=messages.WARNING)
        return self.after_action(request, rows)


@admin.register(DeliveryAttempt)
class DeliveryAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "delivery_link", "number", "outcome", "status_code", "latency_ms", "executor", "at")
    list_filter = ("outcome",)
    search_fields = ("id",)
    search_help_text = "Exact attempt id (wha_…) or delivery id (whd_…)."

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"wha_": "pk", "whd_": "delivery_id"})

    @admin.display(description="delivery")
    def delivery_link(self, attempt: DeliveryAttempt):
        return id_link(Delivery, attempt.delivery_id)

    @admin.display(description="at")
    def at(self, attempt: DeliveryAttempt) -> str:
        return short_time(attempt.created_at)
