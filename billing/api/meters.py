"""Meters, meter events and event summaries over HTTP (Stripe's Billing Meters; docs/reference/usage-billing.md)."""

from __future__ import annotations

from datetime import UTC, datetime

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response

from billing import serializers as s
from billing.models import Customer, Meter
from billing.representations import meter_data
from billing.services import usage
from hardcount.api import ERROR, ApiView, id_path_parameter, list_of
from hardcount.errors import InvalidRequestError, business_rule_codes

SUMMARY_CODES = business_rule_codes("time_range_invalid")


class MeterListView(ApiView):
    get_query = s.MeterListQuery

    @extend_schema(
        operation_id="billing_meters_create",
        summary="Create a meter",
        tags=["usage"],
        request=s.MeterCreate,
        responses={201: s.Meter},
    )
    def post(self, request):
        data = self.read_body(s.MeterCreate)
        meter = usage.create_meter(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            display_name=data["display_name"],
            event_name=data["event_name"],
            formula=data["default_aggregation"]["formula"],
            customer_key=data.get("customer_mapping", {}).get("event_payload_key", "stripe_customer_id"),
            value_key=data.get("value_settings", {}).get("event_payload_key", "value"),
        )
        return Response(meter_data(meter), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="billing_meters_list",
        summary="List meters, newest first",
        tags=["usage"],
        responses=list_of(s.Meter, "MeterList"),
    )
    def get(self, request):
        query = self.read_query()
        return self.paginate(self.scoped(Meter), meter_data, query, kind="meter")


class MeterDetailView(ApiView):
    @extend_schema(
        operation_id="billing_meters_retrieve",
        summary="Retrieve a meter",
        tags=["usage"],
        parameters=[id_path_parameter("meter")],
        responses=s.Meter,
    )
    def get(self, request, id):
        return Response(meter_data(self.get_scoped(Meter, id, kind="meter")))


class MeterEventSummaryView(ApiView):
    get_query = s.EventSummaryQuery

    @extend_schema(
        operation_id="billing_meters_event_summaries",
        summary="A customer's aggregated usage of a meter in a time range",
        description="The meter's formula over the customer's events with `start_time <= timestamp < end_time`, "
        "whole (`value_grouping_window=none`) or per UTC day (`day`; days without events are left out).",
        tags=["usage"],
        parameters=[id_path_parameter("meter")],
        responses={200: list_of(s.EventSummary, "MeterEventSummaryList"), 404: ERROR},
    )
    def get(self, request, id):
        query = self.read_query()
        meter = self.get_scoped(Meter, id, kind="meter")
        customer = self.get_scoped(Customer, query["customer"], kind="customer", param="customer")
        start = datetime.fromtimestamp(query["start_time"], tz=UTC)
        end = datetime.fromtimestamp(query["end_time"], tz=UTC)
        if end <= start:
            raise InvalidRequestError("end_time must be after start_time.", code="time_range_invalid", param="end_time")
        data = usage.event_summaries(meter, customer.id, start, end, by_day=query["value_grouping_window"] == "day")
        return Response({"object": "list", "data": data, "has_more": False})


class MeterEventCreateView(ApiView):
    @extend_schema(
        operation_id="billing_meter_events_create",
        summary="Record one usage event",
        description="Stored once per `identifier`: a retry answers 200 with the event stored first. "
        "Refused with 422 when its meter or customer is unknown, its value is not an integer, or its "
        "timestamp is more than 5 minutes ahead or older than the grace window.",
        tags=["usage"],
        request=s.MeterEventCreate,
        responses={201: s.MeterEvent, 200: s.MeterEvent, 422: ERROR},
    )
    def post(self, request):
        data = self.read_body(s.MeterEventCreate)
        (result,) = usage.record_meter_events(tenant_id=self.tenant.pk, livemode=self.livemode, events=[data])
        if result.status == "refused":
            raise InvalidRequestError(result.error["message"], code=result.error["code"], param=result.error["param"])
        if result.status == "duplicate":
            stored = usage.stored_event(tenant_id=self.tenant.pk, livemode=self.livemode, identifier=result.identifier)
            return Response(stored, status=status.HTTP_200_OK)
        return Response(result.event, status=status.HTTP_201_CREATED)


class MeterEventBatchView(ApiView):
    @extend_schema(
        operation_id="billing_meter_events_batch",
        summary="Record up to 1,000 usage events",
        description="Each event is accepted, a `duplicate` (its identifier was stored before: not counted "
        "again) or refused with its reason; the accepted ones are stored by one statement.",
        tags=["usage"],
        request=s.MeterEventBatchCreate,
        responses={200: s.MeterEventBatch},
    )
    def post(self, request):
        data = self.read_body(s.MeterEventBatchCreate)
        results = usage.record_meter_events(tenant_id=self.tenant.pk, livemode=self.livemode, events=data["events"])
        counts = {word: sum(1 for r in results if r.status == word) for word in ("accepted", "duplicate", "refused")}
        return Response({"object": "billing.meter_event_batch", **counts, "data": [r.data() for r in results]})
