"""Operators' admin for billing: find failing subscriptions and invoices, and act on them through the services.

Rows are read-only here (see :mod:`hardcount.admin`); the actions call the same service
functions as the API: :func:`billing.services.drain.retry_billing`
(``POST /v1/subscriptions/{id}/retry-billing``), :func:`billing.services.catalog.cancel_subscription`,
:func:`billing.services.invoices.pay_invoice` and :func:`~billing.services.invoices.void_invoice`.
Each reports its result per row. The credit ledger is append-only: no admin can change or
delete an entry (credit moves through ``POST /v1/customers/{id}/credits``).
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import Q
from django.utils.html import format_html, format_html_join
from django.utils.text import Truncator

from billing.models import (
    BillingAttempt,
    BillingRun,
    Customer,
    GatewayAccount,
    Invoice,
    InvoiceCounter,
    InvoiceLineItem,
    LedgerEntry,
    PaymentAttempt,
    Price,
    Subscription,
    TestClock,
)
from billing.services import catalog, drain, invoices
from hardcount import audit
from hardcount.admin import ReadOnlyAdmin, ReadOnlyInline, id_link, mode_filter, prefixed_search, short_time
from hardcount.errors import ServiceError
from hardcount.money import format_amount

SCOPE_FILTERS = (mode_filter(), "tenant")
# Each action's rows are recorded in the audit log, one entry per row with its outcome (hardcount.audit).
RETRY_BILLING, CANCEL = "subscription.retry_billing", "subscription.cancel"
RETRY_PAYMENT, VOID = "invoice.retry_payment", "invoice.void"
AUDIT_ACTIONS = audit.actions(RETRY_BILLING, CANCEL, RETRY_PAYMENT, VOID)
# A search term matching more customers than this (one email in many tenants) shows their first ones.
SEARCH_CUSTOMER_LIMIT = 100


class ScopeColumns:
    """``tenant_name`` and ``mode`` list columns (short, for wide lists; needs ``tenant`` selected)."""

    @admin.display(description="tenant")
    def tenant_name(self, obj) -> str:
        return obj.tenant.name

    @admin.display(description="mode")
    def mode(self, obj) -> str:
        return "live" if obj.livemode else "test"


def _money(amount_field: str, description: str):
    def display(model_admin, obj):
        return _format(getattr(obj, amount_field), obj.currency)

    display.short_description = description
    return display


def _format(amount: int, currency: str) -> str:
    try:
        return format_amount(amount, currency)
    except (KeyError, ValueError):
        return f"{amount} {currency}"


@admin.register(Customer)
class CustomerAdmin(ReadOnlyAdmin):
    list_display = ("id", "email", "name", "external_id", "tenant", "livemode", "credit_balance", "currency")
    list_filter = SCOPE_FILTERS
    list_select_related = ("tenant",)
    search_fields = ("id",)
    search_help_text = "Exact customer id (cus_…), email (any case), external id or gateway customer id."

    def get_search_results(self, request, queryset, search_term):
        for term in search_term.split():
            queryset = queryset.filter(
                Q(pk=term) | Q(email__iexact=term) | Q(external_id=term) | Q(gateway_customer_id=term)
            )
        return queryset, False


@admin.register(Price)
class PriceAdmin(ReadOnlyAdmin):
    list_display = ("id", "nickname", "amount_display", "interval", "interval_count", "active", "tenant", "livemode")
    list_filter = (*SCOPE_FILTERS, "currency", "interval", "active")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "nickname")
    amount_display = _money("amount", "amount")


# --- subscriptions --------------------------------------------------------------------------------------------------


class BillingStateFilter(admin.SimpleListFilter):
    """``ok``, ``waiting`` (on the retry ladder) or ``parked`` — :attr:`Subscription.billing_state` as SQL.

    ``waiting`` and ``parked`` are answered by the partial indexes ``subscription_waiting_idx``
    and ``subscription_parked_idx``; ``ok`` is nearly every row, read in primary-key order.
    """

    title = "billing state"
    parameter_name = "billing_state"
    PREDICATES = {
        "ok": Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=True),
        "waiting": Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=False),
        "parked": Q(billing_parked_at__isnull=False),
    }

    def lookups(self, request, model_admin):
        return (("ok", "ok"), ("waiting", "waiting (retry ladder)"), ("parked", "parked"))

    def queryset(self, request, queryset):
        predicate = self.PREDICATES.get(self.value())
        return queryset if predicate is None else queryset.filter(predicate)


class SubscriptionInvoiceInline(ReadOnlyInline):
    model = Invoice
    fk_name = "subscription"
    verbose_name_plural = "invoices (newest 50)"
    fields = (
        "row_link",
        "number",
        "status",
        "tax_status",
        "period_start",
        "period_end",
        "total_display",
        "amount_due_display",
    )
    readonly_fields = fields
    total_display = _money("total", "total")
    amount_due_display = _money("amount_due", "amount due")


class SubscriptionBillingAttemptInline(ReadOnlyInline):
    model = BillingAttempt
    verbose_name_plural = "billing attempts (newest 50)"
    fields = ("row_link", "created_at", "run_link", "outcome", "failure_number", "invoice_link", "error")
    readonly_fields = fields

    @admin.display(description="run")
    def run_link(self, attempt: BillingAttempt):
        return id_link(BillingRun, attempt.run_id)

    @admin.display(description="invoice")
    def invoice_link(self, attempt: BillingAttempt):
        return id_link(Invoice, attempt.invoice_id)


@admin.register(Subscription)
class SubscriptionAdmin(ScopeColumns, ReadOnlyAdmin):
    """Subscriptions by tenant, mode, status and billing state; retry billing and cancel as actions."""

    list_display = (
        "id",
        "customer_email",
        "plan",
        "status",
        "billing_state_display",
        "next_billing",
        "failures",
        "next_attempt",
        "last_error",
        "tenant_name",
        "mode",
    )
    list_filter = (*SCOPE_FILTERS, "status", BillingStateFilter)
    list_select_related = ("customer", "price", "tenant")
    # Every other column would sort the whole table: lists stay in primary-key (creation) order.
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact subscription id (sub_…), or a customer's id, email (any case) or external id."
    actions = ["retry_billing", "cancel_now", "cancel_at_period_end"]
    object_actions = (
        ("retry_billing", "Retry billing now"),
        ("cancel_now", "Cancel now"),
        ("cancel_at_period_end", "Cancel at period end"),
    )
    inlines = [SubscriptionInvoiceInline, SubscriptionBillingAttemptInline]
    fieldsets = (
        (None, {"fields": ("id", "tenant", "livemode", "customer", "price", "status", "test_clock", "metadata")}),
        (
            "Billing failure state",
            {
                "fields": (
                    "billing_state_display",
                    "billing_failure_count",
                    "next_billing_attempt_at",
                    "billing_parked_at",
                    "last_billing_error",
                )
            },
        ),
        ("Payment attempts (newest 50)", {"fields": ("payment_attempts",)}),
        (
            "Billing periods",
            {
                "fields": (
                    "billing_cycle_anchor",
                    "trial_end",
                    "current_period_start",
                    "current_period_end",
                    "periods_billed",
                    "next_billing_at",
                    "cancel_at_period_end",
                    "canceled_at",
                    "ended_at",
                )
            },
        ),
        (None, {"fields": ("created_at", "updated_at")}),
    )
    readonly_fields = ("billing_state_display", "payment_attempts")

    def object_action_applies(self, sub: Subscription, action: str) -> bool:
        if action == "retry_billing":
            return sub.billing_state != "ok" and sub.status in Subscription.BILLABLE_STATUSES
        if action == "cancel_at_period_end":
            return sub.status != Subscription.CANCELED and not sub.cancel_at_period_end
        return sub.status != Subscription.CANCELED

    @admin.display(description="customer")
    def customer_email(self, sub: Subscription) -> str:
        return sub.customer.email

    @admin.display(description="plan")
    def plan(self, sub: Subscription) -> str:
        price = sub.price
        every = price.interval if price.interval_count == 1 else f"{price.interval_count} {price.interval}s"
        return f"{_format(price.amount, price.currency)} / {every}"

    @admin.display(description="billing state")
    def billing_state_display(self, sub: Subscription) -> str:
        return sub.billing_state

    @admin.display(description="next billing")
    def next_billing(self, sub: Subscription) -> str:
        return short_time(sub.next_billing_at)

    @admin.display(description="failures")
    def failures(self, sub: Subscription) -> int:
        return sub.billing_failure_count

    @admin.display(description="next attempt")
    def next_attempt(self, sub: Subscription) -> str:
        return short_time(sub.next_billing_attempt_at)

    @admin.display(description="last error")
    def last_error(self, sub: Subscription):
        if not sub.last_billing_error:
            return ""
        return format_html(
            '<span title="{}">{}</span>', sub.last_billing_error, Truncator(sub.last_billing_error).chars(60)
        )

    @admin.display(description="payment attempts")
    def payment_attempts(self, sub: Subscription):
        attempts = PaymentAttempt.objects.filter(invoice__subscription=sub).order_by("-started_at")[:50]
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    short_time(a.started_at),
                    id_link(Invoice, a.invoice_id),
                    a.attempt_number,
                    a.outcome,
                    _format(a.amount, a.currency),
                    a.decline_code or a.error_message or "—",
                    a.payment_intent_id or "—",
                )
                for a in attempts
            ),
        )
        if not rows:
            return "none"
        return format_html(
            "<table><tr><th>started</th><th>invoice</th><th>#</th><th>outcome</th><th>amount</th>"
            "<th>decline / error</th><th>PaymentIntent</th></tr>{}</table>",
            rows,
        )

    def get_search_results(self, request, queryset, search_term):
        # Two indexed look-ups (customers by id, email or external id; then subscriptions by id or
        # customer) instead of an OR across a join, which PostgreSQL answers with a full scan.
        for term in search_term.split():
            if term.startswith("sub_"):
                queryset = queryset.filter(pk=term)
                continue
            customer_ids = list(
                Customer.objects.filter(Q(pk=term) | Q(email__iexact=term) | Q(external_id=term)).values_list(
                    "pk", flat=True
                )[:SEARCH_CUSTOMER_LIMIT]
            )
            queryset = queryset.filter(Q(pk=term) | Q(customer_id__in=customer_ids))
        return queryset, False

    @admin.action(description="Retry billing now (waiting or parked subscriptions)", permissions=["operate"])
    def retry_billing(self, request, queryset):
        """One manual billing run per subscription, as ``POST /v1/subscriptions/{id}/retry-billing``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        for sub in rows:
            try:
                attempt = drain.retry_billing(sub.id, tenant_id=sub.tenant_id, livemode=sub.livemode)
            except ServiceError as exc:
                self.message_user(request, f"{sub.id}: not retried. {exc.message}", messages.WARNING)
                self.record_action(request, RETRY_BILLING, sub, f"Refused: {exc.message}")
                continue
            message, level = _retry_result(sub, attempt)
            self.message_user(request, message, level)
            self.record_action(request, RETRY_BILLING, sub, message)
        return self.after_action(request, rows)

    @admin.action(description="Cancel now (nothing more is billed)", permissions=["operate"])
    def cancel_now(self, request, queryset):
        return self._cancel(request, queryset, at_period_end=False, action="cancel_now")

    @admin.action(description="Cancel at the end of the current period", permissions=["operate"])
    def cancel_at_period_end(self, request, queryset):
        return self._cancel(request, queryset, at_period_end=True, action="cancel_at_period_end")

    def _cancel(self, request, queryset, *, at_period_end: bool, action: str):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        when = "at the end of their current period" if at_period_end else "now"
        confirmation = self.confirm_action(
            request,
            rows,
            action=action,
            question=f"Cancel {len(rows)} subscription(s) {when}?",
            consequence="Each cancellation emits its event to the tenant's webhooks; it cannot be undone here.",
        )
        if confirmation is not None:
            return confirmation
        for sub in rows:
            try:
                catalog.cancel_subscription(
                    tenant_id=sub.tenant_id, livemode=sub.livemode, subscription_id=sub.id, at_period_end=at_period_end
                )
            except ServiceError as exc:
                self.message_user(request, f"{sub.id}: not canceled. {exc.message}", messages.WARNING)
                self.record_action(request, CANCEL, sub, f"Cancel {when} refused: {exc.message}")
                continue
            self.message_user(request, f"{sub.id}: canceled {when}.", messages.SUCCESS)
            self.record_action(request, CANCEL, sub, f"Canceled {when}.")
        return self.after_action(request, rows)


