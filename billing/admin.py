"""Operators' admin for billing: find failing subscriptions and invoices, and act on them through the services.

Rows are read-only here (see :mod:`hardcount.admin`); the actions call the same service
functions as the API: :func:`billing.services.drain.retry_billing`
(``POST /v1/subscriptions/{id}/retry-billing``), :func:`billing.services.changes.cancel_subscription`,
:func:`billing.services.invoices.pay_invoice` and :func:`~billing.services.invoices.void_invoice`.
Each reports its result per row. The credit ledger is append-only: no admin can change or
delete an entry (credit moves through ``POST /v1/customers/{id}/credits``).
"""

from __future__ import annotations

import re

from django.contrib import admin, messages
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import Q
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from billing.admin_changes import SubscriptionChangeActions
from billing.admin_usage import customer_usage, invoice_usage
from billing.models import (
    BillingAttempt,
    BillingRun,
    Coupon,
    Customer,
    Discount,
    GatewayAccount,
    Invoice,
    InvoiceCounter,
    InvoiceItem,
    InvoiceLineItem,
    LedgerEntry,
    Meter,
    PaymentAttempt,
    Price,
    StripeEvent,
    Subscription,
    SubscriptionItem,
    TestClock,
)
from billing.models.subscriptions import BILLING_STATE_FILTERS
from billing.services import changes, drain, invoices
from dunning.schedule import next_retry_at
from hardcount import audit
from hardcount.admin import (
    ReadOnlyAdmin,
    ReadOnlyInline,
    clock_time,
    id_link,
    mode_filter,
    money,
    prefixed_search,
    price_label,
    short_id,
    short_time,
    truncated,
)
from hardcount.errors import ServiceError
from outbox.services import EVENT_TYPES, events_with_deliveries

SCOPE_FILTERS = (mode_filter(), "tenant")
# Each action's rows are recorded in the audit log, one entry per row with its outcome (hardcount.audit).
RETRY_BILLING, CANCEL = "subscription.retry_billing", "subscription.cancel"
RETRY_PAYMENT, VOID = "invoice.retry_payment", "invoice.void"
AUDIT_ACTIONS = audit.actions(RETRY_BILLING, CANCEL, RETRY_PAYMENT, VOID)
# A search term matching more customers than this (one email in many tenants) shows their first ones.
SEARCH_CUSTOMER_LIMIT = 100


class ScopeColumns:
    """``tenant_name`` and ``mode`` list columns, and ``scope`` (the two in one); need ``tenant`` selected."""

    @admin.display(description="tenant")
    def tenant_name(self, obj) -> str:
        return obj.tenant.name

    @admin.display(description="mode")
    def mode(self, obj) -> str:
        return "live" if obj.livemode else "test"

    @admin.display(description="tenant · mode")
    def scope(self, obj) -> str:
        return f"{obj.tenant.name} · {'live' if obj.livemode else 'test'}"


def _money(amount_field: str, description: str):
    """A display column of ``amount_field`` in the row's ``currency``, formatted by :func:`hardcount.admin.money`."""

    def display(model_admin, obj):
        return money(getattr(obj, amount_field), obj.currency)

    display.short_description = description
    return display


def subscription_label(sub: Subscription) -> str:
    """``Subscription sub_… · ada@example.com · $15.00 / month · past_due``."""
    return f"Subscription {sub.id} · {sub.customer.email} · {_plan(sub.price)} · {sub.status}"


def invoice_label(invoice: Invoice) -> str:
    """``Invoice INV-0042 · $15.00 · open`` (the id when the invoice has no number yet, as a draft)."""
    return f"Invoice {invoice.number or invoice.id} · {money(invoice.total, invoice.currency)} · {invoice.status}"


def _plan(price: Price) -> str:
    label = price_label(price.amount, price.currency, price.interval, price.interval_count)
    if not price.is_metered:
        return label
    how = f"tiered ({price.tiers_mode})" if price.billing_scheme == Price.TIERED else f"{label} per unit"
    return f"metered, in arrears: {how}, meter {price.meter_id}"


# The gateway's words for "I do not know this object" (Stripe's and localstripe's spellings).
_UNKNOWN_OBJECT = re.compile(r"No such (?P<kind>[A-Za-z_ ]+?)\s*[:=]?\s*'?(?P<id>[a-z]+_[A-Za-z0-9]+)'?", re.IGNORECASE)
_KINDS = {"paymentmethod": "payment method", "payment_method": "payment method", "payment method": "payment method"}


