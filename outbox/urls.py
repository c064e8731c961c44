"""The outbox's /v1 URL patterns (included by :mod:`hardcount.urls` under ``v1/``)."""

from django.urls import path

from outbox import api

urlpatterns = [
    path("webhook_endpoints", api.WebhookEndpointListView.as_view(), name="webhook-endpoints"),
    path("webhook_endpoints/<str:id>", api.WebhookEndpointDetailView.as_view(), name="webhook-endpoint"),
    path("events", api.EventListView.as_view(), name="events"),
    path("events/<str:id>", api.EventDetailView.as_view(), name="event"),
    path("webhook_deliveries", api.DeliveryListView.as_view(), name="webhook-deliveries"),
    path("webhook_deliveries/<str:id>", api.DeliveryDetailView.as_view(), name="webhook-delivery"),
    path("webhook_deliveries/<str:id>/replay", api.DeliveryReplayView.as_view(), name="webhook-delivery-replay"),
]