def _retry_result(sub: Subscription, attempt: BillingAttempt) -> tuple[str, int]:
    """The per-row message of a billing retry and its level."""
    invoice = f" (invoice {attempt.invoice_id})" if attempt.invoice_id else ""
    if attempt.outcome == BillingAttempt.BILLED:
        return f"{sub.id}: billed{invoice}; failure state cleared.", messages.SUCCESS
    if attempt.outcome == BillingAttempt.DECLINED:
        return f"{sub.id}: the charge was declined{invoice}; dunning retries it.", messages.WARNING
    if attempt.outcome == BillingAttempt.TAX_PENDING:
        return f"{sub.id}: invoiced{invoice}; waiting for tax, charged when tax answers.", messages.INFO
    if attempt.outcome == BillingAttempt.FAILED:
        sub.refresh_from_db(fields=["next_billing_attempt_at"])
        return (
            f"{sub.id}: failed again (failure {attempt.failure_number}, next attempt at "
            f"{sub.next_billing_attempt_at:%Y-%m-%d %H:%M} UTC): {attempt.error}",
            messages.ERROR,
        )
    return f"{sub.id}: {attempt.outcome}. {attempt.error}".strip(), messages.INFO


# --- invoices -------------------------------------------------------------------------------------------------------


class LineItemInline(ReadOnlyInline):
    model = InvoiceLineItem
    fields = ("description", "price", "quantity", "amount", "currency", "period_start", "period_end")
    ordering = ("pk",)


