"""The ceiling on one line and one invoice: Stripe's largest PaymentIntent, 99,999,999 minor units. A request that
would make a line or a next invoice above it is a 422 ``amount_too_large`` naming its field and writes nothing; one
that lands exactly on it is accepted (the negative control of each refusal)."""

import json
from datetime import UTC, datetime

import pytest

from billing.models import (
    BillingAttempt,
    Invoice,
    InvoiceItem,
    PaymentAttempt,
    Subscription,
    SubscriptionItem,
    TestClock,
)
from billing.services.drain import drain_due, reconcile
from hardcount.money import MAX_AMOUNT
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events

APR_1, APR_16 = datetime(2027, 4, 1, tzinfo=UTC), datetime(2027, 4, 16, tzinfo=UTC)


@pytest.fixture
def acme(book):
    return make_keys("Acme")


def _refused(answer, param):
    status, body = answer
    assert (status, body["error"]["code"], body["error"]["param"]) == (422, "amount_too_large", param), body
    assert "99999999" in body["error"]["message"]


def _billed(book, tenant, *, amount, quantity):
    """A subscription of ``quantity`` × ``amount`` usd on a clock, April billed, the clock at Apr 16."""
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=APR_1)
    customer = book.customer(tenant, clock=clock)
    sub = book.subscription(customer, book.price(tenant, amount=amount), anchor=APR_1, quantity=quantity)
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)
    assert Invoice.objects.get(subscription=sub).total == amount * quantity
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=APR_16)
    return sub


def test_a_subscription_whose_line_or_first_invoice_would_exceed_the_ceiling_is_refused(book, acme):
    api = Api(acme.test)
    customer = book.customer(acme.tenant)
    seat = book.price(acme.tenant, amount=10_000)  # 10,000 seats: 100,000,000 > 99,999,999
    base = book.price(acme.tenant, amount=60_000_000)
    extra = book.price(acme.tenant, amount=40_000_000)  # base + extra: 100,000,000

    _refused(
        api.post("/v1/subscriptions", {"customer": customer.id, "items": [{"price": seat.id, "quantity": 10_000}]}),
        "items[0][quantity]",
    )
    _refused(
        api.post("/v1/subscriptions", {"customer": customer.id, "items": [{"price": base.id}, {"price": extra.id}]}),
        "items",
    )
    assert not Subscription.objects.exists() and not SubscriptionItem.objects.exists()
    assert events("subscription.created") == []

    # Exactly the ceiling is accepted: 9,999 seats of 10,000 plus one of 9,999 = 99,999,999.
    odd = book.price(acme.tenant, amount=9_999)
    status, body = api.post(
        "/v1/subscriptions",
        {"customer": customer.id, "items": [{"price": seat.id, "quantity": 9_999}, {"price": odd.id}]},
    )
    assert status == 201, body


def test_a_first_invoice_that_would_sweep_pending_items_past_the_ceiling_is_refused(book, acme):
    api = Api(acme.test)
    customer = book.customer(acme.tenant)
    top = book.price(acme.tenant, amount=MAX_AMOUNT)
    assert api.post("/v1/invoiceitems", {"customer": customer.id, "amount": 1, "currency": "usd"})[0] == 201

    _refused(api.post("/v1/subscriptions", {"customer": customer.id, "price": top.id}), "price")

    assert not Subscription.objects.exists()
    assert api.post("/v1/invoiceitems", {"customer": customer.id, "amount": -1, "currency": "usd"})[0] == 201
    assert api.post("/v1/subscriptions", {"customer": customer.id, "price": top.id})[0] == 201


