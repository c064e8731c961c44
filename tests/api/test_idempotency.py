"""Idempotency-Key on POST: replay, conflict, scope, release on refusal, and concurrent duplicates."""

import json
import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from billing.models import Customer, Subscription
from hardcount.models import IdempotencyRecord
from outbox.models import Event
from tests.api.conftest import Api, create_catalog, make_keys

KEY = {"Idempotency-Key": "order-42"}


def test_same_key_and_body_replays_the_first_response(api):
    first = api.response(
        "post", "/v1/customers", data={"email": "a@example.com"}, content_type="application/json", headers=KEY
    )
    second = api.response(
        "post", "/v1/customers", data={"email": "a@example.com"}, content_type="application/json", headers=KEY
    )
    assert first.status_code == second.status_code == 201
    assert second.content == first.content  # byte for byte
    assert second["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert Customer.objects.count() == 1
    assert Event.objects.filter(type="customer.created").count() == 1


def test_replay_ignores_key_order_and_spacing_of_the_body(api):
    api.post("/v1/prices", raw='{"amount": 500, "currency": "usd", "interval": "week"}', headers=KEY)
    status, body = api.post("/v1/prices", raw='{"interval":"week","currency":"usd","amount":500}', headers=KEY)
    assert status == 201
    assert IdempotencyRecord.objects.count() == 1
    from billing.models import Price

    assert Price.objects.count() == 1
    assert body["amount"] == 500


def test_same_key_with_a_different_body_is_422_and_writes_nothing(api):
    api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    status, body = api.post("/v1/customers", {"email": "b@example.com"}, headers=KEY)
    assert status == 422
    assert body["error"]["code"] == "idempotency_key_reused"
    assert body["error"]["param"] == "Idempotency-Key"
    assert list(Customer.objects.values_list("email", flat=True)) == ["a@example.com"]


def test_same_key_on_another_endpoint_is_422(api):
    api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    status, body = api.post("/v1/prices", {"amount": 1, "currency": "usd", "interval": "day"}, headers=KEY)
    assert (status, body["error"]["code"]) == (422, "idempotency_key_reused")


def test_replayed_state_conflict_keeps_its_status(api):
    subscription = create_catalog(api)["subscription"]
    path = f"/v1/subscriptions/{subscription['id']}/cancel"
    assert api.post(path, {})[0] == 200
    first = api.post(path, {}, headers=KEY)
    second = api.post(path, {}, headers=KEY)
    assert first[0] == second[0] == 409
    assert first[1] == second[1]


def test_keys_are_scoped_to_tenant_and_mode(acme, globex):
    for key in (acme.test, acme.live, globex.test):
        status, _ = Api(key).post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
        assert status == 201
    assert Customer.objects.count() == 3


def test_validation_error_releases_the_key(api):
    status, _ = api.post("/v1/customers", {"email": "not-an-email"}, headers=KEY)
    assert status == 422
    assert not IdempotencyRecord.objects.exists()
    status, body = api.post("/v1/customers", {"email": "fixed@example.com"}, headers=KEY)
    assert status == 201
    assert body["email"] == "fixed@example.com"


def test_a_key_past_its_retention_can_be_used_again(api):
    api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=25))
    status, _ = api.post("/v1/customers", {"email": "b@example.com"}, headers=KEY)
    assert status == 201
    assert Customer.objects.count() == 2


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9", "tab\there"])
def test_invalid_keys_are_422(api, key):
    status, body = api.post("/v1/customers", {"email": "a@example.com"}, headers={"Idempotency-Key": key})
    assert (status, body["error"]["param"]) == (422, "Idempotency-Key")
    assert not Customer.objects.exists()


def test_request_without_a_key_is_not_recorded(api):
    api.post("/v1/customers", {"email": "a@example.com"})
    assert not IdempotencyRecord.objects.exists()


def test_in_flight_duplicate_gets_409_and_does_not_execute(transactional_db):
    """The first request holds the key while it waits on a row lock; its duplicate must not execute."""
    keys = make_keys("Race")
    api = Api(keys.test)
    catalog = create_catalog(api)
    body = {"customer": catalog["customer"]["id"], "price": catalog["price"]["id"]}
    subscriptions_before = Subscription.objects.count()

    # Hold the customer's row lock from another connection, so the first request blocks inside its service.
    blocker = connections.create_connection("default")
    blocker.set_autocommit(False)
    with blocker.cursor() as cursor:
        cursor.execute("SELECT id FROM billing_customer WHERE id = %s FOR UPDATE", [catalog["customer"]["id"]])

    first_result = {}

    def first_request():
        try:
            first_result["response"] = Api(keys.test).post("/v1/subscriptions", body, headers=KEY)
        finally:
            connection.close()

    thread = threading.Thread(target=first_request)
    thread.start()
    try:
        # Wait until the first request has claimed the key (its in-flight record is committed).
        for _ in range(500):
            if IdempotencyRecord.objects.filter(key=KEY["Idempotency-Key"], completed_at__isnull=True).exists():
                break
            thread.join(0.01)
        status, duplicate = api.post("/v1/subscriptions", body, headers=KEY)
        assert status == 409
        assert duplicate["error"]["code"] == "idempotency_key_in_use"
    finally:
        blocker.rollback()
        blocker.close()
        thread.join(10)

    assert first_result["response"][0] == 201
    assert Subscription.objects.count() == subscriptions_before + 1
    status, replay = api.post("/v1/subscriptions", body, headers=KEY)
    assert status == 201
    assert replay == first_result["response"][1]
    assert Subscription.objects.count() == subscriptions_before + 1


def test_stale_in_flight_claim_is_taken_over(api):
    """A request that died mid-way leaves an in-flight record; after 5 minutes the key executes again."""
    api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    record = IdempotencyRecord.objects.get()
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        completed_at=None, response_status=None, response_body=None, created_at=timezone.now() - timedelta(minutes=6)
    )
    Customer.objects.all().delete()
    status, body = api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    assert status == 201
    assert Customer.objects.count() == 1
    assert json.loads(IdempotencyRecord.objects.get().response_body)["id"] == body["id"]


def test_fresh_in_flight_claim_is_409(api):
    api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    IdempotencyRecord.objects.update(completed_at=None, response_status=None, response_body=None)
    status, body = api.post("/v1/customers", {"email": "a@example.com"}, headers=KEY)
    assert (status, body["error"]["code"]) == (409, "idempotency_key_in_use")