class PaymentAttemptInline(ReadOnlyInline):
    model = PaymentAttempt
    fields = (
        "row_link",
        "attempt_number",
        "outcome",
        "amount",
        "currency",
        "decline_code",
        "error_message",
        "payment_intent_id",
        "started_at",
        "completed_at",
    )
    readonly_fields = fields


@admin.register(Invoice)
class InvoiceAdmin(ScopeColumns, ReadOnlyAdmin):
    """Invoices by tenant, mode, status and tax status; retry payment and void as actions."""

    list_display = (
        "id",
        "number",
        "customer_email",
        "status",
        "tax_status",
        "total_display",
        "amount_due_display",
        "period",
        "tenant_name",
        "mode",
    )
    list_filter = (*SCOPE_FILTERS, "status", "tax_status")
    list_select_related = ("customer", "tenant")
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact invoice id (in_…), number, customer id (cus_…), subscription id (sub_…) or PaymentIntent."
    inlines = [LineItemInline, PaymentAttemptInline]
    actions = ["retry_payment", "void"]
    object_actions = (("retry_payment", "Retry payment now"), ("void", "Void"))
    total_display = _money("total", "total")
    amount_due_display = _money("amount_due", "amount due")

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset,
            search_term,
            {"in_": "pk", "cus_": "customer_id", "sub_": "subscription_id", "pi_": "payment_intent_id"},
            default="number",
        )

    def object_action_applies(self, invoice: Invoice, action: str) -> bool:
        if action == "retry_payment":
            return invoice.status == Invoice.OPEN
        return invoice.status in (Invoice.DRAFT, Invoice.OPEN)

    @admin.display(description="customer")
    def customer_email(self, invoice: Invoice) -> str:
        return invoice.customer.email

    @admin.display(description="period start")
    def period(self, invoice: Invoice) -> str:
        return short_time(invoice.period_start)

    @admin.action(description="Retry payment now (open invoices)", permissions=["operate"])
    def retry_payment(self, request, queryset):
        """Charge each open invoice now, as ``POST /v1/invoices/{id}/pay``."""
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        for invoice in rows:
            try:
                paid, attempt, _outcome = invoices.pay_invoice(
                    invoice.id, tenant_id=invoice.tenant_id, livemode=invoice.livemode
                )
            except ServiceError as exc:
                self.message_user(request, f"{invoice.id}: not charged. {exc.message}", messages.WARNING)
                self.record_action(request, RETRY_PAYMENT, invoice, f"Refused: {exc.message}")
                continue
            message, level = _payment_result(paid, attempt)
            self.message_user(request, message, level)
            self.record_action(request, RETRY_PAYMENT, invoice, message)
        return self.after_action(request, rows)

    @admin.action(description="Void (draft or open invoices)", permissions=["operate"])
    def void(self, request, queryset):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        confirmation = self.confirm_action(
            request,
            rows,
            action="void",
            question=f"Void {len(rows)} invoice(s)?",
            consequence="Credit applied to them returns to the customer and their dunning stops. A subscription "
            "still on a voided invoice's period is invoiced afresh by the next drain.",
        )
        if confirmation is not None:
            return confirmation
        for invoice in rows:
            try:
                invoices.void_invoice(invoice.id, tenant_id=invoice.tenant_id, livemode=invoice.livemode)
            except ServiceError as exc:
                self.message_user(request, f"{invoice.id}: not voided. {exc.message}", messages.WARNING)
                self.record_action(request, VOID, invoice, f"Refused: {exc.message}")
                continue
            self.message_user(request, f"{invoice.id}: voided.", messages.SUCCESS)
            self.record_action(request, VOID, invoice, "Voided.")
        return self.after_action(request, rows)


