"""Webhook endpoints, events and deliveries over HTTP (thin: validate, call a service, render).

Shapes come from :mod:`outbox.representations`; input is validated by
:mod:`outbox.serializers`; rules live in :mod:`outbox.services`.
"""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response

from hardcount import audit
from hardcount.api import ERROR, ApiView, is_id, list_of
from hardcount.errors import ResourceMissing
from outbox import serializers as s
from outbox import services
from outbox.models import Delivery, Event, WebhookEndpoint
from outbox.representations import delivery_data, event_data, webhook_endpoint_data

ID_PATH = OpenApiParameter("id", str, OpenApiParameter.PATH, description="The object's id.")
# Endpoint changes are recorded in the audit log with the key that made them (hardcount.audit); never the secret.
CREATED, UPDATED, DELETED = "webhook_endpoint.created", "webhook_endpoint.updated", "webhook_endpoint.deleted"
AUDIT_ACTIONS = audit.actions(CREATED, UPDATED, DELETED)


def _endpoints(view: ApiView):
    return view.scoped(WebhookEndpoint).filter(deleted_at__isnull=True)


def _deliveries(view: ApiView):
    """Deliveries of the caller's tenant and mode (a delivery's scope is its event's)."""
    return (
        Delivery.objects.filter(event__tenant_id=view.tenant.pk, event__livemode=view.livemode)
        .select_related("event")
        .prefetch_related("attempt_rows")
    )


def _get_delivery(view: ApiView, delivery_id: str, *, param: str | None = None) -> Delivery:
    """One delivery of the caller's tenant and mode, or the same 404 as an id that never existed."""
    delivery = _deliveries(view).filter(pk=delivery_id).first() if is_id("delivery", delivery_id) else None
    if delivery is None:
        raise ResourceMissing(f"No such webhook delivery: '{delivery_id}'.", param=param)
    return delivery


def _endpoint_secret(tenant_id: str, livemode: bool, body) -> str | None:
    return (
        WebhookEndpoint.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=body.get("id"))
        .values_list("secret", flat=True)
        .first()
    )


class WebhookEndpointListView(ApiView):
    get_query = s.WebhookEndpointListQuery
    # Shown once: an idempotency record stores a marker, a replay reads the endpoint's secret again.
    response_secrets = {"secret": _endpoint_secret}

    @extend_schema(
        operation_id="webhook_endpoints_create",
        summary="Create a webhook endpoint",
        description="Events of the subscribed types emitted from now on are delivered to `url`, signed "
        "with the `secret` returned here once (`Hardcount-Signature: t=…,v1=…`).",
        tags=["webhooks"],
        request=s.WebhookEndpointCreateBody,
        responses={201: s.WebhookEndpointWithSecret},
    )
    def post(self, request):
        data = self.read_body(s.WebhookEndpointCreateBody)
        with transaction.atomic():
            endpoint, secret = services.create_webhook_endpoint(
                tenant_id=self.tenant.pk,
                livemode=self.livemode,
                url=data["url"],
                enabled_events=data["enabled_events"],
                description=data["description"],
                public_only=True,
            )
            message = f"Created for {audit.redacted_url(endpoint.url)} ({', '.join(endpoint.enabled_events)})."
            audit.record(CREATED, obj=endpoint, request=request, message=message)
        return Response(webhook_endpoint_data(endpoint, secret=secret), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="webhook_endpoints_list",
        summary="List webhook endpoints, newest first",
        tags=["webhooks"],
        responses=list_of(s.WebhookEndpoint, "WebhookEndpointList"),
    )
    def get(self, request):
        query = self.read_query()
        endpoints = _endpoints(self)
        return self.paginate(endpoints, webhook_endpoint_data, query, kind="webhook_endpoint", cursor_scope=endpoints)


