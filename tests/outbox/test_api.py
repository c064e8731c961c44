"""Webhook endpoints, events and deliveries over HTTP: shapes, validation, scoping, replay."""

from __future__ import annotations

import pytest
from django.db import transaction

from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
from outbox.services import emit_event
from tests.api.conftest import Api, make_keys

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(db):
    return make_keys("Acme")


@pytest.fixture
def api(acme):
    return Api(acme.test)


@pytest.fixture
def live_api(acme):
    return Api(acme.live)


@pytest.fixture
def other_api(db):
    return Api(make_keys("Globex").test)


def delete(api: Api, path: str):
    response = api.response("delete", path)
    return response.status_code, response.json()


def create_endpoint(api: Api, **body):
    body = {"url": "https://example.com/hooks", "enabled_events": ["*"], **body}
    status, data = api.post("/v1/webhook_endpoints", body)
    assert status == 201, data
    return data


def emit(tenant, type_="customer.created", livemode=False):
    with transaction.atomic():
        return emit_event(tenant_id=tenant.id, livemode=livemode, type=type_, data={"id": "cus_1"})


def test_create_returns_the_secret_once(api):
    created = create_endpoint(api, enabled_events=["invoice.*", "customer.created"], description="ERP")
    assert created["secret"].startswith("whsec_")
    assert created["id"].startswith("we_") and created["object"] == "webhook_endpoint"
    assert created["enabled_events"] == ["invoice.*", "customer.created"]
    assert created["status"] == "enabled" and created["livemode"] is False
    status, fetched = api.get(f"/v1/webhook_endpoints/{created['id']}")
    assert status == 200 and "secret" not in fetched
    status, listed = api.get("/v1/webhook_endpoints")
    assert [e["id"] for e in listed["data"]] == [created["id"]] and "secret" not in listed["data"][0]
    assert WebhookEndpoint.objects.get().secret == created["secret"]


@pytest.mark.parametrize(
    ("events", "param"),
    [
        (["invoice.payed"], "enabled_events.0"),
        (["*", "nonsense.*"], "enabled_events.1"),
        (["invoice"], "enabled_events.0"),
        ([], "enabled_events"),
    ],
)
def test_unknown_event_names_are_refused_with_422(api, events, param):
    status, body = api.post("/v1/webhook_endpoints", {"url": "https://example.com/h", "enabled_events": events})
    assert status == 422
    assert body["error"]["param"] == param
    assert WebhookEndpoint.objects.count() == 0


@pytest.mark.parametrize(
    "body",
    [
        {"url": "ftp://example.com/h", "enabled_events": ["*"]},
        {"url": "not a url", "enabled_events": ["*"]},
        {"url": 12, "enabled_events": ["*"]},
        {"url": "https://example.com/h", "enabled_events": "*"},
        {"url": "https://example.com/h", "enabled_events": [1]},
        {"url": "https://example.com/h", "enabled_events": ["*"], "secret": "mine"},
        {"enabled_events": ["*"]},
    ],
)
def test_bad_endpoint_input_is_a_422_and_writes_nothing(api, body):
    status, data = api.post("/v1/webhook_endpoints", body)
    assert status == 422, data
    assert set(data["error"]) == {"type", "code", "message", "param"}
    assert WebhookEndpoint.objects.count() == 0


def test_live_mode_endpoints_must_use_https(live_api):
    status, body = live_api.post("/v1/webhook_endpoints", {"url": "http://example.com/h", "enabled_events": ["*"]})
    assert status == 422 and body["error"]["code"] == "url_insecure"
    assert create_endpoint(live_api)["livemode"] is True


def test_update_changes_only_given_fields_and_reenabling_closes_the_circuit(api):
    created = create_endpoint(api)
    WebhookEndpoint.objects.filter(id=created["id"]).update(
        enabled=False, disabled_reason="410", consecutive_failures=9
    )
    status, updated = api.post(f"/v1/webhook_endpoints/{created['id']}", {"enabled": True})
    assert status == 200
    assert updated["status"] == "enabled" and updated["disabled_reason"] is None
    assert updated["consecutive_failures"] == 0 and updated["url"] == created["url"]
    status, _ = api.post(f"/v1/webhook_endpoints/{created['id']}", {"enabled_events": ["bogus.event"]})
    assert status == 422
    assert WebhookEndpoint.objects.get().enabled_events == ["*"]


def test_delete_stops_new_deliveries_and_hides_the_endpoint(api, acme):
    created = create_endpoint(api)
    status, body = delete(api, f"/v1/webhook_endpoints/{created['id']}")
    assert (status, body) == (200, {"id": created["id"], "object": "webhook_endpoint", "deleted": True})
    emit(acme.tenant)
    assert Delivery.objects.count() == 0
    assert api.get(f"/v1/webhook_endpoints/{created['id']}")[0] == 404
    assert api.get("/v1/webhook_endpoints")[1]["data"] == []
    assert delete(api, f"/v1/webhook_endpoints/{created['id']}")[0] == 404