def _payment_result(invoice: Invoice, attempt: PaymentAttempt | None) -> tuple[str, int]:
    """The per-row message of a payment retry and its level."""
    if invoice.status == Invoice.PAID:
        how = "without a charge" if attempt is None or attempt.settled_without_charge else "charged"
        return f"{invoice.id}: paid ({how}).", messages.SUCCESS
    if attempt is not None and attempt.outcome == PaymentAttempt.DECLINED:
        return f"{invoice.id}: declined ({attempt.decline_code or 'no code'}).", messages.WARNING
    detail = f"{attempt.outcome}: {attempt.error_message}" if attempt is not None else invoice.status
    return f"{invoice.id}: not paid ({detail}).", messages.ERROR


@admin.register(InvoiceLineItem)
class InvoiceLineItemAdmin(ReadOnlyAdmin):
    list_display = ("id", "invoice", "description", "amount", "currency")
    list_select_related = ("invoice",)
    search_fields = ("id",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"il_": "pk", "in_": "invoice_id"})


@admin.register(InvoiceCounter)
class InvoiceCounterAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "last_number")
    list_select_related = ("tenant",)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    """The credit ledger: append-only, so no change, no delete, not even for superusers
    (docs/reference/domain.md#credit-ledger)."""

    list_display = ("id", "created_at", "customer", "reason", "amount_display", "balance_display", "invoice")
    list_filter = (*SCOPE_FILTERS, "reason")
    list_select_related = ("customer", "invoice")
    search_fields = ("id",)
    search_help_text = "Exact entry id (cbtxn_…), customer id (cus_…) or invoice id (in_…)."
    amount_display = _money("amount", "amount")
    balance_display = _money("balance_after", "balance after")

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"cbtxn_": "pk", "cus_": "customer_id", "in_": "invoice_id"})

    def get_actions(self, request):
        return {}