class WebhookEndpointDetailView(ApiView):
    @extend_schema(
        operation_id="webhook_endpoints_retrieve",
        summary="Retrieve a webhook endpoint",
        tags=["webhooks"],
        parameters=[ID_PATH],
        responses=s.WebhookEndpoint,
    )
    def get(self, request, id):
        return Response(webhook_endpoint_data(self.get_scoped(_endpoints(self), id, kind="webhook_endpoint")))

    @extend_schema(
        operation_id="webhook_endpoints_update",
        summary="Update a webhook endpoint",
        description="Changes only the fields given. `enabled: true` re-enables an endpoint disabled by a "
        "410 answer or by hand, and closes its circuit breaker.",
        tags=["webhooks"],
        parameters=[ID_PATH],
        request=s.WebhookEndpointUpdateBody,
        responses={200: s.WebhookEndpoint},
    )
    def post(self, request, id):
        data = self.read_body(s.WebhookEndpointUpdateBody)
        self.get_scoped(_endpoints(self), id, kind="webhook_endpoint")
        with transaction.atomic():
            endpoint = services.update_webhook_endpoint(
                tenant_id=self.tenant.pk, livemode=self.livemode, endpoint_id=id, public_only=True, **data
            )
            message = f"Changed {', '.join(sorted(data)) or 'nothing'}; url {audit.redacted_url(endpoint.url)}."
            audit.record(UPDATED, obj=endpoint, request=request, message=message)
        return Response(webhook_endpoint_data(endpoint))

    @extend_schema(
        operation_id="webhook_endpoints_delete",
        summary="Delete a webhook endpoint",
        description="No new deliveries; queued ones end as failed without a request. "
        "Its delivery history stays readable.",
        tags=["webhooks"],
        parameters=[ID_PATH],
        responses={200: s.DeletedWebhookEndpoint},
    )
    def delete(self, request, id):
        self.get_scoped(_endpoints(self), id, kind="webhook_endpoint")
        with transaction.atomic():
            endpoint = services.delete_webhook_endpoint(
                tenant_id=self.tenant.pk, livemode=self.livemode, endpoint_id=id
            )
            audit.record(
                DELETED, obj=endpoint, request=request, message=f"Deleted ({audit.redacted_url(endpoint.url)})."
            )
        return Response({"id": endpoint.id, "object": "webhook_endpoint", "deleted": True})


class EventListView(ApiView):
    get_query = s.EventListQuery

    @extend_schema(
        operation_id="events_list",
        summary="List events, newest first",
        tags=["events"],
        responses=list_of(s.Event, "EventList"),
    )
    def get(self, request):
        query = self.read_query()
        events = self.filter_by_query(self.scoped(Event), query, type="type")
        return self.paginate(events, event_data, query, kind="event")


class EventDetailView(ApiView):
    @extend_schema(
        operation_id="events_retrieve",
        summary="Retrieve an event",
        tags=["events"],
        parameters=[ID_PATH],
        responses=s.Event,
    )
    def get(self, request, id):
        return Response(event_data(self.get_scoped(Event, id, kind="event")))


class DeliveryListView(ApiView):
    get_query = s.DeliveryListQuery

    @extend_schema(
        operation_id="webhook_deliveries_list",
        summary="List webhook deliveries with their attempts, newest first",
        tags=["webhooks"],
        responses=list_of(s.WebhookDelivery, "WebhookDeliveryList"),
    )
    def get(self, request):
        query = self.read_query()
        deliveries = self.filter_by_query(
            _deliveries(self), query, event="event_id", webhook_endpoint="endpoint_id", status="status"
        )
        # Deliveries have no tenant column (their event has), so the cursor is checked here
        # rather than by paginate()'s tenant-column scoping.
        cursor = query.get("starting_after")
        if cursor:
            _get_delivery(self, cursor, param="starting_after")
            deliveries = deliveries.filter(pk__lt=cursor)
        return self.paginate(deliveries, delivery_data, {**query, "starting_after": None}, kind="delivery")


class DeliveryDetailView(ApiView):
    @extend_schema(
        operation_id="webhook_deliveries_retrieve",
        summary="Retrieve a webhook delivery with its attempts",
        tags=["webhooks"],
        parameters=[ID_PATH],
        responses=s.WebhookDelivery,
    )
    def get(self, request, id):
        return Response(delivery_data(_get_delivery(self, id)))


class DeliveryReplayView(ApiView):
    @extend_schema(
        operation_id="webhook_deliveries_replay",
        summary="Replay a webhook delivery",
        description="Sends the delivery's event to its endpoint again as a new delivery (`replay_of` the "
        "original), due now, with its own attempts; the event id is unchanged. Only a `succeeded` or "
        "`failed` delivery can be replayed (409 otherwise), and only to an enabled endpoint (409).",
        tags=["webhooks"],
        parameters=[ID_PATH],
        request=s.ReplayBody,
        responses={201: s.WebhookDelivery, 404: ERROR},
    )
    def post(self, request, id):
        self.read_body(s.ReplayBody)
        _get_delivery(self, id)
        replay = services.replay_delivery(tenant_id=self.tenant.pk, livemode=self.livemode, delivery_id=id)
        return Response(delivery_data(replay, attempts=[]), status=status.HTTP_201_CREATED)