def test_a_quantity_change_past_the_ceiling_is_refused_and_changes_nothing(book, acme, stripe_proxy):
    # 9 × 10,000,000 = 90,000,000 billed; 10 would make a 100,000,000 line.
    sub = _billed(book, acme.tenant, amount=10_000_000, quantity=9)
    item = SubscriptionItem.objects.get(subscription=sub)
    api = Api(acme.test)

    for behavior in ("create_prorations", "always_invoice", "none"):
        body = {"items": [{"id": item.id, "quantity": 10}], "proration_behavior": behavior}
        _refused(api.post(f"/v1/subscriptions/{sub.id}", body), "items[0][quantity]")
    _refused(
        api.post(
            f"/v1/subscriptions/{sub.id}", {"items": [{"id": item.id, "quantity": 10}], "effective_at": "period_end"}
        ),
        "items[0][quantity]",
    )
    # A second item within its own line but past the invoice: 90,000,000 + 10,000,000.
    extra = book.price(acme.tenant, amount=10_000_000)
    _refused(api.post(f"/v1/subscriptions/{sub.id}", {"items": [{"price": extra.id}]}), "items")
    _refused(
        api.post(f"/v1/subscriptions/{sub.id}", {"items": [{"price": extra.id}], "effective_at": "period_end"}), "items"
    )

    sub.refresh_from_db()
    assert (SubscriptionItem.objects.get(subscription=sub).quantity, sub.scheduled_items) == (9, None)
    assert not InvoiceItem.objects.exists()
    assert Invoice.objects.filter(subscription=sub).count() == 1
    assert [e for e in events("subscription.updated", data__id=sub.id) if "previous_attributes" in e.data] == []

    # Negative control: a price of 9,999,999 lands the next invoice exactly on the ceiling, with no prorations.
    fits = book.price(acme.tenant, amount=9_999_999)
    status, body = api.post(
        f"/v1/subscriptions/{sub.id}", {"items": [{"price": fits.id}], "proration_behavior": "none"}
    )
    assert status == 200, body


def test_prorations_that_would_push_the_next_invoice_past_the_ceiling_are_refused(book, acme, stripe_proxy):
    # 99,999,997 billed; a second item of 2 on Apr 16 makes 99,999,999 of lines, and its proration of 1 (2 × ½)
    # pending for the same invoice would make 100,000,000.
    sub = _billed(book, acme.tenant, amount=99_999_997, quantity=1)
    two = book.price(acme.tenant, amount=2)
    api = Api(acme.test)

    _refused(api.post(f"/v1/subscriptions/{sub.id}", {"items": [{"price": two.id}]}), "items")
    assert not InvoiceItem.objects.exists()
    # always_invoice invoices the proration now, so the next invoice is 99,999,999: accepted.
    status, body = api.post(
        f"/v1/subscriptions/{sub.id}", {"items": [{"price": two.id}], "proration_behavior": "always_invoice"}
    )
    assert status == 200, body
    (update,) = Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")
    assert update.total == 1


def test_a_pending_invoice_item_past_the_next_invoice_ceiling_is_refused(book, acme, stripe_proxy):
    sub = _billed(book, acme.tenant, amount=90_000_000, quantity=1)
    api = Api(acme.test)
    item = {"customer": sub.customer_id, "currency": "usd", "amount": 10_000_000}

    _refused(api.post("/v1/invoiceitems", {**item, "subscription": sub.id}), "amount")
    _refused(api.post("/v1/invoiceitems", item), "amount")  # of no subscription: this one's next invoice sweeps it

    assert not InvoiceItem.objects.exists()
    assert events("invoiceitem.created") == []
    # Exactly the ceiling, and a credit however large the invoice, are accepted.
    assert api.post("/v1/invoiceitems", {**item, "amount": 9_999_999, "subscription": sub.id})[0] == 201
    assert api.post("/v1/invoiceitems", {**item, "amount": -5})[0] == 201
    assert api.post("/v1/invoiceitems", {**item, "amount": 5})[0] == 201
    _refused(api.post("/v1/invoiceitems", {**item, "amount": 1}), "amount")


def test_pending_items_of_a_customer_without_a_subscription_stop_at_the_ceiling(book, acme):
    api = Api(acme.test)
    customer = book.customer(acme.tenant)
    item = {"customer": customer.id, "currency": "usd"}
    assert api.post("/v1/invoiceitems", {**item, "amount": MAX_AMOUNT})[0] == 201
    _refused(api.post("/v1/invoiceitems", {**item, "amount": 1}), "amount")
    assert InvoiceItem.objects.count() == 1


def test_a_preview_of_a_change_past_the_ceiling_is_refused_as_the_change_would_be(book, acme, stripe_proxy):
    sub = _billed(book, acme.tenant, amount=10_000_000, quantity=9)
    item = SubscriptionItem.objects.get(subscription=sub)
    api = Api(acme.test)
    extra = book.price(acme.tenant, amount=10_000_000)

    def preview(items, behavior="create_prorations"):
        query = {"subscription": sub.id, "items": json.dumps(items), "proration_behavior": behavior}
        return api.get("/v1/invoices/upcoming", query)

    _refused(preview([{"id": item.id, "quantity": 10}]), "items[0][quantity]")
    _refused(preview([{"price": extra.id}], "none"), "items")
    fits = book.price(acme.tenant, amount=9_999_999).id
    # With its proration (9,999,999 × ½ = 4,999,999.5 → 5,000,000) the next invoice would be 104,999,999: refused,
    # as that change is; without, exactly the ceiling: shown.
    _refused(preview([{"price": fits}]), "items")
    _refused(api.post(f"/v1/subscriptions/{sub.id}", {"items": [{"price": fits}]}), "items")
    status, body = preview([{"price": fits}], "none")
    assert status == 200, body
    assert body["subtotal"] == MAX_AMOUNT


