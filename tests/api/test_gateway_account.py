"""``/v1/gateway_account``: a tenant reads and sets only its own, in its key's mode; secrets never come back out.

docs/reference/gateway-accounts.md. The real API through Django's test client (tenant role, row-level
security on), real PostgreSQL; set-up reads rows as the connecting role, the tables' owner.
"""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from billing.models import GatewayAccount
from hardcount import tenancy
from hardcount.models import AuditLogEntry, IdempotencyRecord
from outbox.models import Event
from tests.api.conftest import Api

SECRET_KEY = "sk_test_51AcmeSecretKey00000000000000wxyz"
LIVE_KEY = "sk_live_51AcmeLiveKey000000000000000000live"
WEBHOOK_SECRET = "whsec_acmeSigningSecret0000000000000000"
GLOBEX_KEY = "sk_test_51GlobexSecretKey000000000000globx"
SECRETS = (SECRET_KEY, LIVE_KEY, WEBHOOK_SECRET, GLOBEX_KEY)


def put(api: Api, body: dict):
    response = api.response("put", "/v1/gateway_account", data=json.dumps(body), content_type="application/json")
    return response.status_code, response.json()


def delete(api: Api):
    response = api.response("delete", "/v1/gateway_account")
    return response.status_code, response.json()


def valid(**overrides) -> dict:
    return {"secret_key": SECRET_KEY, "webhook_secret": WEBHOOK_SECRET, **overrides}


def test_set_retrieve_and_remove_show_the_key_masked_and_never_a_secret(api):
    assert api.get("/v1/gateway_account")[0] == 404

    status, body = put(api, valid())
    assert status == 200, body
    assert body["secret_key"] == "sk_test_…wxyz"
    assert body["connect_account"] is None and body["webhook_secret_set"] is True
    assert body["webhook_path"] == f"/stripe/webhooks/{body['slug']}"
    assert len(body["slug"]) >= 20 and body["livemode"] is False
    status, shown = api.get("/v1/gateway_account")
    assert (status, shown) == (200, body)
    assert not any(secret in json.dumps(shown) for secret in SECRETS)

    # Replacing keeps the slug (the Stripe endpoint's URL stays valid).
    status, replaced = put(api, {"connect_account": "acct_1AcmeConnect0001", "webhook_secret": WEBHOOK_SECRET})
    assert status == 200
    assert (replaced["slug"], replaced["secret_key"], replaced["connect_account"]) == (
        body["slug"],
        None,
        "acct_1AcmeConnect0001",
    )

    status, removed = delete(api)
    assert (status, removed) == (200, {"id": body["id"], "object": "gateway_account", "deleted": True})
    assert api.get("/v1/gateway_account")[0] == 404
    assert delete(api)[0] == 404


def test_the_documented_shape_is_the_answers(api):
    from billing.api.gateway_accounts import GatewayAccountOut

    assert set(GatewayAccountOut().fields) == set(put(api, valid())[1])


def test_post_sets_it_too_and_its_idempotency_record_holds_no_secret(api, acme):
    status, body = api.post("/v1/gateway_account", valid(), headers={"Idempotency-Key": "set-account-1"})
    assert status == 200
    replay = api.response(
        "post",
        "/v1/gateway_account",
        data=json.dumps(valid()),
        content_type="application/json",
        headers={"Idempotency-Key": "set-account-1"},
    )
    assert replay.json() == body and replay["Idempotent-Replayed"] == "true"
    record = IdempotencyRecord.objects.get(tenant=acme.tenant, key="set-account-1")
    assert not any(secret in json.dumps(record.response_body) + record.request_fingerprint for secret in SECRETS)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (valid(secret_key=LIVE_KEY), "gateway_key_mode_mismatch", "secret_key"),
        (valid(secret_key="rk_live_51AcmeRestricted0000000000000"), "gateway_key_mode_mismatch", "secret_key"),
        (valid(secret_key="pk_test_51AcmePublishable000000000000"), None, "secret_key"),
        (valid(secret_key="sk_test_short"), None, "secret_key"),
        (valid(webhook_secret="not-a-signing-secret"), None, "webhook_secret"),
        (valid(connect_account="acct_1AcmeConnect0001"), "gateway_credentials_choice", "secret_key"),
        ({"webhook_secret": WEBHOOK_SECRET}, "gateway_credentials_choice", "secret_key"),
        ({"secret_key": SECRET_KEY}, None, "webhook_secret"),
        (valid(connect_account="cus_notAnAccount"), None, "connect_account"),
        (valid(extra="x"), None, "extra"),
    ],
)
def test_bad_credentials_are_a_422_that_changes_nothing_and_never_echo_the_secret(api, body, code, param):
    status, error = put(api, body)
    assert status == 422, error
    assert error["error"]["param"] == param
    if code:
        assert error["error"]["code"] == code
    assert not any(secret in json.dumps(error) for secret in SECRETS)
    assert GatewayAccount.objects.count() == 0


def test_a_live_key_sets_the_live_account_only_and_refuses_a_test_key(api, live_api):
    status, error = put(live_api, valid())
    assert (status, error["error"]["code"]) == (422, "gateway_key_mode_mismatch")
    status, body = put(live_api, valid(secret_key=LIVE_KEY))
    assert (status, body["livemode"], body["secret_key"]) == (200, True, "sk_live_…live")
    assert api.get("/v1/gateway_account")[0] == 404  # the test mode has none