@admin.register(PaymentAttempt)
class PaymentAttemptAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "started_at",
        "invoice",
        "attempt_number",
        "outcome",
        "amount_display",
        "decline_code",
        "payment_intent_id",
    )
    list_filter = (*SCOPE_FILTERS, "outcome")
    list_select_related = ("invoice",)
    search_fields = ("id",)
    search_help_text = "Exact attempt id (pa_…), invoice id (in_…), PaymentIntent (pi_…) or idempotency key."
    amount_display = _money("amount", "amount")

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset,
            search_term,
            {"pa_": "pk", "in_": "invoice_id", "pi_": "payment_intent_id"},
            default="idempotency_key",
        )


# --- billing runs ---------------------------------------------------------------------------------------------------


class RunAttemptInline(ReadOnlyInline):
    model = BillingAttempt
    verbose_name_plural = "attempts (first 50; the run's full list is linked above)"
    fields = ("row_link", "created_at", "subscription_link", "outcome", "failure_number", "invoice_link", "error")
    readonly_fields = fields
    ordering = ("pk",)

    @admin.display(description="subscription")
    def subscription_link(self, attempt: BillingAttempt):
        return id_link(Subscription, attempt.subscription_id)

    @admin.display(description="invoice")
    def invoice_link(self, attempt: BillingAttempt):
        return id_link(Invoice, attempt.invoice_id)


