"""Billing runs over HTTP: drain now (in the background), run history, retry-billing, a subscription's billing attempts.

A tenant sees its own runs (``POST /v1/billing/run``, test-clock advances) and the scheduler's
runs over all tenants that attempted at least one of its subscriptions, with counts restricted
to its own subscriptions (:func:`billing.representations.billing_run_data`).
"""

from __future__ import annotations

from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from billing.api import schemas as s
from billing.models import BillingAttempt, BillingRun, Subscription
from billing.representations import billing_attempt_data, billing_run_data
from billing.services.drain import retry_billing
from billing.services.manual_runs import resume_if_stalled, start_manual_run
from hardcount.api import ApiView, id_path_parameter, is_id, list_of
from hardcount.errors import ResourceMissing


def _render_run(run: BillingRun) -> dict:
    counts = None
    if run.tenant_id is None and hasattr(run, "t_attempted"):
        counts = {"attempted": run.t_attempted, "billed": run.t_billed, "failed": run.t_failed}
    return billing_run_data(run, counts)


class _RunsMixin:
    def visible_runs(self) -> QuerySet:
        """The caller's runs and the scheduler runs that touched its subscriptions, with its own counts."""
        mine = Q(attempts__subscription__tenant_id=self.tenant.pk)
        touched = Exists(BillingAttempt.objects.filter(run=OuterRef("pk"), subscription__tenant_id=self.tenant.pk))
        return (
            BillingRun.objects.filter(livemode=self.livemode)
            .filter(Q(tenant_id=self.tenant.pk) | (Q(tenant__isnull=True) & touched))
            .annotate(
                t_attempted=Count("attempts", filter=mine),
                t_billed=Count("attempts", filter=mine & Q(attempts__outcome__in=BillingAttempt.COUNTED_AS_BILLED)),
                t_failed=Count("attempts", filter=mine & Q(attempts__outcome=BillingAttempt.Outcome.FAILED)),
            )
        )

    def get_run(self, run_id: str, *, param: str | None = None) -> BillingRun:
        if not is_id("billing_run", run_id):
            raise ResourceMissing(f"No such billing run: '{run_id}'.", param=param)
        run = self.visible_runs().filter(pk=run_id).first()
        if run is None:
            raise ResourceMissing(f"No such billing run: '{run_id}'.", param=param)
        return run


class BillingRunCreateView(ApiView):
    @extend_schema(
        operation_id="billing_run_create",
        summary="Bill your due subscriptions now",
        description="Starts draining the calling tenant's due subscriptions of the key's mode and returns the run at "
        "once, `running`; the drain goes on in the background, page after page. Retrieve the run to follow its "
        "counts (saved after every page) until it is `completed` (or `failed`). While a run of the tenant and mode is "
        "`running`, this returns that run instead of starting another. Subscriptions waiting on the retry ladder, "
        "parked ones, and ones on a test clock are not billed (advance the clock instead).",
        tags=["billing"],
        request=s.Empty,
        responses={200: s.BillingRun},
    )
    def post(self, request):
        self.read_body(s.Empty)
        run, _ = start_manual_run(tenant_id=self.tenant.pk, livemode=self.livemode)
        return Response(billing_run_data(run))


class BillingRunListView(_RunsMixin, ApiView):
    get_query = s.BillingRunListQuery

    @extend_schema(
        operation_id="billing_runs_list",
        summary="List billing runs, newest first",
        tags=["billing"],
        responses=list_of(s.BillingRun, "BillingRunList"),
    )
    def get(self, request):
        query = self.read_query()
        runs = self.visible_runs()
        return self.paginate(runs, _render_run, query, kind="billing_run", cursor_scope=runs)


class BillingRunDetailView(_RunsMixin, ApiView):
    @extend_schema(
        operation_id="billing_runs_retrieve",
        summary="Retrieve a billing run",
        tags=["billing"],
        parameters=[id_path_parameter("billing_run")],
        responses=s.BillingRun,
    )
    def get(self, request, id):
        run = self.get_run(id)
        # A client polling a manual run whose process died carries it on (billing/services/manual_runs.py).
        resume_if_stalled(run)
        return Response(_render_run(run))


class SubscriptionRetryBillingView(ApiView):
    @extend_schema(
        operation_id="subscriptions_retry_billing",
        summary="Retry billing a failing subscription now",
        description="For a subscription waiting on the retry ladder or parked after eight failures: clears its "
        "failure state and attempts billing once, now, as a one-subscription manual run. A failure starts the "
        "ladder afresh. 409 when the subscription is neither waiting nor parked.",
        tags=["billing"],
        request=s.Empty,
        parameters=[id_path_parameter("subscription")],
        responses={200: s.BillingAttempt},
    )
    def post(self, request, id):
        self.read_body(s.Empty)
        subscription = self.get_scoped(Subscription, id, kind="subscription")
        attempt = retry_billing(subscription.pk, tenant_id=self.tenant.pk, livemode=self.livemode)
        return Response(billing_attempt_data(attempt))


class SubscriptionBillingAttemptsView(ApiView):
    get_query = s.BillingAttemptListQuery

    @extend_schema(
        operation_id="subscriptions_billing_attempts",
        summary="List a subscription's billing attempts, newest first",
        tags=["billing"],
        parameters=[id_path_parameter("subscription")],
        responses=list_of(s.BillingAttempt, "BillingAttemptList"),
    )
    def get(self, request, id):
        query = self.read_query()
        subscription = self.get_scoped(Subscription, id, kind="subscription")
        attempts = BillingAttempt.objects.filter(subscription=subscription)
        return self.paginate(attempts, billing_attempt_data, query, kind="billing_attempt", cursor_scope=attempts)
