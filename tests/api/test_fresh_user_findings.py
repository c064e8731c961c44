"""Regressions found by trying the running service as a new user would (HEAD, chunked bodies, repeated parameters)."""

import json

import pytest

from billing.models import Customer, Subscription


@pytest.fixture
def client_for(db):
    from django.test import Client

    from hardcount.models import ApiKey, Tenant

    tenant = Tenant.objects.create(name="Probe")
    _, secret = ApiKey.issue(tenant, livemode=False)
    return Client(HTTP_AUTHORIZATION=f"Bearer {secret}"), tenant


@pytest.mark.parametrize("path", ["/v1/customers", "/v1/prices", "/v1/subscriptions", "/v1/invoices"])
def test_head_on_a_list_answers_like_get_without_a_body(client_for, path):
    client, _ = client_for
    response = client.head(path)
    assert response.status_code == 200
    assert response.content == b""


def test_a_chunked_body_is_refused_with_411_and_writes_nothing(client_for):
    client, _ = client_for
    response = client.generic(
        "POST",
        "/v1/customers",
        data=b"",
        content_type="application/json",
        HTTP_TRANSFER_ENCODING="chunked",
    )
    assert response.status_code == 411
    assert response.json()["error"]["code"] == "length_required"
    assert Customer.objects.count() == 0


def test_a_chunked_cancel_at_period_end_does_not_cancel_now(client_for):
    client, _ = client_for
    customer = client.post(
        "/v1/customers", data=json.dumps({"email": "a@example.com"}), content_type="application/json"
    ).json()
    price = client.post(
        "/v1/prices",
        data=json.dumps({"amount": 1000, "currency": "usd", "interval": "month"}),
        content_type="application/json",
    ).json()
    sub = client.post(
        "/v1/subscriptions",
        data=json.dumps({"customer": customer["id"], "price": price["id"]}),
        content_type="application/json",
    ).json()
    response = client.generic(
        "POST",
        f"/v1/subscriptions/{sub['id']}/cancel",
        data=b"",
        content_type="application/json",
        HTTP_TRANSFER_ENCODING="chunked",
    )
    assert response.status_code == 411
    assert Subscription.objects.get(pk=sub["id"]).status == "active"


def test_a_repeated_query_parameter_is_422(client_for):
    client, _ = client_for
    response = client.get("/v1/customers?limit=1&limit=2")
    assert response.status_code == 422
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "code": "parameter_repeated",
        "message": "limit: given more than once.",
        "param": "limit",
    }


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data",
        "https://localhost:5432/",
        "https://127.0.0.1/hook",
        "https://10.1.2.3/hook",
        "https://[::1]/hook",
        "https://api.localhost/hook",
    ],
)
def test_a_live_webhook_endpoint_on_a_non_public_host_is_422_and_not_created(db, url):
    from django.test import Client

    from hardcount.models import ApiKey, Tenant
    from outbox.models import WebhookEndpoint

    tenant = Tenant.objects.create(name="Live")
    _, secret = ApiKey.issue(tenant, livemode=True)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = client.post(
        "/v1/webhook_endpoints",
        data=json.dumps({"url": url, "enabled_events": ["*"]}),
        content_type="application/json",
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "url_not_public"
    assert WebhookEndpoint.objects.count() == 0


def test_a_live_webhook_endpoint_on_a_public_host_is_created(db):
    from django.test import Client

    from hardcount.models import ApiKey, Tenant

    tenant = Tenant.objects.create(name="Live")
    _, secret = ApiKey.issue(tenant, livemode=True)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = client.post(
        "/v1/webhook_endpoints",
        data=json.dumps({"url": "https://hooks.example.com/hardcount", "enabled_events": ["*"]}),
        content_type="application/json",
    )
    assert response.status_code == 201