def explain_error(error: str, *, unattached_payment_method: str = "") -> str:
    """A billing or payment error in an operator's words, from the text the services stored.

    ``error: InvalidRequestError (404): No such PaymentMethod: 'pm_1'`` → ``the gateway does not know
    payment method pm_1``. A bare 404 names its object from ``unattached_payment_method``: the charge
    first attaches a payment method the customer's gateway record lacks, so a 404 then is that payment
    method unknown to the gateway. A transport failure, a 429 or a 5xx → the gateway did not answer or
    was failing (the retry ladder charges again); a decline → the card's decline code; a database or
    tax failure likewise. Returns ``""`` for no error; unknown texts are returned as they are.
    """
    if not error:
        return ""
    found = _UNKNOWN_OBJECT.search(error)
    if found:
        kind = found["kind"].strip()
        return f"the gateway does not know {_KINDS.get(kind.lower(), kind.lower())} {found['id']}"
    status = re.search(r"\((\d{3})\)", error)
    code = int(status[1]) if status else None
    if code == 404:
        if unattached_payment_method:
            return f"the gateway does not know payment method {unattached_payment_method} (404 when attaching it)"
        return "the gateway does not know an object this charge names (404): its customer or payment method"
    if error.startswith("declined: "):
        return f"the card was declined ({error.removeprefix('declined: ')})"
    if error.startswith("unknown") or "APIConnectionError" in error or "Timeout" in error:
        return "the gateway gave no answer (network or timeout); the charge is looked up before it is sent again"
    if code == 429:
        return "the gateway was rate limiting (429); the retry ladder charges again"
    if code is not None and code >= 500:
        return f"the gateway was failing (HTTP {code}); the retry ladder charges again"
    if code in (401, 403):
        return f"the gateway refused our credentials (HTTP {code}): check the tenant's gateway account"
    if error.startswith("database: "):
        return "the database failed during the close; the retry ladder closes it again"
    if error.startswith("tax provider"):
        return "the tax provider did not answer; the invoice waits as a draft"
    return error


@admin.register(Customer)
class CustomerAdmin(ScopeColumns, ReadOnlyAdmin):
    list_display = ("id", "email", "name", "external_id", "credit", "scope")
    list_filter = SCOPE_FILTERS
    list_select_related = ("tenant",)
    readonly_fields = ("credit", "usage_by_period")

    def object_label(self, customer: Customer) -> str:
        return f"Customer {customer.email} ({customer.id})"

    def object_links(self, customer: Customer) -> list[tuple[str, str]]:
        url = reverse("admin:billing_invoiceitem_changelist") + f"?customer={customer.pk}&state=pending"
        return [(url, "Its pending invoice items")]

    @admin.display(description="credit balance")
    def credit(self, customer: Customer) -> str:
        return money(customer.credit_balance, customer.currency) if customer.currency else "—"

    @admin.display(description="usage by period")
    def usage_by_period(self, customer: Customer):
        return customer_usage(customer)

    search_fields = ("id",)
    search_help_text = "Exact customer id (cus_…), email (any case), external id or gateway customer id."

    def get_search_results(self, request, queryset, search_term):
        for term in search_term.split():
            queryset = queryset.filter(
                Q(pk=term) | Q(email__iexact=term) | Q(external_id=term) | Q(gateway_customer_id=term)
            )
        return queryset, False


@admin.register(Price)
class PriceAdmin(ScopeColumns, ReadOnlyAdmin):
    list_display = ("id", "nickname", "price", "active", "scope")
    list_filter = (*SCOPE_FILTERS, "currency", "interval", "active")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "nickname")
    readonly_fields = ("price",)

    def object_label(self, price: Price) -> str:
        return f"Price {_plan(price)}" + (f" “{price.nickname}”" if price.nickname else "") + f" ({price.id})"

    @admin.display(description="price")
    def price(self, price: Price) -> str:
        return _plan(price)


@admin.register(Meter)
class MeterAdmin(ScopeColumns, ReadOnlyAdmin):
    """Meters, read-only: the event name each counts and how (docs/reference/usage-billing.md)."""

    list_display = ("id", "display_name", "event_name", "formula", "customer_key", "value_key", "scope")
    list_filter = (*SCOPE_FILTERS, "formula")
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "event_name__exact")

    def object_label(self, meter: Meter) -> str:
        return f"Meter “{meter.display_name}” · {meter.formula} of {meter.event_name} ({meter.id})"


# --- subscriptions --------------------------------------------------------------------------------------------------


class BillingStateFilter(admin.SimpleListFilter):
    """``ok``, ``waiting`` (on the retry ladder), ``parked`` or ``paused`` — :attr:`Subscription.billing_state` as SQL.

    ``waiting``, ``parked`` and ``paused`` are answered by the partial indexes ``subscription_waiting_idx``,
    ``subscription_parked_idx`` and ``subscription_paused_idx``; ``ok`` is nearly every row, read in
    primary-key order.
    """

    title = "billing state"
    parameter_name = "billing_state"
    PREDICATES = BILLING_STATE_FILTERS

    def lookups(self, request, model_admin):
        return (
            ("ok", "ok"),
            ("waiting", "waiting (retry ladder)"),
            ("parked", "parked"),
            ("paused", "paused (collection)"),
        )

    def queryset(self, request, queryset):
        predicate = self.PREDICATES.get(self.value())
        return queryset if predicate is None else queryset.filter(predicate)


class SubscriptionInvoiceInline(ReadOnlyInline):
    model = Invoice
    fk_name = "subscription"
    verbose_name_plural = "invoices (newest 50)"
    fields = ("row_link", "number", "status", "tax_status", "period", "total_display", "amount_due_display")
    readonly_fields = fields
    total_display = _money("total", "total")
    amount_due_display = _money("amount_due", "amount due")

    @admin.display(description="billing period")
    def period(self, invoice: Invoice) -> str:
        return f"{short_time(invoice.period_start)} → {short_time(invoice.period_end)}"


