"""API test fixtures: tenants with real keys, and a JSON client that speaks to the real Django app."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from django.test import Client

from hardcount.models import ApiKey, Tenant


@dataclass
class Keys:
    tenant: Tenant
    test: str
    live: str


class Api:
    """Calls /v1 through Django's test client with a bearer key; returns ``(status, json_body)``."""

    def __init__(self, key: str | None):
        self.key = key
        self.client = Client()

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        out = {"HTTP_AUTHORIZATION": f"Bearer {self.key}"} if self.key else {}
        for name, value in (headers or {}).items():
            out["HTTP_" + name.upper().replace("-", "_")] = value
        return out

    def get(self, path: str, params: dict | None = None, headers: dict | None = None):
        response = self.client.get(path, params or {}, **self._headers(headers))
        return response.status_code, response.json()

    def post(
        self, path: str, body=None, *, raw: bytes | str | None = None, content_type="application/json", headers=None
    ):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        response = self.client.post(path, data=data, content_type=content_type, **self._headers(headers))
        return response.status_code, response.json()

    def delete(self, path: str, headers: dict | None = None):
        response = self.client.delete(path, **self._headers(headers))
        return response.status_code, response.json()

    def response(self, method: str, path: str, **kwargs):
        """The raw Django response, for header checks."""
        return getattr(self.client, method)(path, **kwargs, **self._headers(kwargs.pop("headers", None)))


def make_keys(name: str) -> Keys:
    tenant = Tenant.objects.create(name=name)
    _, test = ApiKey.issue(tenant, livemode=False)
    _, live = ApiKey.issue(tenant, livemode=True)
    return Keys(tenant=tenant, test=test, live=live)


@pytest.fixture
def acme(db) -> Keys:
    return make_keys("Acme")


@pytest.fixture
def globex(db) -> Keys:
    return make_keys("Globex")


@pytest.fixture
def api(acme) -> Api:
    """Acme's test-mode client."""
    return Api(acme.test)


@pytest.fixture
def live_api(acme) -> Api:
    """Acme's live-mode client."""
    return Api(acme.live)


@pytest.fixture
def other_api(globex) -> Api:
    """Globex's test-mode client (another tenant)."""
    return Api(globex.test)


def create_catalog(api: Api, *, currency: str = "usd", amount: int = 1000) -> dict:
    """A customer, a price and a subscription through the API; returns their JSON bodies."""
    status, customer = api.post("/v1/customers", {"email": "buyer@example.com", "name": "Buyer"})
    assert status == 201, customer
    status, price = api.post("/v1/prices", {"amount": amount, "currency": currency, "interval": "month"})
    assert status == 201, price
    status, subscription = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    assert status == 201, subscription
    return {"customer": customer, "price": price, "subscription": subscription}


def create_invoice(subscription_id: str, *, status: str = "open"):
    """An invoice row for the subscription's first period (invoices are made by the drain, not the API)."""
    from billing.models import Invoice, InvoiceLineItem, Subscription
    from billing.periods import period_bounds

    sub = Subscription.objects.select_related("price").get(pk=subscription_id)
    start, end = period_bounds(sub.billing_cycle_anchor, sub.price.interval, sub.price.interval_count, 0)
    invoice = Invoice.objects.create(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        subscription=sub,
        status=status,
        currency=sub.price.currency,
        period_start=start,
        period_end=end,
        subtotal=sub.price.amount,
        total=sub.price.amount,
        amount_due=sub.price.amount,
    )
    InvoiceLineItem.objects.create(
        invoice=invoice,
        description="Subscription",
        price=sub.price,
        amount=sub.price.amount,
        currency=sub.price.currency,
        period_start=start,
        period_end=end,
    )
    return invoice


@pytest.fixture(autouse=True)
def _billing_runs_unthrottled(settings):
    """The fuzz test sends some twenty billing runs with one key, over the shipped limit (5 at once, then 3 a
    minute); tests/security/test_rate_limits.py tests that limit. Reads and writes keep their shipped limits."""
    settings.HARDCOUNT_RATE_LIMITS = {**settings.HARDCOUNT_RATE_LIMITS, "billing_run": {"per_s": 100.0, "burst": 1000}}
