"""Test clocks over HTTP: create, retrieve, list, delete, advance (thin: validate, call a service, render).

Test mode only. ``POST /v1/test_clocks/{id}/advance`` answers at once with the clock
``advancing``; poll ``GET /v1/test_clocks/{id}`` until its ``status`` is ``ready`` (a read also
resumes an advance whose process died, :func:`billing.services.clocks.resume_if_stalled`).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from billing.models import TestClock
from billing.representations import test_clock_data
from billing.services import clocks
from hardcount.api import (
    ERROR,
    STARTING_AFTER_HELP,
    ApiView,
    ListQuery,
    QueryIdField,
    StrictCharField,
    StrictDateTimeField,
    StrictSerializer,
    id_path_parameter,
    list_of,
    object_field,
)

_FROZEN_TIME_HELP = "ISO 8601 with a time zone, stored as UTC; from 1970-01-01T00:00:00Z up to 2200-01-01T00:00:00Z."

# ---------------------------------------------------------------------------------------
# Input


class TestClockCreate(StrictSerializer):
    __test__ = False

    frozen_time = StrictDateTimeField(help_text="The clock's starting time. " + _FROZEN_TIME_HELP)
    name = StrictCharField(max_length=200, required=False, allow_blank=True, default="")


class TestClockAdvance(StrictSerializer):
    __test__ = False

    frozen_time = StrictDateTimeField(
        help_text="The new time: later than the clock's current `frozen_time` and at most five years later. "
        + _FROZEN_TIME_HELP
    )


class TestClockListQuery(ListQuery):
    __test__ = False

    starting_after = QueryIdField("test_clock", help_text=STARTING_AFTER_HELP)


# ---------------------------------------------------------------------------------------
# Output (documentation of billing.representations.test_clock_data)


class TestClockOut(serializers.Serializer):
    """A test clock: subscriptions attached to it are billed by `frozen_time`, never by the wall clock."""

    __test__ = False

    id = serializers.CharField()
    object = object_field("test_clock")
    livemode = serializers.BooleanField()
    name = serializers.CharField(allow_blank=True)
    frozen_time = serializers.DateTimeField(
        help_text="The clock's time. While advancing, the instant being billed (it moves forward step by step)."
    )
    status = serializers.ChoiceField(choices=[TestClock.READY, TestClock.ADVANCING])
    advance_target = serializers.DateTimeField(
        allow_null=True, help_text="While `advancing`: the time the clock is advancing to."
    )
    last_failure = serializers.CharField(
        allow_null=True, help_text="Why the latest close on this clock failed, or why an advance stopped short."
    )
    created = serializers.DateTimeField()


class TestClockDeleted(serializers.Serializer):
    __test__ = False

    id = serializers.CharField()
    object = object_field("test_clock")
    deleted = serializers.BooleanField()


# ---------------------------------------------------------------------------------------
# Views


class TestClockListView(ApiView):
    __test__ = False
    get_query = TestClockListQuery

    @extend_schema(
        operation_id="test_clocks_create",
        summary="Create a test clock",
        description="Test mode only (a live key gets 422 `test_mode_only`). Attach customers to the clock with "
        "`test_clock` when creating them; their subscriptions are then billed by the clock's time.",
        tags=["test_clocks"],
        request=TestClockCreate,
        responses={201: TestClockOut},
    )
    def post(self, request):
        data = self.read_body(TestClockCreate)
        clock = clocks.create_test_clock(
            tenant_id=self.tenant.pk, livemode=self.livemode, frozen_time=data["frozen_time"], name=data["name"]
        )
        return Response(test_clock_data(clock), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="test_clocks_list",
        summary="List test clocks, newest first",
        tags=["test_clocks"],
        responses=list_of(TestClockOut, "TestClockList"),
    )
    def get(self, request):
        query = self.read_query()
        return self.paginate(self.scoped(TestClock), test_clock_data, query, kind="test_clock")


class TestClockDetailView(ApiView):
    __test__ = False

    @extend_schema(
        operation_id="test_clocks_retrieve",
        summary="Retrieve a test clock",
        description="Poll this after an advance until `status` is `ready`.",
        tags=["test_clocks"],
        parameters=[id_path_parameter("test_clock")],
        responses=TestClockOut,
    )
    def get(self, request, id):
        clock = self.get_scoped(TestClock, id, kind="test_clock")
        clocks.resume_if_stalled(clock)
        return Response(test_clock_data(clock))

    @extend_schema(
        operation_id="test_clocks_delete",
        summary="Delete a test clock",
        description="Only a clock with no customers or subscriptions attached (else 409 `test_clock_in_use`), "
        "and not while it advances (409 `test_clock_advancing`).",
        tags=["test_clocks"],
        parameters=[id_path_parameter("test_clock")],
        responses={200: TestClockDeleted, 409: ERROR},
    )
    def delete(self, request, id):
        self.get_scoped(TestClock, id, kind="test_clock")
        clock = clocks.delete_test_clock(tenant_id=self.tenant.pk, livemode=self.livemode, clock_id=id)
        return Response({"id": clock.id, "object": "test_clock", "deleted": True})


class TestClockAdvanceView(ApiView):
    __test__ = False

    @extend_schema(
        operation_id="test_clocks_advance",
        summary="Advance a test clock",
        description="Answers at once with the clock `advancing`; in the background every billing period, trial "
        "end, cancellation and dunning retry falling due up to `frozen_time` is processed in order at its own "
        "time, then the clock is `ready` at `frozen_time` (event `test_clock.advanced`). 409 while the clock is "
        "already advancing; 422 `test_clock_time_not_later` unless `frozen_time` is later than the clock's time.",
        tags=["test_clocks"],
        parameters=[id_path_parameter("test_clock")],
        request=TestClockAdvance,
        responses={200: TestClockOut},
    )
    def post(self, request, id):
        data = self.read_body(TestClockAdvance)
        self.get_scoped(TestClock, id, kind="test_clock")
        clock = clocks.advance_test_clock(
            tenant_id=self.tenant.pk, livemode=self.livemode, clock_id=id, frozen_time=data["frozen_time"]
        )
        return Response(test_clock_data(clock))
