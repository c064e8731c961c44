"""Billing's /v1 URL patterns (included by :mod:`hardcount.urls` under ``v1/``). Ids are path segments."""

from django.urls import path

from billing.api import catalog

urlpatterns = [
    path("customers", catalog.CustomerListView.as_view(), name="customers"),
    path("customers/<str:id>", catalog.CustomerDetailView.as_view(), name="customer"),
    path("prices", catalog.PriceListView.as_view(), name="prices"),
    path("prices/<str:id>", catalog.PriceDetailView.as_view(), name="price"),
    path("subscriptions", catalog.SubscriptionListView.as_view(), name="subscriptions"),
    path("subscriptions/<str:id>", catalog.SubscriptionDetailView.as_view(), name="subscription"),
    path("subscriptions/<str:id>/cancel", catalog.SubscriptionCancelView.as_view(), name="subscription-cancel"),
    path("invoices", catalog.InvoiceListView.as_view(), name="invoices"),
    path("invoices/<str:id>", catalog.InvoiceDetailView.as_view(), name="invoice"),
]
