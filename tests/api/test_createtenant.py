"""``manage.py createtenant NAME [--json]``: a tenant, one test and one live key, printed once."""

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from hardcount.models import ApiKey, Tenant
from tests.api.conftest import Api


def test_json_output_gives_working_test_and_live_keys(db):
    out = StringIO()
    call_command("createtenant", "Initech", "--json", stdout=out)
    result = json.loads(out.getvalue())
    tenant = Tenant.objects.get(pk=result["tenant"]["id"])
    assert tenant.name == "Initech"
    assert result["test_key"]["secret"].startswith("hc_test_")
    assert result["live_key"]["secret"].startswith("hc_live_")
    assert {(k.id, k.livemode) for k in ApiKey.objects.filter(tenant=tenant)} == {
        (result["test_key"]["id"], False),
        (result["live_key"]["id"], True),
    }
    status, body = Api(result["test_key"]["secret"]).post("/v1/customers", {"email": "a@example.com"})
    assert (status, body["livemode"]) == (201, False)
    status, body = Api(result["live_key"]["secret"]).get("/v1/customers")
    assert (status, body["data"]) == (200, [])


def test_plain_output_prints_both_keys(db):
    out = StringIO()
    call_command("createtenant", "Umbrella", stdout=out)
    text = out.getvalue()
    tenant = Tenant.objects.get(name="Umbrella")
    assert tenant.id in text
    test_line = next(line for line in text.splitlines() if "test key:" in line)
    live_line = next(line for line in text.splitlines() if "live key:" in line)
    assert test_line.split()[-1].startswith("hc_test_")
    assert live_line.split()[-1].startswith("hc_live_")
    assert Api(test_line.split()[-1]).get("/v1/customers")[0] == 200


def test_secrets_are_not_stored(db):
    out = StringIO()
    call_command("createtenant", "Hooli", "--json", stdout=out)
    result = json.loads(out.getvalue())
    stored = list(ApiKey.objects.values_list("key_hash", "key_hint"))
    for secret in (result["test_key"]["secret"], result["live_key"]["secret"]):
        assert all(secret not in (key_hash, hint) for key_hash, hint in stored)


def test_empty_name_is_refused(db):
    with pytest.raises(CommandError):
        call_command("createtenant", "  ")
    assert not Tenant.objects.exists()
