"""Operators' admin for the outbox: events, webhook endpoints, deliveries (with a replay action) and attempts.

Signing secrets are never shown here (they are shown once, at creation, by the API). Replay
calls :func:`outbox.services.replay_delivery`, as ``POST /v1/webhook_deliveries/{id}/replay``
does: a new delivery of the same event, with its own attempts.
"""

from django.contrib import admin, messages

from hardcount import audit
from hardcount.admin import (
    ReadOnlyAdmin,
    ReadOnlyInline,
    choices_filter,
    id_link,
    mode_filter,
    prefixed_search,
    short_time,
)
from hardcount.errors import ServiceError
from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from outbox.services import EVENT_TYPES, replay_delivery

# Each replay is recorded in the audit log, one entry per delivery with its outcome (hardcount.audit).
REPLAY = "delivery.replay"
AUDIT_ACTIONS = audit.actions(REPLAY)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("id", "type", "tenant", "livemode", "sequence", "created_at")
    list_filter = (mode_filter(), choices_filter("type", EVENT_TYPES, title="type"), "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id",)
    search_help_text = "Exact event id (evt_…)."
    ordering = ("-sequence",)
    sortable_by = ("sequence",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"evt_": "pk"})


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ReadOnlyAdmin):
    list_display = ("id", "url", "tenant", "livemode", "enabled", "consecutive_failures", "circuit_open_until")
    list_filter = (mode_filter(), "enabled", "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "url")
    exclude = ("secret",)


class DeliveryAttemptInline(ReadOnlyInline):
    model = DeliveryAttempt
    fields = ("number", "outcome", "status_code", "latency_ms", "error", "response_excerpt", "executor", "created_at")
    ordering = ("number",)


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "event_type",
        "endpoint_link",
        "status",
        "attempts",
        "fire_after_display",
        "completed_at_display",
        "replay_of_link",
    )
    list_filter = (
        "status",
        choices_filter("event__type", EVENT_TYPES, title="event type"),
        mode_filter("event__livemode"),
        "endpoint",
    )
    list_select_related = ("event", "endpoint")
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact delivery id (whd_…), event id (evt_…) or endpoint id (we_…)."
    inlines = [DeliveryAttemptInline]
    actions = ["replay"]
    object_actions = (("replay", "Replay"),)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"whd_": "pk", "evt_": "event_id", "we_": "endpoint_id"})

    def object_action_applies(self, delivery: Delivery, action: str) -> bool:
        return delivery.status in (Delivery.SUCCEEDED, Delivery.FAILED)

    @admin.display(description="event")
    def event_link(self, delivery: Delivery):
        return id_link(Event, delivery.event_id)

    @admin.display(description="fire after")
    def fire_after_display(self, delivery: Delivery) -> str:
        return short_time(delivery.fire_after)

    @admin.display(description="completed at")
    def completed_at_display(self, delivery: Delivery) -> str:
        return short_time(delivery.completed_at)

    @admin.display(description="event type")
    def event_type(self, delivery: Delivery) -> str:
        return delivery.event.type

    @admin.display(description="endpoint")
    def endpoint_link(self, delivery: Delivery):
        return id_link(WebhookEndpoint, delivery.endpoint_id, text=delivery.endpoint.url)

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
    list_display = ("id", "delivery_link", "number", "outcome", "status_code", "latency_ms", "executor", "created_at")
    list_filter = ("outcome",)
    search_fields = ("id",)
    search_help_text = "Exact attempt id (wha_…) or delivery id (whd_…)."

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"wha_": "pk", "whd_": "delivery_id"})

    @admin.display(description="delivery")
    def delivery_link(self, attempt: DeliveryAttempt):
        return id_link(Delivery, attempt.delivery_id)