@admin.register(BillingRun)
class BillingRunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "trigger",
        "status",
        "tenant",
        "livemode",
        "started_at",
        "duration",
        "pages",
        "attempted",
        "billed",
        "failed",
    )
    list_filter = ("trigger", "status", mode_filter(), "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id",)
    inlines = [RunAttemptInline]
    readonly_fields = ("all_attempts",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"brun_": "pk", "ten_": "tenant_id"})

    @admin.display(description="duration")
    def duration(self, run: BillingRun) -> str:
        if run.finished_at is None:
            return "running"
        return f"{(run.finished_at - run.started_at).total_seconds():.1f} s"

    @admin.display(description="attempts")
    def all_attempts(self, run: BillingRun):
        from django.urls import reverse

        url = reverse("admin:billing_billingattempt_changelist") + f"?run__id__exact={run.pk}"
        return format_html('<a href="{}">all {} attempts of this run</a>', url, run.attempted)


@admin.register(BillingAttempt)
class BillingAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "created_at", "run_link", "subscription_link", "outcome", "failure_number", "error")
    list_filter = ("outcome",)
    search_fields = ("id",)
    search_help_text = "Exact attempt id (batt_…), run id (brun_…) or subscription id (sub_…)."

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"batt_": "pk", "brun_": "run_id", "sub_": "subscription_id"})

    @admin.display(description="run")
    def run_link(self, attempt: BillingAttempt):
        return id_link(BillingRun, attempt.run_id)

    @admin.display(description="subscription")
    def subscription_link(self, attempt: BillingAttempt):
        return id_link(Subscription, attempt.subscription_id)


@admin.register(TestClock)
class TestClockAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "frozen_time", "status", "tenant")
    list_filter = ("status", "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "name")


@admin.register(GatewayAccount)
class GatewayAccountAdmin(ReadOnlyAdmin):
    """A tenant's own Stripe account, without its secrets: the key masked, the signing secret never shown."""

    fields = ("id", "tenant", "livemode", "key_hint", "connect_account", "slug", "created_at", "updated_at")
    list_display = ("id", "tenant", "livemode", "key_hint", "connect_account", "updated_at")
    list_filter = ("livemode",)
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "tenant__id__exact", "connect_account__exact")
