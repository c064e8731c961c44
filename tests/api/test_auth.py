"""Bearer-key authentication: the key decides tenant and mode; anything else is a 401 in the API's error shape."""

import base64

from django.utils import timezone

from hardcount.models import ApiKey
from tests.api.conftest import Api


def assert_error(body, status, expected_status, type_="invalid_request_error"):
    assert status == expected_status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"type", "code", "message", "param"}
    assert body["error"]["type"] == type_
    assert body["error"]["message"]


def test_request_without_key_is_401(db):
    status, body = Api(None).get("/v1/customers")
    assert_error(body, status, 401, "authentication_error")


def test_unknown_key_is_401(db):
    status, body = Api("hc_test_" + "x" * 32).get("/v1/customers")
    assert_error(body, status, 401, "authentication_error")
    assert body["error"]["code"] == "invalid_api_key"


def basic(user: str, password: str = "") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_key_without_bearer_scheme_is_401(acme):
    for header in (f"Basic {acme.test}", f"Token {acme.test}", basic(acme.test)[:-2] + "!!", "Basic " + "QQ" * 300):
        response = Api(None).client.get("/v1/customers", HTTP_AUTHORIZATION=header)
        assert response.status_code == 401, header
        assert response["WWW-Authenticate"].startswith("Bearer")


def test_basic_auth_with_the_key_as_user_name_is_accepted_as_stripe_does(acme):
    created = Api(None).client.post(
        "/v1/customers",
        {"email": "curl@example.com"},
        content_type="application/json",
        HTTP_AUTHORIZATION=basic(acme.test),
    )
    assert created.status_code == 201, created.content
    assert created.json()["livemode"] is False
    # The password is ignored, as Stripe's; the key still decides tenant and mode.
    live = Api(None).client.get("/v1/customers", HTTP_AUTHORIZATION=basic(acme.live, "anything"))
    assert live.status_code == 200 and live.json()["data"] == []


def test_basic_auth_with_an_unknown_key_or_no_user_name_is_401(acme):
    for header in (basic("hc_test_" + "x" * 32), basic(""), "Basic " + base64.b64encode(acme.test.encode()).decode()):
        status = Api(None).client.get("/v1/customers", HTTP_AUTHORIZATION=header).status_code
        assert status == 401, header


def test_revoked_key_is_refused(acme):
    api = Api(acme.test)
    assert api.get("/v1/customers")[0] == 200
    ApiKey.objects.filter(tenant=acme.tenant, livemode=False).update(revoked_at=timezone.now())
    status, body = api.get("/v1/customers")
    assert_error(body, status, 401, "authentication_error")


def test_key_decides_the_mode_of_created_objects(api, live_api):
    assert api.post("/v1/customers", {"email": "t@example.com"})[1]["livemode"] is False
    assert live_api.post("/v1/customers", {"email": "l@example.com"})[1]["livemode"] is True


def test_unauthenticated_post_writes_nothing(db):
    from billing.models import Customer

    status, _ = Api(None).post("/v1/customers", {"email": "x@example.com"})
    assert status == 401
    assert Customer.objects.count() == 0


def test_only_the_key_hash_is_stored(acme):
    hashes = set(ApiKey.objects.values_list("key_hash", flat=True))
    assert acme.test not in hashes and acme.live not in hashes
    assert all(len(h) == 64 for h in hashes)
