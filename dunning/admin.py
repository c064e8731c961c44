"""Operators' admin for dunning: the policy per tenant and mode, and runs by state with their attempts.

Read-only, like every model here: runs change through the dunning loop and the API, which emit
their events. A run's payment attempts are its invoice's (the same rows the invoice page shows).
"""

from django.contrib import admin
from django.utils.html import format_html, format_html_join

from dunning.models import DunningRun, DunningSettings
from dunning.schedule import next_retry_at
from hardcount.admin import ReadOnlyAdmin, clock_time, money, prefixed_search, short_time, truncated


@admin.register(DunningSettings)
class DunningSettingsAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "retry_days", "final_action", "updated_at")
    list_filter = ("livemode", "final_action")


@admin.register(DunningRun)
class DunningRunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "invoice_label",
        "status",
        "end_reason",
        "retries",
        "next_retry",
        "waiting_for_payment_method",
        "last_decline_code",
        "tenant",
        "livemode",
    )
    list_filter = ("status", "end_reason", "waiting_for_payment_method", "livemode")
    search_fields = ("id", "invoice__id", "invoice__customer__id", "tenant__id")
    search_help_text = "Exact run id (dun_…), invoice id (in_…), customer id (cus_…) or tenant id (ten_…)."
    readonly_fields = ("schedule", "payment_attempts")
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

    def object_label(self, run: DunningRun) -> str:
        invoice = run.invoice
        return (
            f"Dunning run {run.id} · invoice {invoice.number or invoice.id} "
            f"{money(invoice.amount_due, invoice.currency)} · {run.status}"
        )

    @admin.display(description="invoice")
    def invoice_label(self, run: DunningRun) -> str:
        return f"{run.invoice.number or run.invoice_id} · {money(run.invoice.amount_due, run.invoice.currency)}"

    @admin.display(description="retries")
    def retries(self, run: DunningRun) -> str:
        return f"{run.retries_done} of {len(run.retry_days or ())}"

    @admin.display(description="next retry")
    def next_retry(self, run: DunningRun) -> str:
        return clock_time(next_retry_at(run), on_clock=bool(run.test_clock_id))

    @admin.display(description="schedule")
    def schedule(self, run: DunningRun):
        # Retry k is due schedule_anchor_at + retry_days[k-1] days (dunning/models.py).
        from datetime import timedelta

        on_clock = bool(run.test_clock_id)
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>day {}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    k,
                    days,
                    clock_time(run.schedule_anchor_at + timedelta(days=days), on_clock=on_clock),
                    "done" if k <= run.retries_done else "planned",
                )
                for k, days in enumerate(run.retry_days or (), start=1)
            ),
        )
        return format_html("<table><tr><th>retry</th><th>after</th><th>due at</th><th></th></tr>{}</table>", rows)

    @admin.display(description="payment attempts")
    def payment_attempts(self, run: DunningRun):
        attempts = run.invoice.payment_attempts.order_by("attempt_number")
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    a.attempt_number,
                    short_time(a.started_at),
                    a.outcome,
                    money(a.amount, a.currency),
                    a.decline_code or "—",
                    a.payment_method or "—",
                    truncated(a.idempotency_key, 40) or "—",
                )
                for a in attempts
            ),
        )
        return format_html(
            "<table><tr><th>#</th><th>started</th><th>outcome</th><th>amount</th><th>decline code</th>"
            "<th>payment method</th><th>idempotency key</th></tr>{}</table>",
            rows,
        )
