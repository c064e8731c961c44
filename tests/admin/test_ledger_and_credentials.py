"""The credit ledger is append-only in the admin; tenants and API keys are created with the secret shown once."""

import pytest
from django.urls import reverse

from billing.models import LedgerEntry
from billing.services.ledger import grant_credit
from hardcount.models import ApiKey, Tenant, hash_api_key
from tests.admin import rows
from tests.api.conftest import Api

pytestmark = pytest.mark.django_db


def test_ledger_entries_cannot_be_added_changed_or_deleted_even_by_a_superuser(tenant, operator):
    customer = rows.subscription(tenant).customer
    entry = grant_credit(customer.pk, tenant_id=tenant.pk, livemode=False, amount=500, description="goodwill")
    change_url = reverse("admin:billing_ledgerentry_change", args=[entry.pk])
    changelist = reverse("admin:billing_ledgerentry_changelist")

    page = operator.get(change_url)
    assert page.status_code == 200 and b"goodwill" in page.content
    assert b'name="_save"' not in page.content  # a view page: no save button
    assert operator.post(change_url, {"amount": "999999", "balance_after": "999999"}).status_code == 403
    assert operator.get(reverse("admin:billing_ledgerentry_add")).status_code == 403
    assert operator.get(reverse("admin:billing_ledgerentry_delete", args=[entry.pk])).status_code == 403
    assert (
        operator.post(reverse("admin:billing_ledgerentry_delete", args=[entry.pk]), {"post": "yes"}).status_code == 403
    )
    listed = operator.get(changelist)
    assert b'value="delete_selected"' not in listed.content
    operator.post(changelist, {"action": "delete_selected", "_selected_action": [entry.pk], "post": "yes"})

    entry.refresh_from_db()
    assert (entry.amount, entry.balance_after, entry.description) == (500, 500, "goodwill")
    assert LedgerEntry.objects.count() == 1


def test_creating_an_api_key_shows_its_secret_once_and_stores_only_its_hash(tenant, operator):
    response = operator.post(reverse("admin:hardcount_apikey_add"), {"tenant": tenant.pk, "mode": "test"})

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    key = ApiKey.objects.get(tenant=tenant)
    secret = response.context["keys"][0][1]
    assert secret.startswith("hc_test_") and secret in response.content.decode()
    assert key.key_hash == hash_api_key(secret) and not key.livemode
    assert Api(secret).get("/v1/customers")[0] == 200
    assert secret.encode() not in operator.get(reverse("admin:hardcount_apikey_change", args=[key.pk])).content
    assert secret.encode() not in operator.get(reverse("admin:hardcount_apikey_changelist")).content


def test_creating_a_tenant_issues_a_test_and_a_live_key(operator):
    response = operator.post(reverse("admin:hardcount_tenant_add"), {"name": "  Initech  "})

    assert response.status_code == 200
    tenant = Tenant.objects.get(name="Initech")
    secrets = {key.livemode: secret for key, secret in response.context["keys"]}
    assert secrets[False].startswith("hc_test_") and secrets[True].startswith("hc_live_")
    assert {(k.livemode, k.key_hash) for k in ApiKey.objects.filter(tenant=tenant)} == {
        (False, hash_api_key(secrets[False])),
        (True, hash_api_key(secrets[True])),
    }


def test_a_blank_tenant_name_is_refused_and_creates_nothing(operator):
    response = operator.post(reverse("admin:hardcount_tenant_add"), {"name": "   "})

    assert response.status_code == 200 and response.context["adminform"].form.errors
    assert not Tenant.objects.exists() and not ApiKey.objects.exists()


def test_staff_without_the_add_permission_cannot_create_keys(tenant, viewer):
    response = viewer.post(reverse("admin:hardcount_apikey_add"), {"tenant": tenant.pk, "mode": "live"})

    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_revoke_from_the_key_page_locks_the_key_out(tenant, operator):
    key, secret = ApiKey.issue(tenant, livemode=False)

    response = operator.post(
        reverse("admin:hardcount_apikey_changelist"),
        {"action": "revoke", "_selected_action": [key.pk], "_return_to": "change"},
    )

    assert response["Location"] == reverse("admin:hardcount_apikey_change", args=[key.pk])
    assert Api(secret).get("/v1/customers")[0] == 401