class SubscriptionBillingAttemptInline(ReadOnlyInline):
    model = BillingAttempt
    verbose_name_plural = "billing attempts (newest 50)"
    fields = ("row_link", "created", "run_link", "outcome", "failure_number", "invoice_link", "error_explained")
    readonly_fields = fields

    @admin.display(description="at")
    def created(self, attempt: BillingAttempt) -> str:
        return short_time(attempt.created_at)

    @admin.display(description="run")
    def run_link(self, attempt: BillingAttempt):
        return id_link(BillingRun, attempt.run_id)

    @admin.display(description="invoice")
    def invoice_link(self, attempt: BillingAttempt):
        return id_link(Invoice, attempt.invoice_id)

    @admin.display(description="error")
    def error_explained(self, attempt: BillingAttempt):
        # The inline's rows carry their parent subscription (and so its customer) already.
        unattached = _unattached(attempt.subscription.customer) if attempt.error else ""
        return truncated(explain_error(attempt.error, unattached_payment_method=unattached), 90)


def _attempt_error(attempt: PaymentAttempt) -> str:
    """The attempt's error in words; a 404 names the attempt's payment method when the gateway never took it."""
    if not attempt.error_message:
        return ""
    customer = attempt.invoice.customer
    return explain_error(attempt.error_message, unattached_payment_method=_unattached(customer, attempt.payment_method))


