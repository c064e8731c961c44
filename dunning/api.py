"""Dunning over HTTP: the tenant's policy (``/v1/dunning_settings``) and the runs (``/v1/dunning_runs``).

Thin views: validate, call :mod:`dunning.services`, render with :mod:`dunning.representations`.
The output serializers only document that JSON (``tests/dunning/test_api.py`` checks each
declares exactly the keys its function returns).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response

from dunning import services
from dunning.models import DunningRun, DunningSettings
from dunning.representations import dunning_run_data, dunning_settings_data
from hardcount.api import (
    STARTING_AFTER_HELP,
    ApiView,
    ListQuery,
    QueryIdField,
    StrictChoiceField,
    StrictIntegerField,
    StrictSerializer,
    id_path_parameter,
    list_of,
    object_field,
)

FINAL_ACTIONS = DunningSettings.FinalAction.values
RUN_STATUSES = DunningRun.Status.values
END_REASONS = DunningRun.EndReason.values

# ---------------------------------------------------------------------------------------
# Input


@extend_schema_field(
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": services.MAX_RETRY_DAY},
        "minItems": 1,
        "maxItems": services.MAX_RETRIES,
        "uniqueItems": True,
        "description": "Days after the first decline on which to retry, in any order (kept sorted): "
        f"1 to {services.MAX_RETRIES} distinct whole days from 1 to {services.MAX_RETRY_DAY}.",
    }
)
class RetryDaysField(serializers.ListField):
    """A JSON array of distinct day numbers (each a strict integer in range)."""

    default_error_messages = {"not_distinct": "Entries must be distinct."}

    def __init__(self, **kwargs):
        kwargs.setdefault("child", StrictIntegerField(min_value=1, max_value=services.MAX_RETRY_DAY))
        kwargs.setdefault("min_length", 1)
        kwargs.setdefault("max_length", services.MAX_RETRIES)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        values = super().to_internal_value(data)
        if len(set(values)) != len(values):
            self.fail("not_distinct")
        return values


class DunningSettingsUpdate(StrictSerializer):
    """Fields to change; those left out keep their value."""

    retry_days = RetryDaysField(
        required=False, help_text="Applies to runs that start afterwards; a run keeps the schedule it started with."
    )
    final_action = StrictChoiceField(
        choices=FINAL_ACTIONS,
        required=False,
        help_text="What the subscription becomes when an invoice's retries are exhausted (the invoice becomes "
        "`uncollectible`): `unpaid` (no longer billed) or `canceled` (ended now).",
    )


class DunningRunListQuery(ListQuery):
    starting_after = QueryIdField("dunning_run", help_text=STARTING_AFTER_HELP)
    status = StrictChoiceField(choices=RUN_STATUSES, required=False)
    invoice = QueryIdField("invoice", help_text="Only this invoice's run.")


# ---------------------------------------------------------------------------------------
# Output (documentation of dunning.representations)


class DunningSettingsOut(serializers.Serializer):
    """A tenant's dunning policy for the key's mode."""

    object = object_field("dunning_settings")
    livemode = serializers.BooleanField()
    retry_days = serializers.ListField(child=serializers.IntegerField(), help_text="Days after the first decline.")
    final_action = serializers.ChoiceField(choices=FINAL_ACTIONS)
    updated_at = serializers.DateTimeField(allow_null=True, help_text="Null while the defaults apply.")

    class Meta:
        ref_name = "DunningSettings"


class DunningRunOut(serializers.Serializer):
    """The retries of one declined invoice."""

    id = serializers.CharField()
    object = object_field("dunning_run")
    livemode = serializers.BooleanField()
    invoice = serializers.CharField()
    status = serializers.ChoiceField(choices=RUN_STATUSES)
    end_reason = serializers.ChoiceField(choices=END_REASONS, allow_null=True)
    retry_days = serializers.ListField(child=serializers.IntegerField())
    retries_done = serializers.IntegerField()
    retries_left = serializers.IntegerField()
    next_attempt_at = serializers.DateTimeField(
        allow_null=True,
        help_text="The next automatic charge; null when the run is over, waits for a new payment method, or has "
        "no retry left.",
    )
    final_action_at = serializers.DateTimeField(
        allow_null=True, help_text="When the final action applies if no payment arrives; null once the run is over."
    )
    waiting_for_payment_method = serializers.BooleanField(
        help_text="A hard decline: no retry until the customer's default payment method changes."
    )
    last_decline_code = serializers.CharField(allow_null=True)
    last_error = serializers.CharField(allow_null=True)
    test_clock = serializers.CharField(allow_null=True)
    first_declined_at = serializers.DateTimeField()
    created = serializers.DateTimeField()
    ended_at = serializers.DateTimeField(allow_null=True)

    class Meta:
        ref_name = "DunningRun"


# ---------------------------------------------------------------------------------------
# Views


class DunningSettingsView(ApiView):
    @extend_schema(
        operation_id="dunning_settings_retrieve",
        summary="Retrieve the dunning policy",
        description="Defaults: retry 1, 3, 5 and 7 days after the first decline, then `unpaid`.",
        tags=["dunning"],
        responses=DunningSettingsOut,
    )
    def get(self, request):
        return Response(dunning_settings_data(services.get_settings(tenant_id=self.tenant.pk, livemode=self.livemode)))

    @extend_schema(
        operation_id="dunning_settings_update",
        summary="Change the dunning policy",
        tags=["dunning"],
        request=DunningSettingsUpdate,
        responses={200: DunningSettingsOut},
    )
    def post(self, request):
        data = self.read_body(DunningSettingsUpdate)
        policy = services.update_settings(tenant_id=self.tenant.pk, livemode=self.livemode, **data)
        return Response(dunning_settings_data(policy))


class DunningRunListView(ApiView):
    get_query = DunningRunListQuery

    @extend_schema(
        operation_id="dunning_runs_list",
        summary="List dunning runs, newest first",
        tags=["dunning"],
        responses=list_of(DunningRunOut, "DunningRunList"),
    )
    def get(self, request):
        query = self.read_query()
        runs = self.filter_by_query(self.scoped(DunningRun), query, status="status", invoice="invoice_id")
        return self.paginate(runs, dunning_run_data, query, kind="dunning_run")


class DunningRunDetailView(ApiView):
    @extend_schema(
        operation_id="dunning_runs_retrieve",
        summary="Retrieve a dunning run",
        tags=["dunning"],
        parameters=[id_path_parameter("dunning_run")],
        responses=DunningRunOut,
    )
    def get(self, request, id):
        return Response(dunning_run_data(self.get_scoped(DunningRun, id, kind="dunning_run")))
