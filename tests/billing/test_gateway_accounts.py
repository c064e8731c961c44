"""Each tenant is charged in its own Stripe account, proved at the gateway (docs/decisions/0132-gateway-accounts.md).

Real PostgreSQL, the real ``stripe`` library, localstripe behind the strict dev Stripe, which records
which account (secret key, or ``Stripe-Account`` for a Connect account) created every object and
answers ``404 resource_missing`` to any other account that names it.
"""

from __future__ import annotations

import pytest
import stripe

from billing import gateway as gw
from billing import gateway_accounts as accounts
from billing.models import Customer, Invoice
from billing.services import payments
from billing.services.drain import drain_due
from ops import doctor
from tests.billing.conftest import STRIPE_KEY

KEY_A = "sk_test_tenantAaaaaaaaaaaaaaaaaaa0001"
KEY_B = "sk_test_tenantBbbbbbbbbbbbbbbbbbb0002"
CONNECT_C = "acct_tenantC00000003"
WEBHOOK_SECRET = "whsec_test0000000000000000000000"


@pytest.fixture
def four_tenants(book):
    """A (own key), B (own key), C (Connect account), D (none: the platform account), each with one due subscription."""
    tenants = {name: book.tenant(name) for name in "ABCD"}
    accounts.set_account(tenant_id=tenants["A"].id, livemode=False, secret_key=KEY_A, webhook_secret=WEBHOOK_SECRET)
    accounts.set_account(tenant_id=tenants["B"].id, livemode=False, secret_key=KEY_B, webhook_secret=WEBHOOK_SECRET)
    accounts.set_account(
        tenant_id=tenants["C"].id, livemode=False, connect_account=CONNECT_C, webhook_secret=WEBHOOK_SECRET
    )
    subs = {name: book.subscribed(tenant) for name, tenant in tenants.items()}
    return tenants, subs


# The account each tenant's requests must carry: ProxyRequest.account (Stripe-Account, else the key).
EXPECTED = {"A": KEY_A, "B": KEY_B, "C": CONNECT_C, "D": STRIPE_KEY}


def _invoice(sub) -> Invoice:
    return Invoice.objects.get(subscription=sub)


def test_every_charge_carries_its_own_tenants_credentials(four_tenants, stripe_proxy):
    _tenants, subs = four_tenants

    run = drain_due(livemode=False, trigger="manual")

    assert run.billed == 4
    for name, sub in subs.items():
        invoice = _invoice(sub)
        customer = Customer.objects.get(pk=sub.customer_id)
        assert invoice.status == "paid", name
        # Created by that account, by the strict Stripe's ownership map...
        assert stripe_proxy.owner_of(invoice.payment_intent_id) == EXPECTED[name], name
        assert stripe_proxy.owner_of(customer.gateway_customer_id) == EXPECTED[name], name
        # ...and every request of the charge carried it.
        mine = [e for e in stripe_proxy.log if invoice.id in e.request.body.decode() or invoice.id in e.request.path]
        assert mine and {e.request.account for e in mine} == {EXPECTED[name]}, name
    connect_requests = [e for e in stripe_proxy.log if e.request.account == CONNECT_C]
    assert connect_requests  # C's charge went out with the platform key and Stripe-Account: acct_…


def test_negative_control_the_platform_gateway_for_everyone_is_caught_at_the_gateway(
    four_tenants, stripe_proxy, monkeypatch
):
    # What the ownership check would see if send() still used the platform default for every tenant.
    _tenants, subs = four_tenants
    monkeypatch.setattr(payments, "gateway_for", lambda tenant_id, livemode: gw.get_gateway())

    drain_due(livemode=False, trigger="manual")

    owners = {name: stripe_proxy.owner_of(_invoice(sub).payment_intent_id) for name, sub in subs.items()}
    assert owners == dict.fromkeys("ABCD", STRIPE_KEY)
    assert owners != EXPECTED


def test_a_tenant_never_sees_another_tenants_objects_at_the_gateway(four_tenants, stripe_proxy):
    tenants, subs = four_tenants
    drain_due(livemode=False, trigger="manual")
    a_invoice, a_customer = _invoice(subs["A"]), Customer.objects.get(pk=subs["A"].customer_id)
    gateway_a = accounts.gateway_for(tenants["A"].id, False)
    assert gateway_a.retrieve_payment_intent(a_invoice.payment_intent_id).id == a_invoice.payment_intent_id

    for other in ("B", "C", "D"):
        gateway = accounts.gateway_for(tenants[other].id, False)
        with pytest.raises(stripe.InvalidRequestError) as caught:
            gateway.retrieve_payment_intent(a_invoice.payment_intent_id)
        assert (caught.value.http_status, caught.value.code) == (404, "resource_missing")
        with pytest.raises(stripe.InvalidRequestError):
            gateway.find_invoice_payment_intents(a_customer.gateway_customer_id, a_invoice.id)
        listed = {pi.id for pi in gateway._client.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter()}
        assert a_invoice.payment_intent_id not in listed
        assert _invoice(subs[other]).payment_intent_id in listed  # its own are there
    assert stripe_proxy.entries(action="foreign")  # refused at the proxy, never forwarded


def test_gateway_for_follows_a_changed_or_removed_account(book, stripe_proxy):
    tenant = book.tenant()
    assert accounts.gateway_for(tenant.id, False) is gw.get_gateway()
    accounts.set_account(tenant_id=tenant.id, livemode=False, secret_key=KEY_A, webhook_secret=WEBHOOK_SECRET)
    first = accounts.gateway_for(tenant.id, False)
    assert first.account == gw.account_identity(KEY_A)
    assert accounts.gateway_for(tenant.id, False) is first  # cached while the account is unchanged

    accounts.set_account(tenant_id=tenant.id, livemode=False, secret_key=KEY_B, webhook_secret=WEBHOOK_SECRET)
    assert accounts.gateway_for(tenant.id, False).account == gw.account_identity(KEY_B)
    accounts.set_account(tenant_id=tenant.id, livemode=False, connect_account=CONNECT_C, webhook_secret=WEBHOOK_SECRET)
    assert accounts.gateway_for(tenant.id, False).account == CONNECT_C
    accounts.delete_account(tenant_id=tenant.id, livemode=False)
    assert accounts.gateway_for(tenant.id, False) is gw.get_gateway()
    # The other mode was never set: the platform's.
    assert accounts.gateway_for(tenant.id, True) is gw.get_gateway()


def test_webhook_account_is_found_by_its_slug(book, stripe_proxy, settings):
    tenant = book.tenant()
    account, _ = accounts.set_account(
        tenant_id=tenant.id, livemode=False, secret_key=KEY_A, webhook_secret=WEBHOOK_SECRET
    )
    found = accounts.webhook_account(account.slug)
    assert found == accounts.WebhookAccount(account.slug, WEBHOOK_SECRET, tenant.id, False)
    assert accounts.webhook_account("no-such-slug") is None
    settings.STRIPE_WEBHOOK_SECRET = "whsec_platform000000000000000000"
    assert accounts.webhook_account(accounts.PLATFORM_SLUG).tenant_id is None


def test_the_doctor_compares_each_tenant_in_its_own_account(four_tenants, stripe_proxy):
    drain_due(livemode=False, trigger="manual")

    result = doctor.check_gateway()
    assert (result.status, result.examples) == (doctor.OK, [])
    assert result.note == "4 invoices compared"

    # Negative control: the platform's account alone does not know A's, B's or C's PaymentIntents.
    platform_only = doctor.check_gateway(client=doctor._stripe_client())
    assert platform_only.status == doctor.FAIL
    assert platform_only.violations == 3