def _payment_attempts_table(attempts) -> str:
    """An HTML table of payment attempts (newest first as given), amounts formatted, errors explained."""
    rows = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (
                short_time(a.started_at),
                id_link(Invoice, a.invoice_id),
                a.attempt_number,
                a.outcome,
                money(a.amount, a.currency),
                truncated(a.decline_code or _attempt_error(a) or "—", 70),
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


def _unattached(customer: Customer, payment_method: str | None = None) -> str:
    """The payment method a charge of ``customer`` attaches first ("" when it is attached already)."""
    payment_method = customer.default_payment_method if payment_method is None else payment_method
    return payment_method if payment_method and payment_method != customer.gateway_payment_method else ""


def _unattached_payment_method(sub: Subscription) -> str:
    """The payment method the subscription's last charge attempt tried to attach, if the gateway never took it."""
    attempt = PaymentAttempt.objects.filter(invoice__subscription=sub).order_by("-started_at").first()
    return _unattached(sub.customer, attempt.payment_method if attempt else None)


def _dunning_run(invoice: Invoice):
    """The invoice's dunning run, or None (by the reverse relation: billing imports no dunning model)."""
    try:
        return invoice.dunning_run
    except ObjectDoesNotExist:
        return None


def _dunning_summary(run) -> str:
    """A dunning run in one paragraph: state, retries done of planned, next retry or why none, last decline."""
    if run is None:
        return "none"
    planned = len(run.retry_days or ())
    if run.status != "active":
        state = f"{run.status} ({run.end_reason or 'no reason recorded'}) at {short_time(run.ended_at)}"
    elif run.waiting_for_payment_method:
        state = "active, waiting for the customer's new payment method (a hard decline)"
    else:
        next_at = next_retry_at(run)
        state = (
            f"active, next retry at {clock_time(next_at, on_clock=bool(run.test_clock_id))}"
            if next_at
            else ("active, no retry left: its end state is due")
        )
    steps = ", ".join(f"day {d}" for d in run.retry_days or ()) or "none"
    return format_html(
        "{} — {}; retries done {} of {} (schedule: {} after {}); last decline: {}{}",
        id_link(type(run), run.pk),
        state,
        run.retries_done,
        planned,
        steps,
        short_time(run.schedule_anchor_at),
        run.last_decline_code or "—",
        f"; last error: {explain_error(run.last_error)}" if run.last_error else "",
    )


@admin.register(Subscription)
class SubscriptionAdmin(SubscriptionChangeActions, ScopeColumns, ReadOnlyAdmin):
    """Subscriptions by tenant, mode, status and billing state; retry billing, cancel, change a quantity, pause and
    resume collection as actions (the last ones: :mod:`billing.admin_changes`)."""

    list_display = (
        "id",
        "customer_email",
        "plan",
        "status",
        "billing_state_display",
        "next_billing",
        "last_error",
        "scope",
    )
    list_filter = (*SCOPE_FILTERS, "status", BillingStateFilter)
    list_select_related = ("customer", "price", "tenant")
    # Every other column would sort the whole table: lists stay in primary-key (creation) order.
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact subscription id (sub_…), or a customer's id, email (any case) or external id."
    actions = ["retry_billing", "cancel_now", "cancel_at_period_end", *SubscriptionChangeActions.CHANGE_ACTIONS]
    object_actions = (
        ("retry_billing", "Retry billing now"),
        ("cancel_now", "Cancel now"),
        ("cancel_at_period_end", "Cancel at period end"),
        *SubscriptionChangeActions.CHANGE_OBJECT_ACTIONS,
    )
    inlines = [SubscriptionInvoiceInline, SubscriptionBillingAttemptInline]
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "tenant",
                    "livemode",
                    "customer_link",
                    "plan",
                    "status",
                    "clock_display",
                    "metadata",
                )
            },
        ),
        (
            "Billing failure state",
            {"fields": ("billing_state_explained", "billing_failure_count", "last_error_explained")},
        ),
        SubscriptionChangeActions.CHANGE_FIELDSET,
        ("Dunning", {"fields": ("dunning",)}),
        ("Payment attempts (newest 50)", {"fields": ("payment_attempts",)}),
        (
            "Billing periods",
            {
                "fields": (
                    "billing_cycle_anchor",
                    "trial_end",
                    "current_period_start",
                    "current_period_end",
                    "periods_billed_explained",
                    "next_billing_at",
                    "cancel_at_period_end",
                    "canceled_at",
                    "ended_at",
                )
            },
        ),
        (None, {"fields": ("created_at", "updated_at")}),
    )
    readonly_fields = (
        "customer_link",
        "plan",
        "clock_display",
        "billing_state_explained",
        "last_error_explained",
        "dunning",
        "payment_attempts",
        "periods_billed_explained",
        *SubscriptionChangeActions.CHANGE_READONLY_FIELDS,
    )

    def object_label(self, sub: Subscription) -> str:
        return subscription_label(sub)

    def object_links(self, sub: Subscription) -> list[tuple[str, str]]:
        url = reverse("admin:billing_invoiceitem_changelist") + f"?subscription={sub.pk}"
        return [(url, "Its invoice items")]

    def object_action_applies(self, sub: Subscription, action: str) -> bool:
        if action in self.CHANGE_ACTIONS:
            return self.change_action_applies(sub, action)
        if action == "retry_billing":
            return sub.billing_state in ("waiting", "parked") and sub.status in Subscription.BILLABLE_STATUSES
        if action == "cancel_at_period_end":
            return sub.status != Subscription.CANCELED and not sub.cancel_at_period_end
        return sub.status != Subscription.CANCELED

    @admin.display(description="customer")
    def customer_email(self, sub: Subscription) -> str:
        return truncated(sub.customer.email, 30)

    @admin.display(description="customer")
    def customer_link(self, sub: Subscription):
        return id_link(Customer, sub.customer_id, text=str(sub.customer))

    @admin.display(description="plan")
    def plan(self, sub: Subscription):
        return id_link(Price, sub.price_id, text=_plan(sub.price))

    @admin.display(description="test clock")
    def clock_display(self, sub: Subscription):
        clock = sub.test_clock
        if clock is None:
            return "none: its times are the wall clock's (UTC)"
        return format_html(
            "{} — the clock's time is {} ({}); every time of this subscription is the clock's",
            id_link(TestClock, clock.pk, text=clock.name or clock.pk),
            short_time(clock.frozen_time),
            clock.status,
        )

    @admin.display(description="billing state")
    def billing_state_display(self, sub: Subscription) -> str:
        on_clock = bool(sub.test_clock_id)
        if sub.billing_state == "waiting":
            return (
                f"waiting until {clock_time(sub.next_billing_attempt_at, on_clock=on_clock)} · "
                f"failure {sub.billing_failure_count}"
            )
        if sub.billing_state == "parked":
            return f"parked after {sub.billing_failure_count} failures"
        if sub.billing_state == "paused":
            resumes_at = sub.pause_collection_resumes_at
            return f"paused until {clock_time(resumes_at, on_clock=on_clock)}" if resumes_at else "paused"
        return "ok"

    @admin.display(description="billing state")
    def billing_state_explained(self, sub: Subscription) -> str:
        on_clock = bool(sub.test_clock_id)
        if sub.billing_state == "waiting":
            return (
                f"waiting: failure {sub.billing_failure_count} on the retry ladder; the next attempt is at "
                f"{clock_time(sub.next_billing_attempt_at, on_clock=on_clock)} (an operator may retry billing sooner)"
            )
        if sub.billing_state == "parked":
            return (
                f"parked since {clock_time(sub.billing_parked_at, on_clock=on_clock)} after "
                f"{sub.billing_failure_count} failures: the drain no longer tries it; fix the cause, then retry billing"
            )
        if sub.billing_state == "paused":
            return "paused: collection is paused (see Items and changes); due periods are invoiced, nothing is charged"
        return "ok: billed by the drain when due"

    @admin.display(description="last error")
    def last_error_explained(self, sub: Subscription):
        if not sub.last_billing_error:
            return "none"
        return format_html(
            "{}<br><span class='quiet'>as recorded: {}</span>",
            explain_error(sub.last_billing_error, unattached_payment_method=_unattached_payment_method(sub)),
            sub.last_billing_error,
        )

    @admin.display(description="next billing")
    def next_billing(self, sub: Subscription) -> str:
        return clock_time(sub.next_billing_at, on_clock=bool(sub.test_clock_id))

    @admin.display(description="last error")
    def last_error(self, sub: Subscription):
        return truncated(explain_error(sub.last_billing_error, unattached_payment_method=_unattached(sub.customer)), 52)

    @admin.display(description="periods billed")
    def periods_billed_explained(self, sub: Subscription):
        # An open invoice of the first unbilled period (which starts at next_billing_at) is one whose
        # charge was never answered; a declined invoice's period has advanced already.
        open_invoice = None
        if sub.next_billing_at is not None:
            open_invoice = sub.invoices.filter(status=Invoice.OPEN, period_start__gte=sub.next_billing_at).first()
        if open_invoice is None:
            return sub.periods_billed
        return format_html(
            "{} — the period from {} has an open invoice ({}) whose charge failed at the gateway or got no "
            "answer yet: a period counts as billed once the card answers (paid or declined); the retry ladder "
            "charges it again",
            sub.periods_billed,
            short_time(open_invoice.period_start),
            id_link(Invoice, open_invoice.pk, text=open_invoice.number or open_invoice.pk),
        )

    @admin.display(description="dunning runs (of its invoices, newest 10)")
    def dunning(self, sub: Subscription):
        declined = sub.invoices.filter(dunning_run__isnull=False).select_related("dunning_run").order_by("-pk")[:10]
        runs = [invoice.dunning_run for invoice in declined]
        if not runs:
            return "none: no invoice of this subscription was declined"
        return format_html_join(mark_safe("<br>"), "{}", ((_dunning_summary(run),) for run in runs))

    @admin.display(description="payment attempts")
    def payment_attempts(self, sub: Subscription):
        return _payment_attempts_table(
            PaymentAttempt.objects.filter(invoice__subscription=sub)
            .select_related("invoice__customer")
            .order_by("-started_at")[:50]
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
                # The change service's cancel: a cancel now bills the usage not billed yet (docs/decisions/0170).
                changes.cancel_subscription(
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
    fields = ("description", "price_link", "quantity", "amount_display", "period")
    readonly_fields = fields
    ordering = ("pk",)
    amount_display = _money("amount", "amount")

    @admin.display(description="price")
    def price_link(self, line: InvoiceLineItem):
        return id_link(Price, line.price_id, text=_plan(line.price)) if line.price_id else "—"

    @admin.display(description="billing period")
    def period(self, line: InvoiceLineItem) -> str:
        return f"{short_time(line.period_start)} → {short_time(line.period_end)}"


class PaymentAttemptInline(ReadOnlyInline):
    model = PaymentAttempt
    fields = (
        "row_link",
        "attempt_number",
        "outcome",
        "amount_display",
        "decline_or_error",
        "payment_intent_id",
        "started",
        "completed",
    )
    readonly_fields = fields
    amount_display = _money("amount", "amount")

    @admin.display(description="decline / error")
    def decline_or_error(self, attempt: PaymentAttempt):
        return truncated(attempt.decline_code or _attempt_error(attempt) or "—", 80)

    @admin.display(description="started")
    def started(self, attempt: PaymentAttempt) -> str:
        return short_time(attempt.started_at)

    @admin.display(description="completed")
    def completed(self, attempt: PaymentAttempt) -> str:
        return short_time(attempt.completed_at)


INVOICE_EVENT_TYPES = tuple(t for t in EVENT_TYPES if t.startswith("invoice."))


@admin.register(Invoice)
class InvoiceAdmin(ScopeColumns, ReadOnlyAdmin):
    """Invoices by tenant, mode, status and tax status; retry payment and void as actions."""

    list_display = (
        "id",
        "number",
        "customer_email",
        "status",
        "total_display",
        "amount_due_display",
        "period",
        "scope",
    )
    list_filter = (*SCOPE_FILTERS, "status", "tax_status", "hold_reason")
    list_select_related = ("customer", "tenant")
    sortable_by = ("id",)
    search_fields = ("id",)
    search_help_text = "Exact invoice id (in_…), number, customer id (cus_…), subscription id (sub_…) or PaymentIntent."
    inlines = [LineItemInline, PaymentAttemptInline]
    actions = ["retry_payment", "void"]
    object_actions = (("retry_payment", "Pay now (retry the charge)"), ("void", "Void"))
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "number",
                    "status",
                    "hold_reason",
                    "tenant",
                    "livemode",
                    "customer_link",
                    "subscription_link",
                    "billing_period",
                )
            },
        ),
        ("Usage", {"fields": ("usage",)}),
        (
            "Amounts",
            {
                "fields": (
                    "subtotal_display",
                    "tax_display",
                    "tax_status",
                    "credit_applied_display",
                    "total_display",
                    "amount_due_display",
                    "amount_paid_display",
                    "pre_payment_credit_notes_display",
                    "post_payment_credit_notes_display",
                )
            },
        ),
        ("Payment", {"fields": ("payment_intent_id", "attempt_count", "dunning")}),
        ("Events and their webhook deliveries", {"fields": ("deliveries",)}),
        (None, {"fields": ("created_at", "finalized_at", "paid_at", "voided_at", "marked_uncollectible_at")}),
    )
    readonly_fields = (
        "customer_link",
        "subscription_link",
        "billing_period",
        "subtotal_display",
        "tax_display",
        "credit_applied_display",
        "total_display",
        "amount_due_display",
        "amount_paid_display",
        "pre_payment_credit_notes_display",
        "post_payment_credit_notes_display",
        "dunning",
        "deliveries",
        "usage",
    )
    subtotal_display = _money("subtotal", "subtotal")
    tax_display = _money("tax", "tax")
    credit_applied_display = _money("credit_applied", "credit applied")
    total_display = _money("total", "total")
    amount_due_display = _money("amount_due", "amount due")
    amount_paid_display = _money("amount_paid", "amount paid")
    pre_payment_credit_notes_display = _money("pre_payment_credit_notes_amount", "credit notes before payment")
    post_payment_credit_notes_display = _money("post_payment_credit_notes_amount", "credit notes after payment")

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset,
            search_term,
            {"in_": "pk", "cus_": "customer_id", "sub_": "subscription_id", "pi_": "payment_intent_id"},
            default="number",
        )

    def object_label(self, invoice: Invoice) -> str:
        return invoice_label(invoice)

    def object_links(self, invoice: Invoice) -> list[tuple[str, str]]:
        links = []
        if invoice.status in (Invoice.OPEN, Invoice.PAID):  # billing/admin_credit_notes.py
            links.append((reverse("admin:billing_invoice_credit_note", args=[invoice.pk]), "Issue a credit note"))
        run = _dunning_run(invoice)
        if run is None:
            return links
        return [*links, (reverse("admin:dunning_dunningrun_change", args=[run.pk]), "Open its dunning run")]

    def get_urls(self):
        from billing.admin_credit_notes import issue_credit_note_view

        view = self.admin_site.admin_view(lambda request, object_id: issue_credit_note_view(self, request, object_id))
        return [path("<path:object_id>/credit_note/", view, name="billing_invoice_credit_note"), *super().get_urls()]

    def object_action_applies(self, invoice: Invoice, action: str) -> bool:
        if action == "retry_payment":
            return invoice.status == Invoice.OPEN
        return invoice.status in (Invoice.DRAFT, Invoice.OPEN)

    @admin.display(description="usage lines")
    def usage(self, invoice: Invoice):
        return invoice_usage(invoice)

    @admin.display(description="customer")
    def customer_email(self, invoice: Invoice) -> str:
        return invoice.customer.email

    @admin.display(description="customer")
    def customer_link(self, invoice: Invoice):
        return id_link(Customer, invoice.customer_id, text=str(invoice.customer))

    @admin.display(description="subscription")
    def subscription_link(self, invoice: Invoice):
        return id_link(Subscription, invoice.subscription_id)

    @admin.display(description="period start")
    def period(self, invoice: Invoice) -> str:
        return short_time(invoice.period_start)

    @admin.display(description="billing period")
    def billing_period(self, invoice: Invoice) -> str:
        return f"{short_time(invoice.period_start)} → {short_time(invoice.period_end)}"

    @admin.display(description="dunning run")
    def dunning(self, invoice: Invoice):
        run = _dunning_run(invoice)
        if run is None:
            return "none: no charge of this invoice was declined"
        return _dunning_summary(run)

    @admin.display(description="deliveries")
    def deliveries(self, invoice: Invoice):
        events = events_with_deliveries(
            tenant_id=invoice.tenant_id, livemode=invoice.livemode, object_id=invoice.id, types=INVOICE_EVENT_TYPES
        )
        if not events:
            return "no event yet"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    id_link(type(event), event.pk, text=event.type),
                    short_time(event.created_at),
                    format_html_join(
                        mark_safe("<br>"),
                        "{} → {}: {} ({})",
                        (
                            (
                                id_link(type(d), d.pk),
                                truncated(d.endpoint.url, 48),
                                d.status,
                                "1 attempt" if d.attempts == 1 else f"{d.attempts} attempts",
                            )
                            for d in deliveries
                        ),
                    )
                    or "no endpoint subscribed",
                )
                for event, deliveries in events
            ),
        )
        return format_html("<table><tr><th>event</th><th>at</th><th>deliveries</th></tr>{}</table>", rows)

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


