"""Money on invoices: zero and below-minimum amounts, credit applied before charging, tax, void and pay."""

import pytest

from billing.models import Invoice, LedgerEntry, PaymentAttempt
from billing.services.drain import drain_due, reconcile
from billing.services.invoices import InvoiceStateError, pay_invoice, void_invoice
from billing.services.ledger import grant_credit
from billing.tax import TableRateTaxProvider, TaxableInvoice, tax_on
from hardcount.errors import InvalidRequestError, NotFoundError
from tests.billing.conftest import DECLINING_CARD, events


def _drain(tenant):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


def test_a_zero_amount_invoice_is_paid_without_a_call(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant, amount=0)

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (invoice.status, invoice.amount_due, invoice.amount_paid) == ("paid", 0, 0)
    assert (attempt.outcome, attempt.settled_without_charge, attempt.idempotency_key) == ("succeeded", True, "")
    assert stripe_proxy.log == []


def test_a_below_minimum_amount_is_carried_to_the_balance_and_added_to_the_next_invoice(book, tenant, stripe_proxy):
    customer = book.customer(tenant)
    small = book.subscription(customer, book.price(tenant, amount=30))  # USD minimum is 50 cents

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=small)
    customer.refresh_from_db()
    assert (invoice.status, invoice.amount_due, invoice.amount_paid) == ("paid", 30, 0)
    assert customer.credit_balance == -30
    carried = LedgerEntry.objects.get(customer=customer)
    assert (carried.reason, carried.amount, carried.balance_after, carried.invoice_id) == (
        "carried_debit",
        -30,
        -30,
        invoice.id,
    )
    assert stripe_proxy.log == []

    book.subscription(customer, book.price(tenant, amount=1000))
    _drain(tenant)

    following = Invoice.objects.exclude(pk=invoice.pk).get(customer=customer)
    customer.refresh_from_db()
    assert (following.total, following.credit_applied, following.amount_due, following.amount_paid) == (
        1000,
        -30,
        1030,
        1030,
    )
    assert customer.credit_balance == 0
    assert stripe_proxy.entries("POST /v1/payment_intents")[0].request.params["amount"] == "1030"


def test_credit_is_applied_before_charging_and_the_ledger_keeps_a_running_balance(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant, amount=1000)
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=250, description="goodwill")
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=-50)

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.credit_applied, invoice.amount_due, invoice.amount_paid) == (200, 800, 800)
    entries = list(LedgerEntry.objects.filter(customer_id=sub.customer_id).order_by("created_at", "id"))
    assert [(e.reason, e.amount, e.balance_after) for e in entries] == [
        ("grant", 250, 250),
        ("adjustment", -50, 200),
        ("applied_to_invoice", -200, 0),
    ]
    assert stripe_proxy.entries("POST /v1/payment_intents")[0].request.params["amount"] == "800"
    assert [e.data["amount"] for e in events("customer.credit_granted")] == [250, -50]


def test_credit_covering_the_whole_invoice_pays_it_without_a_call(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant, amount=1000)
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=5000)

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    sub.customer.refresh_from_db()
    assert (invoice.status, invoice.credit_applied, invoice.amount_due) == ("paid", 1000, 0)
    assert sub.customer.credit_balance == 4000
    assert stripe_proxy.log == []


def test_credit_in_another_currency_and_zero_amounts_are_refused(book, tenant):
    customer = book.customer(tenant, currency="usd")
    with pytest.raises(InvalidRequestError) as wrong_currency:
        grant_credit(customer.id, tenant_id=tenant.id, livemode=False, amount=100, currency="eur")
    with pytest.raises(InvalidRequestError):
        grant_credit(customer.id, tenant_id=tenant.id, livemode=False, amount=0)
    with pytest.raises(NotFoundError):
        grant_credit(customer.id, tenant_id=tenant.id, livemode=True, amount=100)
    assert wrong_currency.value.param == "currency"
    assert not LedgerEntry.objects.exists()


def test_table_rate_tax_rounds_half_up_and_is_charged(book, tenant, stripe_proxy, settings):
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 825}
    sub = book.subscribed(tenant, amount=1000)

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.tax_status, invoice.tax_rate_bps, invoice.tax, invoice.total) == ("calculated", 825, 83, 1083)
    assert stripe_proxy.entries("POST /v1/payment_intents")[0].request.params["amount"] == "1083"


def test_tax_rounding_rule():
    assert (tax_on(1000, 825), tax_on(1005, 1000), tax_on(1004, 1000), tax_on(0, 2000)) == (83, 101, 100, 0)
    quote = TableRateTaxProvider().calculate(TaxableInvoice("ten_x", False, "cus_x", "jpy", 999))
    assert (quote.applicable, quote.amount) == (False, 0)


def test_a_tax_outage_leaves_a_pending_draft_advances_the_period_and_reconcile_charges_it(
    book, tenant, stripe_proxy, settings
):
    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.DownTaxProvider"
    sub = book.subscribed(tenant, amount=1000)

    run = _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    sub.refresh_from_db()
    assert (run.billed, run.failed) == (1, 0)
    assert (invoice.status, invoice.tax_status, invoice.number) == ("draft", "pending", None)
    assert (sub.periods_billed, sub.billing_failure_count) == (1, 0)
    assert stripe_proxy.log == []
    assert reconcile(livemode=False)["tax_pending"] == 1

    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.TenPercentTaxProvider"
    counts = reconcile(livemode=False)

    invoice.refresh_from_db()
    assert counts["tax_finalized"] == 1
    assert (invoice.status, invoice.tax_status, invoice.tax, invoice.amount_paid) == ("paid", "calculated", 100, 1100)
    assert invoice.number == "000001"


def test_void_returns_the_applied_credit_and_ends_dunning(book, tenant):
    from dunning.models import DunningRun

    sub = book.subscribed(tenant, card=DECLINING_CARD, amount=1000)
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=100)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.credit_applied) == ("open", 100)

    void_invoice(invoice.id, tenant_id=tenant.id, livemode=False)

    invoice.refresh_from_db()
    sub.refresh_from_db()
    sub.customer.refresh_from_db()
    assert invoice.status == "void" and invoice.voided_at is not None
    assert sub.customer.credit_balance == 100
    assert DunningRun.objects.get(invoice=invoice).status == "ended"
    assert sub.status == "active"
    assert [e.data["status"] for e in events("invoice.voided")] == ["void"]


def test_paid_invoices_cannot_be_voided_or_paid_again(book, tenant):
    sub = book.subscribed(tenant)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)

    with pytest.raises(InvoiceStateError):
        void_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    with pytest.raises(InvoiceStateError):
        pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    with pytest.raises(NotFoundError):
        pay_invoice(invoice.id, tenant_id=tenant.id, livemode=True)
    assert PaymentAttempt.objects.count() == 1


def test_paying_a_declined_invoice_with_a_new_card_recovers_the_subscription(book, tenant, make_card):
    from dunning.models import DunningRun

    sub = book.subscribed(tenant, card=DECLINING_CARD)
    _drain(tenant)
    invoice = Invoice.objects.get(subscription=sub)
    customer = sub.customer
    customer.default_payment_method = make_card()
    customer.save(update_fields=["default_payment_method"])

    invoice, _attempt, outcome = pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)

    sub.refresh_from_db()
    assert (outcome.kind, invoice.status, sub.status) == ("billed", "paid", "active")
    assert DunningRun.objects.get(invoice=invoice).status == "recovered"
    assert sub.periods_billed == 1  # the decline had already advanced the period
