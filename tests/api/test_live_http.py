"""The issue's acceptance scenario over a real socket: a test key creates a customer, a price and a
subscription; the live key of the same tenant sees none of them."""

import httpx

from tests.api.conftest import make_keys


def test_test_key_creates_catalog_that_the_live_key_cannot_see(live_server):
    keys = make_keys("Curl")
    test = httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {keys.test}"}, timeout=10)
    live = httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {keys.live}"}, timeout=10)

    customer = test.post("/v1/customers", json={"email": "curl@example.com"})
    assert customer.status_code == 201
    price = test.post("/v1/prices", json={"amount": 1000, "currency": "jpy", "interval": "month"})
    assert price.status_code == 201
    subscription = test.post("/v1/subscriptions", json={"customer": customer.json()["id"], "price": price.json()["id"]})
    assert subscription.status_code == 201
    assert subscription.json()["status"] == "active"

    for path, obj in (("customers", customer), ("prices", price), ("subscriptions", subscription)):
        assert test.get(f"/v1/{path}/{obj.json()['id']}").status_code == 200
        assert live.get(f"/v1/{path}/{obj.json()['id']}").status_code == 404
        assert live.get(f"/v1/{path}").json()["data"] == []

    document = httpx.get(f"{live_server.url}/v1/openapi.json", timeout=10)
    assert document.status_code == 200
    assert "/v1/subscriptions/{id}/cancel" in document.json()["paths"]