@admin.register(SubscriptionItem)
class SubscriptionItemAdmin(ReadOnlyAdmin):
    list_display = ("id", "subscription", "price", "quantity", "tenant", "livemode")
    list_select_related = ("subscription", "price", "tenant")
    search_fields = ("id",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"si_": "pk", "sub_": "subscription_id"})


class IdFilter(admin.SimpleListFilter):
    """Rows of one related object, by its id in the URL (``?customer=cus_…``): links from that object's page set it.

    It offers no list of choices (that would read every customer); the one chosen is shown while it applies.
    """

    field: str = ""

    def lookups(self, request, model_admin):
        value = self.value()
        return ((value, value),) if value else ()

    def has_output(self) -> bool:
        return self.value() is not None

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(**{self.field: self.value()})


class InvoiceItemCustomerFilter(IdFilter):
    title, parameter_name, field = "customer", "customer", "customer_id"


class InvoiceItemSubscriptionFilter(IdFilter):
    title, parameter_name, field = "subscription", "subscription", "subscription_id"


class InvoiceItemStateFilter(admin.SimpleListFilter):
    """Pending (on no invoice yet: the next invoice takes it) or invoiced."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return (("pending", "pending"), ("invoiced", "invoiced"))

    def queryset(self, request, queryset):
        if self.value() in ("pending", "invoiced"):
            return queryset.filter(invoice__isnull=self.value() == "pending")
        return queryset


@admin.register(InvoiceItem)
class InvoiceItemAdmin(ScopeColumns, ReadOnlyAdmin):
    """Pending invoice items (and those invoiced already), read-only: they are added through ``POST /v1/invoiceitems``
    and by subscription changes; filter by customer or subscription (``?customer=cus_…``, ``?subscription=sub_…``)."""

    list_display = (
        "id",
        "created",
        "customer_link",
        "subscription_link",
        "description_short",
        "amount_display",
        "proration",
        "invoice_link",
        "scope",
    )
    list_filter = (
        InvoiceItemStateFilter,
        "proration",
        InvoiceItemCustomerFilter,
        InvoiceItemSubscriptionFilter,
        *SCOPE_FILTERS,
    )
    list_select_related = ("tenant",)
    sortable_by = ("id",)
    readonly_fields = ("amount_display",)
    amount_display = _money("amount", "amount")
    search_fields = ("id",)
    search_help_text = "Exact item id (ii_…), customer id (cus_…), subscription id (sub_…) or invoice id (in_…)."

    def object_label(self, item: InvoiceItem) -> str:
        state = f"on {item.invoice_id}" if item.invoice_id else "pending"
        return f"Invoice item {item.id} · {money(item.amount, item.currency)} · {state}"

    @admin.display(description="created")
    def created(self, item: InvoiceItem) -> str:
        return short_time(item.created_at)

    @admin.display(description="customer")
    def customer_link(self, item: InvoiceItem):
        return id_link(Customer, item.customer_id, text=short_id(item.customer_id))

    @admin.display(description="subscription")
    def subscription_link(self, item: InvoiceItem):
        if item.subscription_id is None:
            return "any of the customer's"
        return id_link(Subscription, item.subscription_id, text=short_id(item.subscription_id))

    @admin.display(description="description")
    def description_short(self, item: InvoiceItem):
        return truncated(item.description, 52)

    @admin.display(description="invoice")
    def invoice_link(self, item: InvoiceItem):
        return id_link(Invoice, item.invoice_id, text=short_id(item.invoice_id)) if item.invoice_id else "pending"

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset, search_term, {"ii_": "pk", "cus_": "customer_id", "sub_": "subscription_id", "in_": "invoice_id"}
        )


@admin.register(InvoiceCounter)
class InvoiceCounterAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "last_number")
    list_select_related = ("tenant",)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    """The credit ledger: append-only, so no change, no delete, not even for superusers
    (docs/reference/domain.md#credit-ledger)."""

    list_display = ("id", "created", "customer", "reason", "amount_display", "balance_display", "invoice")
    list_filter = (*SCOPE_FILTERS, "reason")
    readonly_fields = ("amount_display", "balance_display")

    @admin.display(description="at")
    def created(self, entry: LedgerEntry) -> str:
        return short_time(entry.created_at)

    list_select_related = ("customer", "invoice")
    search_fields = ("id",)
    search_help_text = "Exact entry id (cbtxn_…), customer id (cus_…) or invoice id (in_…)."
    amount_display = _money("amount", "amount")
    balance_display = _money("balance_after", "balance after")

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"cbtxn_": "pk", "cus_": "customer_id", "in_": "invoice_id"})

    def get_actions(self, request):
        return {}


