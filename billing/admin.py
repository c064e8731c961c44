"""Operators' admin for billing: read-only views of customers, prices, subscriptions, invoices and runs."""

from __future__ import annotations

from django.contrib import admin

from billing.models import (
    BillingAttempt,
    BillingRun,
    Customer,
    Invoice,
    InvoiceCounter,
    InvoiceLineItem,
    LedgerEntry,
    PaymentAttempt,
    Price,
    Subscription,
    TestClock,
)
from hardcount.admin import ReadOnlyAdmin, ReadOnlyInline
from hardcount.money import format_amount

SCOPE_FILTERS = ("livemode", "tenant")


def _money(amount_field: str, description: str):
    def display(model_admin, obj):
        try:
            return format_amount(getattr(obj, amount_field), obj.currency)
        except (KeyError, ValueError):
            return f"{getattr(obj, amount_field)} {obj.currency}"

    display.short_description = description
    return display


@admin.register(Customer)
class CustomerAdmin(ReadOnlyAdmin):
    list_display = ("id", "email", "name", "tenant", "livemode", "currency", "credit_balance", "created_at")
    list_filter = SCOPE_FILTERS
    search_fields = ("id", "email", "name", "external_id", "gateway_customer_id")
    ordering = ("-created_at",)


@admin.register(Price)
class PriceAdmin(ReadOnlyAdmin):
    list_display = ("id", "nickname", "amount_display", "interval", "interval_count", "active", "tenant", "livemode")
    list_filter = (*SCOPE_FILTERS, "currency", "interval", "active")
    search_fields = ("id", "nickname")
    amount_display = _money("amount", "amount")


@admin.register(Subscription)
class SubscriptionAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "customer",
        "price",
        "status",
        "next_billing_at",
        "billing_failure_count",
        "billing_parked_at",
        "tenant",
        "livemode",
    )
    list_filter = (*SCOPE_FILTERS, "status", "cancel_at_period_end")
    search_fields = ("id", "customer__id", "customer__email", "price__id")
    ordering = ("-created_at",)


class LineItemInline(ReadOnlyInline):
    model = InvoiceLineItem
    fields = ("description", "price", "quantity", "amount", "currency", "period_start", "period_end")


class PaymentAttemptInline(ReadOnlyInline):
    model = PaymentAttempt
    fields = ("attempt_number", "outcome", "amount", "currency", "decline_code", "payment_intent_id", "completed_at")


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = ("id", "number", "customer", "status", "total_display", "amount_due_display", "period_start")
    list_filter = (*SCOPE_FILTERS, "status", "tax_status", "currency")
    search_fields = ("id", "number", "customer__id", "subscription__id", "payment_intent_id")
    ordering = ("-created_at",)
    inlines = [LineItemInline, PaymentAttemptInline]
    total_display = _money("total", "total")
    amount_due_display = _money("amount_due", "amount due")


@admin.register(InvoiceLineItem)
class InvoiceLineItemAdmin(ReadOnlyAdmin):
    list_display = ("id", "invoice", "description", "amount", "currency")
    search_fields = ("id", "invoice__id")


@admin.register(InvoiceCounter)
class InvoiceCounterAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "last_number")


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "customer", "reason", "amount_display", "balance_after", "invoice", "created_at")
    list_filter = (*SCOPE_FILTERS, "reason")
    search_fields = ("id", "customer__id", "invoice__id")
    ordering = ("-created_at",)
    amount_display = _money("amount", "amount")


@admin.register(PaymentAttempt)
class PaymentAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "invoice", "attempt_number", "outcome", "amount_display", "decline_code", "completed_at")
    list_filter = (*SCOPE_FILTERS, "outcome")
    search_fields = ("id", "invoice__id", "payment_intent_id", "idempotency_key")
    amount_display = _money("amount", "amount")


class BillingAttemptInline(ReadOnlyInline):
    model = BillingAttempt
    fields = ("subscription", "outcome", "failure_number", "invoice", "error", "created_at")
    max_num = 0


@admin.register(BillingRun)
class BillingRunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "trigger",
        "status",
        "tenant",
        "livemode",
        "started_at",
        "pages",
        "attempted",
        "billed",
        "failed",
    )
    list_filter = ("trigger", "status", "livemode")
    search_fields = ("id", "tenant__id")
    ordering = ("-started_at",)


@admin.register(BillingAttempt)
class BillingAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "subscription", "outcome", "failure_number", "created_at")
    list_filter = ("outcome",)
    search_fields = ("id", "run__id", "subscription__id")


@admin.register(TestClock)
class TestClockAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "frozen_time", "status", "tenant")
    list_filter = ("status", "tenant")
    search_fields = ("id", "name")
