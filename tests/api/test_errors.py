"""Crashes: a JSON 500 without internals under /v1, and an Idempotency-Key released so the client can retry."""

from django.test import Client

from billing.services import catalog
from hardcount.models import IdempotencyRecord


def test_unexpected_exception_is_a_json_500_and_releases_the_idempotency_key(api, monkeypatch):
    def explode(**kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(catalog, "create_customer", explode)
    client = Client(raise_request_exception=False)
    response = client.post(
        "/v1/customers",
        data={"email": "a@example.com"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {api.key}",
        HTTP_IDEMPOTENCY_KEY="crash-1",
    )
    assert response.status_code == 500
    body = response.json()
    assert body["error"]["type"] == "api_error"
    assert "secret" not in response.content.decode()
    assert not IdempotencyRecord.objects.exists()

    monkeypatch.undo()
    status, _ = api.post("/v1/customers", {"email": "a@example.com"}, headers={"Idempotency-Key": "crash-1"})
    assert status == 201


def test_admin_404_stays_html(db):
    response = Client().get("/admin/does-not-exist/")
    assert response.status_code in (302, 404)
    assert not response.get("Content-Type", "").startswith("application/json")