# --- coupons and discounts (docs/reference/discounts.md): read-only, changed through the API's services --------------


@admin.register(Coupon)
class CouponAdmin(ScopeColumns, ReadOnlyAdmin):
    list_display = ("id", "name", "terms", "duration", "redemptions", "redeem_by", "deleted_at", "scope")
    list_filter = (*SCOPE_FILTERS, "duration")
    list_select_related = ("tenant",)
    readonly_fields = ("terms", "redemptions")
    search_fields = ("id__exact", "name")

    @admin.display(description="off")
    def terms(self, coupon: Coupon) -> str:
        if coupon.percent_off is not None:
            return f"{coupon.percent_off.normalize():f} %"
        return money(coupon.amount_off, coupon.currency)

    @admin.display(description="redeemed")
    def redemptions(self, coupon: Coupon) -> str:
        limit = "∞" if coupon.max_redemptions is None else coupon.max_redemptions
        return f"{coupon.times_redeemed} / {limit}"


@admin.register(Discount)
class DiscountAdmin(ReadOnlyAdmin):
    """Redemptions: one discount per coupon applied to a customer or a subscription."""

    list_display = ("id", "coupon", "customer", "subscription", "start", "end", "deleted_at", "invoice")
    list_select_related = ("coupon", "customer", "subscription")
    search_fields = ("id",)
    search_help_text = "Exact discount id (di_…), coupon (co_…), customer (cus_…) or subscription id (sub_…)."

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset,
            search_term,
            {"di_": "pk", "co_": "coupon_id", "cus_": "customer_id", "sub_": "subscription_id"},
        )


