"""Each class of bad input gets a 4xx with the API's error body (docs/reference/api.md), and writes nothing."""

import json

import pytest

from billing.models import Customer, Price, Subscription
from hardcount.ids import new_id
from hardcount.models import IdempotencyRecord
from outbox.models import Event
from tests.api.conftest import create_catalog


def row_counts():
    return {
        "customers": Customer.objects.count(),
        "prices": Price.objects.count(),
        "subscriptions": Subscription.objects.count(),
        "events": Event.objects.count(),
        "idempotency": IdempotencyRecord.objects.count(),
    }


@pytest.fixture
def catalog(api):
    return create_catalog(api)


def assert_refused(status, body, expected_status, *, code=None, param=None):
    assert status == expected_status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"type", "code", "message", "param"}
    assert body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param


VALID_PRICE = {"amount": 1000, "currency": "usd", "interval": "month"}


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ('{"email": "a@example.com"', "malformed_json"),
        ("{'email': 'a@example.com'}", "malformed_json"),
        ('{"amount": NaN}', "malformed_json"),
        ("[" * 100_000 + "]" * 100_000, "malformed_json"),
        ('["not", "an", "object"]', "body_not_object"),
        ('"just a string"', "body_not_object"),
        (b"\xff\xfe{}", "malformed_json"),
    ],
    ids=["truncated", "single-quotes", "nan", "deep-nesting", "array", "string", "bad-utf8"],
)
def test_malformed_json_is_400(api, raw, code):
    before = row_counts()
    status, body = api.post("/v1/customers", raw=raw, headers={"Idempotency-Key": "malformed"})
    assert_refused(status, body, 400, code=code)
    assert row_counts() == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/prices", {**VALID_PRICE, "amount": "1000"}, "amount"),
        ("/v1/prices", {**VALID_PRICE, "amount": 1000.0}, "amount"),
        ("/v1/prices", {**VALID_PRICE, "amount": 10.5}, "amount"),
        ("/v1/prices", {**VALID_PRICE, "amount": True}, "amount"),
        ("/v1/prices", {**VALID_PRICE, "amount": None}, "amount"),
        ("/v1/prices", {**VALID_PRICE, "interval_count": "2"}, "interval_count"),
        ("/v1/prices", {**VALID_PRICE, "active": "true"}, "active"),
        ("/v1/prices", {**VALID_PRICE, "currency": 840}, "currency"),
        ("/v1/customers", {"email": 12}, "email"),
        ("/v1/customers", {"email": "a@example.com", "name": ["x"]}, "name"),
        ("/v1/customers", {"email": "a@example.com", "metadata": {"k": 1}}, "metadata"),
        ("/v1/customers", {"email": "a@example.com", "metadata": ["k"]}, "metadata"),
        ("/v1/customers", {"email": "not-an-email"}, "email"),
        ("/v1/customers", {"email": "a@example.com", "default_payment_method": "card_123"}, "default_payment_method"),
        ("/v1/customers", {"email": "a@example.com", "name": "nul\x00byte"}, "name"),
        ("/v1/subscriptions", {"customer": 5, "price": "price_x"}, "customer"),
        ("/v1/subscriptions", {"customer": "not-an-id", "price": "price_x"}, "customer"),
    ],
)
def test_wrong_types_are_422(api, path, body, param):
    before = row_counts()
    status, response = api.post(path, body)
    assert_refused(status, response, 422, param=param)
    assert row_counts() == before


def test_lone_surrogate_in_a_string_is_422(api):
    before = row_counts()
    status, body = api.post("/v1/customers", raw='{"email": "a@example.com", "name": "\\ud800"}')
    assert_refused(status, body, 422, param="name")
    assert row_counts() == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/customers", {"email": "a@example.com", "is_admin": True}, "is_admin"),
        ("/v1/customers", {"email": "a@example.com", "credit_balance": 1_000_000}, "credit_balance"),
        ("/v1/prices", {**VALID_PRICE, "tenant": "ten_x"}, "tenant"),
        ("/v1/prices", {**VALID_PRICE, "livemode": True}, "livemode"),
    ],
)
def test_unknown_fields_are_422(api, path, body, param):
    before = row_counts()
    status, response = api.post(path, body)
    assert_refused(status, response, 422, code="parameter_unknown", param=param)
    assert row_counts() == before


