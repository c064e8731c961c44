"""A secret the API shows once is stored nowhere else: never in an idempotency record (docs/decisions/0125).

``POST /v1/webhook_endpoints`` answers with the endpoint's signing secret. Under an
``Idempotency-Key`` the record keeps the response for a replay; it keeps a marker in the
secret's place, and the replay reads the secret again from the endpoint, so the client gets
the first response byte for byte.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection

from hardcount import idempotency
from hardcount.models import IdempotencyRecord
from outbox.models import WebhookEndpoint
from tests.api.conftest import Api, make_keys

pytestmark = pytest.mark.django_db

KEY = {"Idempotency-Key": "create-endpoint-1"}
BODY = {"url": "https://example.com/hooks", "enabled_events": ["*"], "description": "billing"}


@pytest.fixture
def acme(db):
    return make_keys("Acme")


@pytest.fixture
def api(acme) -> Api:
    return Api(acme.test)


def create(api: Api, headers=KEY, body=BODY):
    return api.response(
        "post", "/v1/webhook_endpoints", data=json.dumps(body), content_type="application/json", headers=headers
    )


def stored_bodies() -> list[str]:
    """Every idempotency record's stored body as PostgreSQL holds it (the column's text, not the ORM's value)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(response_body::text, '') FROM hardcount_idempotencyrecord")
        return [row[0] for row in cursor.fetchall()]


def test_the_record_of_an_endpoint_creation_holds_no_secret(api):
    first = create(api)
    assert first.status_code == 201
    secret = first.json()["secret"]
    assert secret.startswith("whsec_")

    bodies = stored_bodies()
    assert len(bodies) == 1
    for text in bodies:
        assert secret not in text
        assert secret.removeprefix("whsec_") not in text
    stored = json.loads(IdempotencyRecord.objects.get().response_body)  # the column holds the body as a string
    assert stored["secret"] == idempotency.SECRET_MARKER
    assert stored["id"] == first.json()["id"]


def test_a_replay_answers_the_first_response_byte_for_byte_secret_included(api):
    first = create(api)
    replay = create(api)
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    assert replay.json()["secret"] == WebhookEndpoint.objects.get().secret
    assert WebhookEndpoint.objects.count() == 1
    assert all(first.json()["secret"] not in text for text in stored_bodies())


def test_a_replay_after_the_endpoint_was_deleted_still_answers_the_first_response(api):
    first = create(api)
    assert api.response("delete", f"/v1/webhook_endpoints/{first.json()['id']}").status_code == 200
    replay = create(api)
    assert (replay.status_code, replay.content) == (201, first.content)


def test_a_replay_whose_secret_is_gone_is_a_409_and_creates_nothing(api):
    create(api)
    WebhookEndpoint.objects.all().delete()  # no API does this; a tenant's rows removed by hand would
    replay = create(api)
    assert replay.status_code == 409
    assert replay.json()["error"]["code"] == "idempotency_secret_unavailable"
    assert replay.json()["error"]["param"] == "Idempotency-Key"
    assert "whsec_" not in replay.content.decode()
    assert WebhookEndpoint.objects.count() == 0


def test_secrets_of_other_tenants_or_modes_are_never_read_by_a_replay(api, acme):
    create(api)
    live = create(Api(acme.live), body={**BODY, "url": "https://example.org/hooks"})
    assert live.status_code == 201
    # Same key in the other mode is another record: each replay reads its own endpoint's secret.
    assert create(Api(acme.live), body={**BODY, "url": "https://example.org/hooks"}).content == live.content
    assert create(api).json()["secret"] == WebhookEndpoint.objects.get(livemode=False).secret


def test_redaction_also_replaces_a_copy_of_the_secret_elsewhere_in_the_body():
    content = b'{"id":"we_1","secret":"whsec_abc","note":"was whsec_abc"}'
    redacted = idempotency.redact_secrets(content, ["secret"])
    assert b"whsec_abc" not in redacted
    assert json.loads(redacted)["secret"] == idempotency.SECRET_MARKER


def test_bodies_without_declared_secrets_are_stored_as_rendered():
    content = b'{"from": "a view without secrets"}'
    assert idempotency.redact_secrets(content, []) is content
    assert idempotency.redact_secrets(content, ["secret"]) is content
    assert idempotency.redact_secrets(b"[1, 2]", ["secret"]) == b"[1, 2]"


def test_the_admin_view_of_a_body_masks_secret_named_fields_at_any_depth():
    # A record stored before decision 0125 kept the secret in clear; the admin never shows it.
    stored = json.dumps({"id": "we_1", "secret": "whsec_old", "data": [{"api_key": "hc_test_x", "password": "p"}]})
    shown = idempotency.display_body(stored)
    for value in ("whsec_old", "hc_test_x", '"p"'):
        assert value not in shown
    assert '"id": "we_1"' in shown
    assert idempotency.display_body("not json whsec_x") == "(not JSON: not shown)"
    assert idempotency.display_body(None) == ""