@admin.register(PaymentAttempt)
class PaymentAttemptAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "started",
        "invoice",
        "attempt_number",
        "outcome",
        "amount_display",
        "decline_or_error",
        "payment_intent_id",
    )
    list_filter = (*SCOPE_FILTERS, "outcome")
    list_select_related = ("invoice__customer",)
    readonly_fields = ("amount_display", "error_explained")

    def object_label(self, attempt: PaymentAttempt) -> str:
        return (
            f"Payment attempt {attempt.attempt_number} of invoice {attempt.invoice.number or attempt.invoice_id} · "
            f"{money(attempt.amount, attempt.currency)} · {attempt.outcome}"
        )

    @admin.display(description="started")
    def started(self, attempt: PaymentAttempt) -> str:
        return short_time(attempt.started_at)

    @admin.display(description="decline / error")
    def decline_or_error(self, attempt: PaymentAttempt):
        return truncated(attempt.decline_code or _attempt_error(attempt) or "—", 60)

    @admin.display(description="error, explained")
    def error_explained(self, attempt: PaymentAttempt) -> str:
        return _attempt_error(attempt) or "—"

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


class RunContentFilter(admin.SimpleListFilter):
    """Runs that attempted something (the default), or every run: most scheduler ticks find nothing due."""

    title = "runs shown"
    parameter_name = "runs"

    def lookups(self, request, model_admin):
        return (("all", "all, with empty ones"), ("empty", "empty only"))

    def choices(self, changelist):
        # The default (no parameter) is "attempted something", so it is offered under that name.
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "attempted something",
        }
        for value, label in self.lookup_choices:
            yield {
                "selected": self.value() == value,
                "query_string": changelist.get_query_string({self.parameter_name: value}),
                "display": label,
            }

    def queryset(self, request, queryset):
        if self.value() == "all":
            return queryset
        if self.value() == "empty":
            return queryset.filter(attempted=0)
        return queryset.exclude(attempted=0)