def test_unknown_field_on_cancel_is_422_and_cancels_nothing(api, catalog):
    subscription_id = catalog["subscription"]["id"]
    status, body = api.post(f"/v1/subscriptions/{subscription_id}/cancel", {"at_end": True})
    assert_refused(status, body, 422, code="parameter_unknown", param="at_end")
    assert Subscription.objects.get(pk=subscription_id).status == "active"


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"amount": -1}, "amount"),
        ({"amount": 100_000_000}, "amount"),
        ({"amount": 10**30}, "amount"),
        ({"interval_count": 0}, "interval_count"),
        ({"interval_count": -3}, "interval_count"),
        ({"interval_count": 10**12}, "interval_count"),
        ({"interval": "month", "interval_count": 37}, "interval_count"),
        ({"interval": "year", "interval_count": 4}, "interval_count"),
        ({"interval": "fortnight"}, "interval"),
    ],
)
def test_negative_and_absurd_amounts_and_intervals_are_422(api, changes, param):
    before = row_counts()
    status, body = api.post("/v1/prices", {**VALID_PRICE, **changes})
    assert_refused(status, body, 422, param=param)
    assert row_counts() == before


def test_amount_at_the_ceiling_is_accepted(api):
    status, body = api.post("/v1/prices", {**VALID_PRICE, "amount": 99_999_999})
    assert status == 201
    assert body["amount"] == 99_999_999


@pytest.mark.parametrize("currency", ["xxx", "US", "usdd", "", "USD", "btc"])
def test_unknown_currencies_are_422(api, currency):
    before = row_counts()
    status, body = api.post("/v1/prices", {**VALID_PRICE, "currency": currency})
    assert_refused(status, body, 422, param="currency")
    assert row_counts() == before


def test_another_tenants_ids_are_404_and_write_nothing(api, other_api, catalog):
    own = create_catalog(other_api)
    before = row_counts()
    status, body = other_api.post(
        "/v1/subscriptions", {"customer": catalog["customer"]["id"], "price": own["price"]["id"]}
    )
    assert_refused(status, body, 404, code="resource_missing", param="customer")
    status, body = other_api.post(f"/v1/subscriptions/{catalog['subscription']['id']}/cancel", {})
    assert_refused(status, body, 404, code="resource_missing")
    assert row_counts() == before


def test_body_over_one_mebibyte_is_413(api):
    before = row_counts()
    body = json.dumps({"email": "a@example.com", "name": "x" * (1024 * 1024)})
    status, response = api.post("/v1/customers", raw=body, headers={"Idempotency-Key": "big"})
    assert_refused(status, response, 413, code="body_too_large")
    assert row_counts() == before


def test_body_just_under_the_limit_is_parsed(api):
    # Over the field's own limit (422), but read and parsed: the size guard is exactly 1 MiB.
    body = json.dumps({"email": "a@example.com", "name": "x" * (1024 * 1024 - 100)})
    assert len(body) <= 1024 * 1024
    status, response = api.post("/v1/customers", raw=body)
    assert_refused(status, response, 422, param="name")


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml"],
)
def test_wrong_content_type_is_415(api, content_type):
    before = row_counts()
    status, body = api.post("/v1/customers", raw='{"email": "a@example.com"}', content_type=content_type)
    assert_refused(status, body, 415, code="unsupported_media_type")
    assert row_counts() == before


def test_json_content_type_with_charset_is_accepted(api):
    status, _ = api.post(
        "/v1/customers", raw='{"email": "a@example.com"}', content_type="application/json; charset=utf-8"
    )
    assert status == 201


@pytest.mark.parametrize(
    "params",
    [{"limit": "0"}, {"limit": "101"}, {"limit": "ten"}, {"limit": "-1"}, {"limit": "1e2"}, {"sort": "asc"}],
)
def test_bad_list_parameters_are_422(api, params):
    status, body = api.get("/v1/customers", params)
    assert_refused(status, body, 422)


def test_unknown_path_under_v1_is_json_404(api):
    status, body = api.get("/v1/nothing-here")
    assert_refused(status, body, 404, code="resource_missing")


def test_malformed_path_id_is_404(api):
    status, body = api.get("/v1/customers/%00%ff")
    assert_refused(status, body, 404, code="resource_missing")
    status, body = api.get(f"/v1/customers/{new_id('price')}")
    assert_refused(status, body, 404, code="resource_missing")


def test_unsupported_method_is_405_with_allow_header(api):
    response = api.response("delete", "/v1/customers")
    assert response.status_code == 405
    assert set(response["Allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_invalid_content_length_is_400(api):
    response = api.client.generic(
        "POST",
        "/v1/customers",
        b"{}",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {api.key}",
        CONTENT_LENGTH="abc",
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_content_length"