def test_a_live_connect_account_needs_a_live_platform_key(live_api, settings):
    settings.STRIPE_API_KEY = "sk_test_hardcount_localstripe"
    status, error = put(live_api, {"connect_account": "acct_1AcmeConnect0001", "webhook_secret": WEBHOOK_SECRET})
    assert (status, error["error"]["code"]) == (422, "gateway_platform_mode_mismatch")


def test_a_tenant_reads_and_sets_only_its_own(api, other_api, acme, globex):
    assert put(api, valid())[0] == 200
    assert other_api.get("/v1/gateway_account")[0] == 404
    assert delete(other_api)[0] == 404
    status, _body = put(other_api, valid(secret_key=GLOBEX_KEY))
    assert status == 200
    assert api.get("/v1/gateway_account")[1]["secret_key"] == "sk_test_…wxyz"  # Acme's is untouched
    assert {a.tenant_id: a.key_hint for a in GatewayAccount.objects.all()} == {
        acme.tenant.pk: "sk_test_…wxyz",
        globex.tenant.pk: "sk_test_…lobx",
    }


def test_row_level_security_hides_and_protects_another_tenants_account(api, other_api, acme, globex):
    put(api, valid())
    put(other_api, valid(secret_key=GLOBEX_KEY))
    acme_id = GatewayAccount.objects.get(tenant=acme.tenant).pk
    tenancy.enter(globex.tenant.pk, False)
    try:
        assert list(GatewayAccount.objects.values_list("tenant_id", flat=True)) == [globex.tenant.pk]
        assert GatewayAccount.objects.filter(pk=acme_id).update(connect_account="acct_1Stolen0000000") == 0
        assert GatewayAccount.objects.filter(pk=acme_id).delete()[0] == 0
    finally:
        tenancy.leave()
    assert GatewayAccount.objects.get(pk=acme_id).connect_account == ""


def test_every_change_is_audited_with_its_key_and_without_a_secret(api, acme):
    put(api, valid())
    put(api, {"connect_account": "acct_1AcmeConnect0001", "webhook_secret": WEBHOOK_SECRET})
    delete(api)
    entries = list(AuditLogEntry.objects.filter(action__startswith="gateway_account.").order_by("id"))
    assert [e.action for e in entries] == ["gateway_account.set", "gateway_account.set", "gateway_account.deleted"]
    assert {(e.actor_type, e.tenant_id, e.remote_addr) for e in entries} == {
        (AuditLogEntry.API_KEY, acme.tenant.pk, "127.0.0.1")
    }
    assert entries[0].message.startswith("Set: key sk_test_…wxyz, webhook /stripe/webhooks/")
    assert entries[1].message.startswith("Replaced: Connect account acct_1AcmeConnect0001")
    assert not any(secret in e.message for e in entries for secret in SECRETS)


def _tables_holding(secrets) -> list[tuple[str, str]]:
    """(table, secret's first 8 characters) for every public table with a row whose text holds a secret."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")
        tables = [row[0] for row in cursor.fetchall()]
        assert "billing_gatewayaccount" in tables
        found = []
        for table in tables:
            for secret in secrets:
                cursor.execute(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE %s', [f"%{secret}%"])
                if cursor.fetchone()[0]:
                    found.append((table, secret[:8]))
    return found


def test_no_row_of_any_table_holds_a_secret_in_clear(api, live_api):
    put(api, valid())
    put(live_api, valid(secret_key=LIVE_KEY))
    assert _tables_holding(SECRETS) == []
    assert not Event.objects.filter(type__startswith="gateway_account").exists()
    # The column holds Fernet tokens, which do decrypt to the key...
    account = GatewayAccount.objects.get(livemode=False)
    assert re.fullmatch(r"gAAAA[A-Za-z0-9_=-]+", account.secret_key)
    from billing import vault

    assert vault.decrypt(account.secret_key) == SECRET_KEY
    # ...and the scan finds a secret stored in clear (its negative control).
    GatewayAccount.objects.filter(pk=account.pk).update(key_hint=SECRET_KEY[:40])
    assert _tables_holding([SECRET_KEY[:40]]) == [("billing_gatewayaccount", SECRET_KEY[:8])]


def test_the_admin_shows_the_account_masked_and_no_secret(api, acme):
    put(api, valid())
    account = GatewayAccount.objects.get()
    client = Client()
    client.force_login(User.objects.create_superuser("gwacct-admin", "gw@example.com", "pw-for-tests-only"))
    index = client.get("/admin/")
    assert index.status_code == 200
    pages = sorted(set(re.findall(r'href="(/admin/[a-z_]+/[a-z_]+/)"', index.content.decode())))
    assert "/admin/billing/gatewayaccount/" in pages
    detail = f"/admin/billing/gatewayaccount/{account.pk}/change/"
    for page in [*pages, detail, f"/admin/hardcount/tenant/{acme.tenant.pk}/change/"]:
        response = client.get(page)
        assert response.status_code == 200, page
        content = response.content.decode()
        assert not any(secret in content for secret in SECRETS), page
        assert account.secret_key not in content and account.webhook_secret not in content, page  # nor the tokens
    assert "sk_test_…wxyz" in client.get(detail).content.decode()
