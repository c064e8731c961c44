"""Billing's URL patterns outside /v1 (included by :mod:`hardcount.urls` under ``stripe/``): Stripe's webhooks."""

from django.urls import path

from billing.api.stripe_webhooks import StripeWebhookView

urlpatterns = [
    path("webhooks/<str:slug>", StripeWebhookView.as_view(), name="stripe-webhooks"),
]