# -- tax past the ceiling at the close (decision 0231) --------------------------------------------------------------

TAXED_OVER = 90_000_000  # under the ceiling; with 20 % tax 108,000,000, over it


@pytest.fixture(params=["page", "per_close"])
def page_close(request, settings):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = request.param == "page"
    return request.param


def _intent_amounts(stripe_proxy) -> list[str]:
    return [entry.request.params["amount"] for entry in stripe_proxy.entries("POST /v1/payment_intents")]


def test_tax_that_carries_an_invoice_past_one_payment_holds_it_and_the_period_closes(
    book, settings, stripe_proxy, page_close
):
    """The request's ceiling checks the subtotal; a 20 % tax then carries 90,000,000 to 108,000,000, which no
    PaymentIntent takes. The close holds that draft for an operator (as usage beyond a payment, decision 0217),
    advances the period and charges nothing for it; the tenant's other subscription is billed as usual."""
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    tenant = book.tenant()
    big, small = book.subscribed(tenant, amount=TAXED_OVER), book.subscribed(tenant, amount=1000)

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    invoice = Invoice.objects.get(subscription=big)
    assert (invoice.status, invoice.hold_reason, invoice.number) == ("draft", "amount_too_large", None)
    assert (invoice.subtotal, invoice.tax, invoice.total, invoice.amount_due) == (
        TAXED_OVER,
        18_000_000,
        108_000_000,
        108_000_000,
    )
    assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
    big.refresh_from_db()
    assert (big.periods_billed, big.billing_failure_count, big.last_billing_error) == (1, 0, "")
    assert BillingAttempt.objects.get(run=run, subscription=big).outcome == "held"
    assert Invoice.objects.get(subscription=small).status == "paid"
    assert _intent_amounts(stripe_proxy) == ["1200"]
    run.refresh_from_db()
    assert (run.billed, run.failed) == (2, 0)


def test_negative_control_without_the_hold_the_taxed_invoice_is_charged_and_refused(
    book, settings, stripe_proxy, monkeypatch
):
    """With the check raised out of reach, the same invoice is finalised and sent, and the strict Stripe refuses
    the PaymentIntent (amount_too_large): a charge that can never succeed, put on the retry ladder."""
    from billing.services import close

    monkeypatch.setattr(close, "MAX_AMOUNT", 10**12)  # the one check, in apply_tax, which both close paths share
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    tenant = book.tenant()
    sub = book.subscribed(tenant, amount=TAXED_OVER)

    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.hold_reason) == ("open", "")
    assert _intent_amounts(stripe_proxy) == ["108000000"]
    sub.refresh_from_db()
    assert list(PaymentAttempt.objects.filter(invoice=invoice).values_list("outcome", flat=True)) == ["error"]
    assert sub.billing_failure_count == 1
    assert "Amount must be no more than 99,999,999" in sub.last_billing_error


def test_the_tax_reconciler_holds_what_its_tax_carries_past_one_payment_and_goes_on(book, settings, stripe_proxy):
    """A draft left pending by a tax outage is taxed by the reconciler once the provider answers: one carried past
    the ceiling is held (not charged), and the pass goes on to finalise and charge the next."""
    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.DownTaxProvider"
    tenant = book.tenant()
    big = book.subscribed(tenant, amount=TAXED_OVER)
    small = book.subscribed(tenant, amount=1000)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    assert set(Invoice.objects.filter(tenant=tenant).values_list("tax_status", flat=True)) == {"pending"}

    settings.HARDCOUNT_TAX_PROVIDER = "billing.tax.TableRateTaxProvider"
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    counts = reconcile(livemode=False)

    held = Invoice.objects.get(subscription=big)
    assert (held.status, held.hold_reason, held.tax_status, held.total) == (
        "draft",
        "amount_too_large",
        "calculated",
        108_000_000,
    )
    assert Invoice.objects.get(subscription=small).status == "paid"
    assert (counts["tax_finalized"], counts["tax_pending"]) == (1, 0)
    assert _intent_amounts(stripe_proxy) == ["1200"]
    # A held draft is no longer pending: the next pass leaves it alone.
    assert reconcile(livemode=False)["tax_finalized"] == 0
    held.refresh_from_db()
    assert held.status == "draft"
