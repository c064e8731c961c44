"""Tenant and mode isolation for every resource: other tenants' and the other mode's ids are 404, lists never mix."""

import pytest

from billing.models import Subscription
from hardcount.ids import new_id
from outbox.models import Event
from tests.api.conftest import create_catalog, create_invoice

RESOURCES = [
    ("customer", "/v1/customers", "cus"),
    ("price", "/v1/prices", "price"),
    ("subscription", "/v1/subscriptions", "sub"),
    ("invoice", "/v1/invoices", "in"),
]


@pytest.fixture
def acme_objects(api):
    objects = create_catalog(api)
    objects["invoice"] = {"id": create_invoice(objects["subscription"]["id"]).id}
    return objects


def _missing(api, path, prefix):
    missing_id = new_id(prefix)
    status, body = api.get(f"{path}/{missing_id}")
    assert status == 404
    return missing_id, body


@pytest.mark.parametrize(("kind", "path", "prefix"), RESOURCES)
def test_owner_sees_its_object(api, acme_objects, kind, path, prefix):
    status, body = api.get(f"{path}/{acme_objects[kind]['id']}")
    assert status == 200
    assert body["id"] == acme_objects[kind]["id"]


@pytest.mark.parametrize(("kind", "path", "prefix"), RESOURCES)
def test_other_tenant_gets_404_like_a_missing_id(other_api, acme_objects, kind, path, prefix):
    object_id = acme_objects[kind]["id"]
    status, body = other_api.get(f"{path}/{object_id}")
    assert status == 404
    missing_id, missing = _missing(other_api, path, prefix)
    # Exactly the answer for an id that never existed, but for the id quoted in the message.
    assert body["error"]["code"] == "resource_missing"
    assert body == {
        "error": {**missing["error"], "message": missing["error"]["message"].replace(missing_id, object_id)}
    }


@pytest.mark.parametrize(("kind", "path", "prefix"), RESOURCES)
def test_live_key_gets_404_for_test_mode_object(live_api, acme_objects, kind, path, prefix):
    status, body = live_api.get(f"{path}/{acme_objects[kind]['id']}")
    assert status == 404
    assert body["error"]["code"] == "resource_missing"


@pytest.mark.parametrize(("kind", "path", "prefix"), RESOURCES)
def test_lists_never_mix_tenants_or_modes(api, live_api, other_api, acme_objects, kind, path, prefix):
    other_objects = create_catalog(other_api)
    live_objects = create_catalog(live_api)
    if kind == "invoice":
        other_objects["invoice"] = {"id": create_invoice(other_objects["subscription"]["id"]).id}
        live_objects["invoice"] = {"id": create_invoice(live_objects["subscription"]["id"]).id}

    def ids(client):
        status, body = client.get(path, {"limit": 100})
        assert status == 200
        return {row["id"] for row in body["data"]}

    assert ids(api) == {acme_objects[kind]["id"]}
    assert ids(other_api) == {other_objects[kind]["id"]}
    assert ids(live_api) == {live_objects[kind]["id"]}


@pytest.mark.parametrize(("kind", "path", "prefix"), RESOURCES)
def test_starting_after_another_tenants_id_is_404(other_api, acme_objects, kind, path, prefix):
    status, body = other_api.get(path, {"starting_after": acme_objects[kind]["id"]})
    assert status == 404
    assert body["error"]["param"] == "starting_after"


def test_list_filters_by_another_tenants_ids_return_nothing(api, other_api, acme_objects):
    create_catalog(other_api)
    customer, subscription = acme_objects["customer"]["id"], acme_objects["subscription"]["id"]
    assert other_api.get("/v1/subscriptions", {"customer": customer})[1]["data"] == []
    assert other_api.get("/v1/invoices", {"customer": customer})[1]["data"] == []
    assert other_api.get("/v1/invoices", {"subscription": subscription})[1]["data"] == []
    # ...while the owner's filter finds them.
    assert len(api.get("/v1/invoices", {"subscription": subscription})[1]["data"]) == 1


def test_other_tenant_cannot_cancel_a_subscription(other_api, acme_objects):
    subscription_id = acme_objects["subscription"]["id"]
    events_before = Event.objects.count()
    status, _ = other_api.post(f"/v1/subscriptions/{subscription_id}/cancel", {})
    assert status == 404
    assert Subscription.objects.get(pk=subscription_id).status == "active"
    assert Event.objects.count() == events_before


def test_live_key_cannot_cancel_a_test_subscription(live_api, acme_objects):
    subscription_id = acme_objects["subscription"]["id"]
    status, _ = live_api.post(f"/v1/subscriptions/{subscription_id}/cancel", {"at_period_end": True})
    assert status == 404
    assert Subscription.objects.get(pk=subscription_id).cancel_at_period_end is False


@pytest.mark.parametrize("client_name", ["other_api", "live_api"])
def test_subscribing_with_another_scopes_customer_or_price_is_404(request, acme_objects, client_name):
    client = request.getfixturevalue(client_name)
    own = create_catalog(client)
    count = Subscription.objects.count()
    events = Event.objects.count()
    status, body = client.post(
        "/v1/subscriptions", {"customer": acme_objects["customer"]["id"], "price": own["price"]["id"]}
    )
    assert (status, body["error"]["param"]) == (404, "customer")
    status, body = client.post(
        "/v1/subscriptions", {"customer": own["customer"]["id"], "price": acme_objects["price"]["id"]}
    )
    assert (status, body["error"]["param"]) == (404, "price")
    assert Subscription.objects.count() == count
    assert Event.objects.count() == events
