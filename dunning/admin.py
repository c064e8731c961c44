"""Operators' admin for dunning: the policy per tenant and mode, and runs by state with their attempts.

Read-only, like every model here: runs change through the dunning loop and the API, which emit
their events. A run's payment attempts are its invoice's (the same rows the invoice page shows).
"""

from django.contrib import admin
from django.utils.html import format_html, format_html_join

from dunning.models import DunningRun, DunningSettings
from dunning.schedule import next_retry_at
from hardcount.admin import ReadOnlyAdmin, prefixed_search


@admin.register(DunningSettings)
class DunningSettingsAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "retry_days", "final_action", "updated_at")
    list_filter = ("livemode", "final_action")


@admin.register(DunningRun)
class DunningRunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "invoice",
        "status",
        "end_reason",
        "retries_done",
        "next_retry",
        "waiting_for_payment_method",
        "last_decline_code",
        "tenant",
        "livemode",
    )
    list_filter = ("status", "end_reason", "waiting_for_payment_method", "livemode")
    search_fields = ("id", "invoice__id", "invoice__customer__id", "tenant__id")
    search_help_text = "Exact run id (dun_…), invoice id (in_…), customer id (cus_…) or tenant id (ten_…)."
    readonly_fields = ("payment_attempts",)
    # Lists of many runs: the invoice (the run's str) and tenant in the same query; newest first by the
    # time-ordered primary key (an index) instead of sorting every row by created_at.
    list_select_related = ("invoice", "tenant")
    ordering = ("-pk",)

    def get_search_results(self, request, queryset, search_term):
        # Equality look-ups an index answers, instead of LIKE '%…%' over the table and its joins.
        return prefixed_search(
            queryset,
            search_term,
            {"dun_": "pk", "in_": "invoice_id", "cus_": "invoice__customer_id", "ten_": "tenant_id"},
        )

    @admin.display(description="next retry")
    def next_retry(self, run: DunningRun):
        return next_retry_at(run)

    @admin.display(description="payment attempts")
    def payment_attempts(self, run: DunningRun):
        attempts = run.invoice.payment_attempts.order_by("attempt_number")
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} {}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    a.attempt_number,
                    a.started_at,
                    a.outcome,
                    a.amount,
                    a.currency,
                    a.decline_code or "—",
                    a.payment_method or "—",
                    a.idempotency_key or "—",
                )
                for a in attempts
            ),
        )
        return format_html(
            "<table><tr><th>#</th><th>started</th><th>outcome</th><th>amount</th><th>decline code</th>"
            "<th>payment method</th><th>idempotency key</th></tr>{}</table>",
            rows,
        )
