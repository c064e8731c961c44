"""The customers' hosted invoice pages (included by :mod:`hardcount.urls` under ``i/``): no API key, the token is the
credential (:mod:`billing.hosted_views`)."""

from django.urls import path

from billing import hosted_views

urlpatterns = [
    path("<str:token>", hosted_views.hosted_invoice, name="hosted-invoice"),
    path("<str:token>/pdf", hosted_views.hosted_invoice_pdf, name="hosted-invoice-pdf"),
]
