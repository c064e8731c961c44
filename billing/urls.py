"""Billing's /v1 URL patterns (included by :mod:`hardcount.urls` under ``v1/``). Ids are path segments."""

from django.urls import path

from billing.api import (
    account,
    catalog,
    clocks,
    coupons,
    credit_notes,
    documents,
    gateway_accounts,
    meters,
    payments,
    runs,
)

urlpatterns = [
    path("customers", catalog.CustomerListView.as_view(), name="customers"),
    path("customers/<str:id>", catalog.CustomerDetailView.as_view(), name="customer"),
    path("prices", catalog.PriceListView.as_view(), name="prices"),
    path("prices/<str:id>", catalog.PriceDetailView.as_view(), name="price"),
    path("subscriptions", catalog.SubscriptionListView.as_view(), name="subscriptions"),
    path("subscriptions/<str:id>", catalog.SubscriptionDetailView.as_view(), name="subscription"),
    path("subscriptions/<str:id>/cancel", catalog.SubscriptionCancelView.as_view(), name="subscription-cancel"),
    path("customers/<str:id>/discount", coupons.CustomerDiscountView.as_view(), name="customer-discount"),
    path("subscriptions/<str:id>/discount", coupons.SubscriptionDiscountView.as_view(), name="subscription-discount"),
    # Coupons (billing/api/coupons.py).
    path("coupons", coupons.CouponListView.as_view(), name="coupons"),
    path("coupons/<str:id>", coupons.CouponDetailView.as_view(), name="coupon"),
    path("invoices", catalog.InvoiceListView.as_view(), name="invoices"),
    path("invoices/upcoming", catalog.InvoiceUpcomingView.as_view(), name="invoice-upcoming"),
    path("invoices/<str:id>", catalog.InvoiceDetailView.as_view(), name="invoice"),
    # Billing runs, retry-billing, payments and credit (billing/api/runs.py, billing/api/payments.py).
    path("billing/run", runs.BillingRunCreateView.as_view(), name="billing-run"),
    path("billing/runs", runs.BillingRunListView.as_view(), name="billing-runs"),
    path("billing/runs/<str:id>", runs.BillingRunDetailView.as_view(), name="billing-run-detail"),
    path("subscriptions/<str:id>/retry-billing", runs.SubscriptionRetryBillingView.as_view(), name="retry-billing"),
    path(
        "subscriptions/<str:id>/billing_attempts",
        runs.SubscriptionBillingAttemptsView.as_view(),
        name="subscription-billing-attempts",
    ),
    path("invoices/<str:id>/pay", payments.InvoicePayView.as_view(), name="invoice-pay"),
    path("invoices/<str:id>/void", payments.InvoiceVoidView.as_view(), name="invoice-void"),
    # Invoice documents (billing/api/documents.py); the customers' hosted pages are billing/hosted_urls.py.
    path("invoices/<str:id>/pdf", documents.InvoicePdfView.as_view(), name="invoice-pdf"),
    path(
        "invoices/<str:id>/rotate_hosted_url",
        documents.InvoiceRotateHostedUrlView.as_view(),
        name="invoice-rotate-hosted-url",
    ),
    path("invoices/<str:id>/payment_attempts", payments.InvoicePaymentAttemptsView.as_view(), name="invoice-payments"),
    path("invoiceitems", payments.InvoiceItemListView.as_view(), name="invoice-items"),
    path("customers/<str:id>/credits", payments.CustomerCreditsView.as_view(), name="customer-credits"),
    # The caller's business details, printed on its invoice documents (billing/api/account.py).
    path("account", account.AccountView.as_view(), name="account"),
    # Credit notes (billing/api/credit_notes.py).
    path("credit_notes", credit_notes.CreditNoteListView.as_view(), name="credit-notes"),
    path("credit_notes/preview", credit_notes.CreditNotePreviewView.as_view(), name="credit-note-preview"),
    path("credit_notes/<str:id>", credit_notes.CreditNoteDetailView.as_view(), name="credit-note"),
    path("credit_notes/<str:id>/void", credit_notes.CreditNoteVoidView.as_view(), name="credit-note-void"),
    path("credit_notes/<str:id>/pdf", documents.CreditNotePdfView.as_view(), name="credit-note-pdf"),
    # The caller's own Stripe account (billing/api/gateway_accounts.py).
    path("gateway_account", gateway_accounts.GatewayAccountView.as_view(), name="gateway-account"),
    # Usage billing (billing/api/meters.py).
    path("billing/meters", meters.MeterListView.as_view(), name="meters"),
    path("billing/meters/<str:id>", meters.MeterDetailView.as_view(), name="meter"),
    path(
        "billing/meters/<str:id>/event_summaries", meters.MeterEventSummaryView.as_view(), name="meter-event-summaries"
    ),
    path("billing/meter_events", meters.MeterEventCreateView.as_view(), name="meter-events"),
    path("billing/meter_events/batch", meters.MeterEventBatchView.as_view(), name="meter-events-batch"),
    # Test clocks (billing/api/clocks.py).
    path("test_clocks", clocks.TestClockListView.as_view(), name="test-clocks"),
    path("test_clocks/<str:id>", clocks.TestClockDetailView.as_view(), name="test-clock"),
    path("test_clocks/<str:id>/advance", clocks.TestClockAdvanceView.as_view(), name="test-clock-advance"),
]
