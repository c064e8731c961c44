"""Operators' admin for the outbox: read-only events, webhook endpoints, deliveries and attempts.

Signing secrets are never shown here (they are shown once, at creation, by the API).
"""

from django.contrib import admin, messages

from hardcount.admin import ReadOnlyAdmin, ReadOnlyInline
from hardcount.errors import ServiceError
from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint
from outbox.services import replay_delivery


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("id", "type", "tenant", "livemode", "sequence", "created_at")
    list_filter = ("livemode", "type")
    search_fields = ("id", "type", "tenant__id")
    ordering = ("-sequence",)


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ReadOnlyAdmin):
    list_display = ("id", "url", "tenant", "livemode", "enabled", "consecutive_failures", "circuit_open_until")
    list_filter = ("livemode", "enabled")
    search_fields = ("id", "url", "tenant__id")
    exclude = ("secret",)


class DeliveryAttemptInline(ReadOnlyInline):
    model = DeliveryAttempt
    fields = ("number", "outcome", "status_code", "latency_ms", "error", "response_excerpt", "executor", "created_at")


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ("id", "event", "endpoint", "status", "attempts", "fire_after", "claimed_by", "completed_at")
    list_filter = ("status", "event__type", "event__livemode", "endpoint")
    search_fields = ("id", "event__id", "endpoint__id")
    inlines = [DeliveryAttemptInline]
    actions = ["replay"]

    @admin.action(description="Replay selected deliveries (each as a new delivery of the same event)")
    def replay(self, request, queryset):
        replayed, refused = 0, []
        for delivery in queryset.select_related("event"):
            try:
                replay_delivery(
                    tenant_id=delivery.event.tenant_id, livemode=delivery.event.livemode, delivery_id=delivery.id
                )
                replayed += 1
            except ServiceError as exc:
                refused.append(f"{delivery.id}: {exc.message}")
        self.message_user(request, f"Replayed {replayed} deliver{'y' if replayed == 1 else 'ies'}.")
        for reason in refused:
            self.message_user(request, reason, level=messages.WARNING)


@admin.register(DeliveryAttempt)
class DeliveryAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "delivery", "number", "outcome", "status_code", "latency_ms", "executor", "created_at")
    list_filter = ("outcome",)
    search_fields = ("id", "delivery__id")
