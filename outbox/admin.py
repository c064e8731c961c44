"""Operators' admin for the outbox: read-only events, webhook endpoints, deliveries and attempts.

Signing secrets are never shown here (they are shown once, at creation, by the API).
"""

from django.contrib import admin

from hardcount.admin import ReadOnlyAdmin, ReadOnlyInline
from outbox.models import Delivery, DeliveryAttempt, Event, WebhookEndpoint


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
    fields = ("number", "status_code", "latency_ms", "error", "executor", "created_at")


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ("id", "event", "endpoint", "status", "attempts", "fire_after", "claimed_by", "completed_at")
    list_filter = ("status",)
    search_fields = ("id", "event__id", "endpoint__id")
    inlines = [DeliveryAttemptInline]


@admin.register(DeliveryAttempt)
class DeliveryAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "delivery", "number", "status_code", "latency_ms", "executor", "created_at")
    search_fields = ("id", "delivery__id")