def test_endpoints_events_and_deliveries_are_scoped_to_tenant_and_mode(api, live_api, other_api, acme):
    created = create_endpoint(api)
    event = emit(acme.tenant)
    delivery = Delivery.objects.get()
    for client in (live_api, other_api):
        assert client.get(f"/v1/webhook_endpoints/{created['id']}")[0] == 404
        assert client.post(f"/v1/webhook_endpoints/{created['id']}", {"enabled": False})[0] == 404
        assert delete(client, f"/v1/webhook_endpoints/{created['id']}")[0] == 404
        assert client.get(f"/v1/events/{event.id}")[0] == 404
        assert client.get(f"/v1/webhook_deliveries/{delivery.id}")[0] == 404
        assert client.post(f"/v1/webhook_deliveries/{delivery.id}/replay")[0] == 404
        assert client.get("/v1/events")[1]["data"] == []
        assert client.get("/v1/webhook_deliveries")[1]["data"] == []
        assert client.get("/v1/webhook_endpoints")[1]["data"] == []
    assert WebhookEndpoint.objects.get().enabled is True
    assert Delivery.objects.count() == 1


def test_events_list_and_retrieve_show_the_webhook_body(api, acme):
    first = emit(acme.tenant, "customer.created")
    second = emit(acme.tenant, "invoice.paid")
    status, listed = api.get("/v1/events")
    assert status == 200 and [e["id"] for e in listed["data"]] == [second.id, first.id]
    status, only = api.get("/v1/events", {"type": "invoice.paid"})
    assert [e["id"] for e in only["data"]] == [second.id]
    status, body = api.get(f"/v1/events/{first.id}")
    assert body == {
        "id": first.id,
        "object": "event",
        "type": "customer.created",
        "created": body["created"],
        "livemode": False,
        "sequence": first.sequence,
        "data": {"id": "cus_1"},
    }
    assert api.get("/v1/events", {"limit": 1})[1]["has_more"] is True


def test_deliveries_list_filters_by_event_and_shows_attempts(api, acme):
    create_endpoint(api)
    create_endpoint(api, url="https://example.org/other")
    event = emit(acme.tenant)
    emit(acme.tenant)
    delivery = Delivery.objects.filter(event=event).first()
    DeliveryAttempt.objects.create(
        delivery=delivery, number=1, outcome="retryable", status_code=500, latency_ms=12, response_excerpt="boom"
    )
    status, listed = api.get("/v1/webhook_deliveries", {"event": event.id})
    assert status == 200 and len(listed["data"]) == 2
    assert {d["event"] for d in listed["data"]} == {event.id}
    shown = next(d for d in listed["data"] if d["id"] == delivery.id)
    assert shown["attempts"] == [
        {
            "id": shown["attempts"][0]["id"],
            "object": "webhook_delivery_attempt",
            "number": 1,
            "outcome": "retryable",
            "status_code": 500,
            "latency_ms": 12,
            "error": None,
            "response_excerpt": "boom",
            "created": shown["attempts"][0]["created"],
        }
    ]
    assert api.get("/v1/webhook_deliveries", {"status": "nope"})[0] == 422
    assert api.get("/v1/webhook_deliveries", {"bogus": "1"})[0] == 422


def test_replay_creates_a_new_delivery_of_the_same_event(api, acme):
    create_endpoint(api)
    event = emit(acme.tenant)
    original = Delivery.objects.get()
    status, body = api.post(f"/v1/webhook_deliveries/{original.id}/replay")
    assert status == 409 and body["error"]["code"] == "delivery_in_progress"

    Delivery.objects.filter(id=original.id).update(status="failed", attempts=8)
    status, replay = api.post(f"/v1/webhook_deliveries/{original.id}/replay")
    assert status == 201
    assert replay["replay_of"] == original.id and replay["event"] == event.id
    assert replay["status"] == "pending" and replay["attempt_count"] == 0 and replay["attempts"] == []
    assert Delivery.objects.count() == 2

    Delivery.objects.filter(id=replay["id"]).update(status="succeeded")
    assert api.post(f"/v1/webhook_deliveries/{replay['id']}/replay")[0] == 201  # succeeded ones too


def test_replay_to_a_disabled_endpoint_is_a_409(api, acme):
    created = create_endpoint(api)
    emit(acme.tenant)
    original = Delivery.objects.get()
    Delivery.objects.filter(id=original.id).update(status="failed")
    WebhookEndpoint.objects.filter(id=created["id"]).update(enabled=False)
    status, body = api.post(f"/v1/webhook_deliveries/{original.id}/replay")
    assert status == 409 and body["error"]["code"] == "endpoint_unavailable"
    assert Delivery.objects.count() == 1


def test_malformed_ids_are_404(api):
    assert api.get("/v1/webhook_endpoints/nope")[0] == 404
    assert api.get("/v1/events/evt_bad")[0] == 404
    assert api.post("/v1/webhook_deliveries/whd_x/replay")[0] == 404


def test_deliveries_paginate_with_starting_after(api, acme):
    create_endpoint(api)
    for _ in range(3):
        emit(acme.tenant)
    status, first = api.get("/v1/webhook_deliveries", {"limit": 2})
    assert status == 200 and first["has_more"] is True
    status, rest = api.get("/v1/webhook_deliveries", {"limit": 2, "starting_after": first["data"][-1]["id"]})
    assert status == 200 and rest["has_more"] is False
    ids = [d["id"] for d in first["data"] + rest["data"]]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert api.get("/v1/webhook_deliveries", {"starting_after": "whd_00000000000000000000000000"})[0] == 404
