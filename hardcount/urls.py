"""URL map: the JSON API under /v1, health, metrics and the operators' admin.

Each app keeps its /v1 patterns in its own ``urls.py``; add one ``path("v1/", include(...))``
line per app below (paths inside the app's file carry no leading ``v1/``).
"""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularJSONAPIView
from rest_framework.permissions import AllowAny

from hardcount import health, metrics

urlpatterns = [
    path(
        "v1/openapi.json",
        SpectacularJSONAPIView.as_view(authentication_classes=[], permission_classes=[AllowAny]),
        name="openapi",
    ),
    path("v1/", include("billing.urls")),
    path("v1/", include("outbox.urls")),
    path("v1/", include("dunning.urls")),
    # Stripe's own events (billing/stripe_webhooks.py): signed by Stripe, no API key.
    path("stripe/", include("billing.stripe_urls")),
    # Customers' hosted invoice pages (billing/hosted_views.py): the URL's signed token, no API key.
    path("i/", include("billing.hosted_urls")),
    path("admin/", admin.site.urls),
    path("health/live", health.live, name="health-live"),
    path("health/ready", health.ready, name="health-ready"),
    # Before django-prometheus's own /metrics: the same exporter plus the docs/reference/metrics.md collector.
    path("metrics", metrics.metrics_view, name="metrics"),
    path("", include("django_prometheus.urls")),
]

# JSON errors for /v1 paths that match no view (and for crashes); Django's pages elsewhere.
handler400 = "hardcount.errors.handler400"
handler404 = "hardcount.errors.handler404"
handler500 = "hardcount.errors.handler500"
