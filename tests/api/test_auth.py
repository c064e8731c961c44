"""Bearer-key authentication: the key decides tenant and mode; anything else is a 401 in the API's error shape."""

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


def test_key_without_bearer_scheme_is_401(acme):
    response = Api(None).client.get("/v1/customers", HTTP_AUTHORIZATION=f"Basic {acme.test}")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


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