@admin.register(BillingRun)
class BillingRunAdmin(ReadOnlyAdmin):
    """Billing runs, newest first; runs that attempted nothing are folded away unless asked for."""

    list_display = (
        "id",
        "trigger",
        "status",
        "run_scope",
        "started",
        "duration",
        "pages",
        "attempted",
        "billed",
        "failed",
    )
    list_filter = (RunContentFilter, "trigger", "status", mode_filter(), "tenant")
    list_select_related = ("tenant",)
    search_fields = ("id",)
    inlines = [RunAttemptInline]
    readonly_fields = ("all_attempts",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"brun_": "pk", "ten_": "tenant_id"})

    def object_label(self, run: BillingRun) -> str:
        return f"Billing run {run.id} · {run.trigger} · {run.status} · billed {run.billed} of {run.attempted}"

    @admin.display(description="started")
    def started(self, run: BillingRun) -> str:
        return short_time(run.started_at)

    @admin.display(description="tenant · mode")
    def run_scope(self, run: BillingRun) -> str:
        return f"{run.tenant.name if run.tenant_id else 'all tenants'} · {'live' if run.livemode else 'test'}"

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
    list_display = ("id", "created", "run_link", "subscription_link", "outcome", "failure_number", "error_explained")
    list_filter = ("outcome",)

    @admin.display(description="at")
    def created(self, attempt: BillingAttempt) -> str:
        return short_time(attempt.created_at)

    @admin.display(description="error")
    def error_explained(self, attempt: BillingAttempt):
        return truncated(explain_error(attempt.error), 70)

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
    list_display = ("id", "name", "clock_now", "status", "tenant")
    list_filter = ("status", "tenant")

    def object_label(self, clock: TestClock) -> str:
        return f"Test clock {clock.name or clock.id} · its time {short_time(clock.frozen_time)} · {clock.status}"

    @admin.display(description="the clock's time")
    def clock_now(self, clock: TestClock) -> str:
        return clock_time(clock.frozen_time, on_clock=True)

    list_select_related = ("tenant",)
    search_fields = ("id__exact", "name")


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    """Stripe's events as received at /stripe/webhooks/<account> (docs/reference/payments.md)."""

    list_display = ("id", "received_at", "account", "type", "result", "invoice_link", "payment_intent_id", "tenant")
    list_filter = ("result", "account", "type")
    list_select_related = ("tenant",)
    search_fields = ("id",)
    search_help_text = "Exact Stripe event id (evt_…), invoice id (in_…) or PaymentIntent (pi_…)."

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset, search_term, {"evt_": "event_id", "in_": "invoice_id", "pi_": "payment_intent_id"}
        )

    @admin.display(description="invoice")
    def invoice_link(self, event: StripeEvent):
        return id_link(Invoice, event.invoice_id)


@admin.register(GatewayAccount)
class GatewayAccountAdmin(ReadOnlyAdmin):
    """A tenant's own Stripe account, without its secrets: the key masked, the signing secret never shown."""

    fields = ("id", "tenant", "livemode", "key_hint", "connect_account", "slug", "created_at", "updated_at")
    list_display = ("id", "tenant", "livemode", "key_hint", "connect_account", "updated_at")
    list_filter = ("livemode",)
    list_select_related = ("tenant",)
    search_fields = ("id__exact", "tenant__id__exact", "connect_account__exact")


# Credit notes' list and page, and the invoice page's form (registered there, kept apart from this module).
from billing import admin_credit_notes  # noqa: E402, F401
