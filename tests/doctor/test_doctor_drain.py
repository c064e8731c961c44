"""The doctor agrees with the real billing drain: a book billed through localstripe is clean.

Customers, prices, subscriptions, credit and a webhook endpoint are made through the
services (so every event exists), then several periods are billed by ``drain_due`` against
localstripe (through the test proxy of tests/billing): paying, declining, below-minimum,
credited, JPY and gateway-failing customers. The doctor, and its gateway comparison, must find
nothing; then a charge taken but never recorded (a process killed between the charge and its
record) must be found by the gateway comparison alone.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command

from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services import close as close_module
from billing.services.catalog import create_customer, create_price, create_subscription
from billing.services.drain import drain_due
from billing.services.ledger import grant_credit
from hardcount.models import Tenant
from hardcount.times import database_now
from ops import doctor
from outbox.services import create_webhook_endpoint
from tests.billing.conftest import (  # noqa: F401  (fixtures of the localstripe proxy, used by name)
    DECLINING_CARD,
    localstripe_base,
    make_card,
    proxy_session,
    stripe_client,
    stripe_proxy,
)

# ruff: noqa: F811  (test functions take the imported fixtures as arguments)

pytestmark = pytest.mark.django_db(transaction=True)


class Killed(BaseException):
    """A process dying between two steps of a close (not an Exception: nothing catches it)."""


def failing_checks() -> dict[str, list[str]]:
    return {r.name: r.examples for r in doctor.run_checks() if r.status != doctor.OK}


def subscribe(tenant, make_card, *, card="4242424242424242", amount=1000, currency="usd", credit=0, days_due=3):
    """A customer (through the catalog) on a daily price, anchored ``days_due`` days ago: that many periods due."""
    customer = create_customer(
        tenant_id=tenant.id,
        livemode=False,
        email=f"{amount}{currency}@example.com",
        default_payment_method=make_card(card) if card else "",
    )
    price = create_price(tenant_id=tenant.id, livemode=False, amount=amount, currency=currency, interval="day")
    sub = create_subscription(tenant_id=tenant.id, livemode=False, customer_id=customer.id, price_id=price.id)
    anchor = database_now() - timedelta(days=days_due - 1, hours=1)
    Subscription.objects.filter(pk=sub.pk).update(billing_cycle_anchor=anchor, next_billing_at=anchor)
    if credit:
        grant_credit(customer.id, tenant_id=tenant.id, livemode=False, amount=credit)
    return sub


def drain_until_done(tenant) -> None:
    # Each run attempts a subscription once; three runs bill three due periods.
    for _ in range(4):
        drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=3, concurrency=4)


@pytest.fixture
def billed_book(stripe_proxy, make_card, settings):
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 825}
    tenant = Tenant.objects.create(name="Acme")
    create_webhook_endpoint(tenant_id=tenant.id, livemode=False, url="https://acme.example/hooks", enabled_events=["*"])
    subs = {
        "paying": subscribe(tenant, make_card),
        "credited": subscribe(tenant, make_card, credit=1500),
        "below_minimum": subscribe(tenant, make_card, amount=30),
        "yen": subscribe(tenant, make_card, amount=40, currency="jpy"),
        "declining": subscribe(tenant, make_card, card=DECLINING_CARD, days_due=1),
        "no_card": subscribe(tenant, make_card, card=None, days_due=1),
    }
    failing_pm = subs["paying"].customer.default_payment_method
    drain_until_done(tenant)
    # A gateway outage for one more subscription: its failure is saved, its period stays due.
    failing = subscribe(tenant, make_card, days_due=1)
    pm = failing.customer.default_payment_method
    stripe_proxy.fail_next(
        "500", times=10_000, match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )
    drain_until_done(tenant)
    stripe_proxy.clear()
    subs["failing"] = failing
    assert failing_pm  # the paying customer's card stays valid throughout
    return tenant, subs


def test_a_book_billed_by_the_drain_is_clean_and_the_gateway_agrees(billed_book):
    tenant, subs = billed_book
    statuses = sorted(Invoice.objects.filter(tenant=tenant).values_list("status", flat=True))
    assert statuses.count("paid") == 12  # 3 periods × paying, credited, below minimum, yen
    assert statuses.count("open") == 3  # the declined one, the one without a card, the failing one
    assert Subscription.objects.get(pk=subs["failing"].pk).billing_failure_count == 1
    assert PaymentAttempt.objects.filter(settled_without_charge=True).exists()
    assert failing_checks() == {}

    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("doctor", "--gateway", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert exit_info.value.code == 0, report["failed"]
    gateway = report["results"][-1]
    assert (gateway["name"], gateway["status"]) == ("gateway_agrees_with_invoices", "ok")
    assert (
        gateway["note"] == "8 invoices compared"
    )  # the charged ones (paying 3, credited 2, below 1, yen 1, declined 1)


def test_gateway_finds_a_charge_taken_but_never_recorded(stripe_proxy, make_card, monkeypatch):
    tenant = Tenant.objects.create(name="Acme")
    sub = subscribe(tenant, make_card, days_due=1)

    def die(plan, result):
        raise Killed("after the charge, before its record")

    monkeypatch.setattr(close_module.hooks, "after_charge", die)
    with pytest.raises(Killed):
        drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, concurrency=1)
    monkeypatch.setattr(close_module.hooks, "after_charge", None)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.payment_intent_id) == ("open", "")
    result = doctor.check_gateway()
    assert result.status == doctor.FAIL
    (example,) = result.examples
    assert example.startswith(f"{invoice.id}: open, but PaymentIntent pi_")
    assert example.endswith(" succeeded at the gateway")
    assert doctor.exit_status([result]) == 1


def test_gateway_finds_an_invoice_with_two_succeeded_payment_intents(stripe_proxy, make_card, stripe_client):
    # What a re-send under an expired idempotency key does (docs/decisions/0129-idempotency-keys-expire.md).
    tenant = Tenant.objects.create(name="Acme")
    sub = subscribe(tenant, make_card, days_due=1)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, concurrency=1)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == "paid"
    assert doctor.check_gateway().status == doctor.OK
    first = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id)
    second = stripe_client.v1.payment_intents.create(
        params={
            "amount": first.amount,
            "currency": first.currency,
            "customer": first.customer,
            "payment_method": first.payment_method,
            "off_session": True,
            "confirm": True,
            "metadata": first.metadata.to_dict(),
        }
    )
    assert second.status == "succeeded"

    result = doctor.check_gateway()

    assert result.status == doctor.FAIL
    (example,) = [
        e for e in result.examples if e.startswith(f"{invoice.id}: 2 succeeded PaymentIntents at the gateway")
    ]
    assert first.id in example and second.id in example
    assert doctor.exit_status([result]) == 1


def test_gateway_finds_a_paid_invoice_whose_intent_did_not_succeed(billed_book):
    _, subs = billed_book
    declined = Invoice.objects.get(subscription=subs["declining"])
    paid = Invoice.objects.filter(subscription=subs["paying"], status="paid").first()
    # The books claim the paid invoice was paid by the declined invoice's PaymentIntent.
    Invoice.objects.filter(pk=paid.pk).update(payment_intent_id=declined.payment_intent_id)
    PaymentAttempt.objects.filter(invoice=paid).update(payment_intent_id=declined.payment_intent_id)
    result = doctor.check_gateway()
    assert result.status == doctor.FAIL
    assert any(
        e.startswith(f"{paid.id}: paid, but PaymentIntent {declined.payment_intent_id} is ") for e in result.examples
    )


def test_gateway_error_is_reported_not_hidden(stripe_proxy, make_card, settings):
    tenant = Tenant.objects.create(name="Acme")
    subscribe(tenant, make_card, days_due=1)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, concurrency=1)
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # nothing listens on the discard port
    settings.HARDCOUNT_GATEWAY_TIMEOUT_S = 1.0
    result = doctor.check_gateway()
    assert result.status == doctor.ERROR
    assert "gateway unreachable" in result.note
    assert doctor.exit_status([result]) == 2
