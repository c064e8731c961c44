"""What the invoice documents say of discounts, credit notes and usage, and the credit note's own PDF
(``GET /v1/credit_notes/{id}/pdf``).

Each PDF is read back as text (pypdf); every amount a customer reads is written out by hand (symbol, exponent,
grouping) beside the arithmetic that gives it.
"""

from __future__ import annotations

import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client

from billing.hosted import hosted_token
from billing.models import CreditNote, Invoice, SubscriptionItem
from billing.representations import credit_note_data
from billing.services import discounts
from billing.services.credit_notes import LineInput, create_credit_note, void_credit_note
from billing.services.drain import drain_due
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import DECLINING_CARD, VISA
from tests.billing.test_invoice_documents import ANCHOR, _save_page_png, _text, save_docs_image
from tests.billing.test_usage import _event, _ingest, _meter, _metered_price, _month_before

pypdf = pytest.importorskip("pypdf", reason="pypdf (requirements-dev.txt) reads the PDFs back")


@pytest.fixture
def acme(book):
    keys = make_keys("acme-internal")
    address = {"line1": "Torstraße 12", "city": "Berlin", "postal_code": "10119", "country": "DE"}
    status, _ = Api(keys.test).post("/v1/account", {"business_name": "Acme Analytics GmbH", "address": address})
    assert status == 200
    return keys


@pytest.fixture
def globex(book):
    return make_keys("Globex")


def _drain(tenant) -> None:
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


def _subscribed(book, tenant, *, amount: int, currency: str = "usd", card=VISA, coupon=None):
    customer = book.customer(tenant, currency=currency, card=card)
    customer.name = "Dana Scully"
    customer.save(update_fields=["name"])
    sub = book.subscription(customer, book.price(tenant, amount=amount, currency=currency), anchor=ANCHOR)
    if coupon is not None:
        discounts.set_subscription_discount(
            tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
        )
    _drain(tenant)
    return Invoice.objects.get(subscription=sub)


def _flat(pdf_bytes: bytes) -> str:
    """The PDF's text with every run of whitespace one space (a table cell may wrap)."""
    return " ".join(_text(pdf_bytes).split())


def _invoice_pdf(keys, invoice) -> str:
    response = Api(keys.test).response("get", f"/v1/invoices/{invoice.id}/pdf")
    assert response.status_code == 200
    return _flat(response.content)


def _note_pdf(keys, note):
    return Api(keys.test).response("get", f"/v1/credit_notes/{note.id}/pdf")


def _credit(invoice, **request) -> CreditNote:
    return create_credit_note(invoice.id, tenant_id=invoice.tenant_id, livemode=False, **request)


# ---------------------------------------------------------------------------------------------- discounts


def test_a_discounted_invoice_prints_the_coupon_row_after_the_subtotal_and_the_discounted_totals(book, acme, settings):
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    coupon = discounts.create_coupon(
        tenant_id=acme.tenant.id, livemode=False, duration="forever", percent_off=Decimal("25"), name="Launch"
    )
    invoice = _subscribed(book, acme.tenant, amount=2000, coupon=coupon)
    # 25 % of $20.00 = $5.00 off; tax 20 % of $15.00 = $3.00; total $18.00, paid.
    assert (invoice.subtotal, invoice.total_discount, invoice.tax, invoice.total) == (2000, 500, 300, 1800)

    text = _invoice_pdf(acme, invoice)

    assert "Subtotal $20.00 Launch (25% off) -$5.00 Tax (20%) $3.00 Total $18.00 Amount due $18.00" in text
    assert "Amount paid $18.00" in text
    assert "$18.00 paid" in text

    # The hosted page is the same document.
    html = Client().get(f"/i/{hosted_token(invoice)}").content.decode()
    assert "Launch (25% off)" in html and "-$5.00" in html and "$18.00" in html


def test_an_amount_off_coupon_without_a_name_prints_its_id_and_whole_yen(book, acme):
    coupon = discounts.create_coupon(
        tenant_id=acme.tenant.id, livemode=False, duration="forever", amount_off=300, currency="jpy"
    )
    invoice = _subscribed(book, acme.tenant, amount=1980, currency="jpy", coupon=coupon)
    # ¥1,980 − ¥300 = ¥1,680, untaxed.
    assert (invoice.total_discount, invoice.total) == (300, 1680)

    text = _invoice_pdf(acme, invoice)

    assert f"{coupon.id} (¥300 off) -¥300" in text
    assert "Total ¥1,680" in text and "¥1,680.00" not in text


def test_an_invoice_without_a_discount_has_no_discount_row(book, acme):
    text = _invoice_pdf(acme, _subscribed(book, acme.tenant, amount=2000))

    assert "off)" not in text and "Subtotal $20.00 Tax $0.00" in text


# ---------------------------------------------------------------------------------------------- credit notes


def test_an_invoice_prints_the_credit_notes_issued_before_and_after_payment(book, acme):
    open_invoice = _subscribed(book, acme.tenant, amount=1000, card=DECLINING_CARD)
    assert open_invoice.status == Invoice.OPEN
    _credit(open_invoice, amount=400, reason="order_change")
    paid = _subscribed(book, acme.tenant, amount=1000)
    after = _credit(paid, amount=250, reason="product_unsatisfactory", credit_amount=250)

    # Open: $10.00 − a $4.00 credit note = $6.00 due.
    text = _invoice_pdf(acme, open_invoice)
    assert "Total $10.00 Credit notes -$4.00 Amount due $6.00" in text
    assert "$6.00 due" in text
    assert "Credit note (before payment) CN-000001" in text and "Order change -$4.00" in text
    html = Client().get(f"/i/{hosted_token(open_invoice)}").content.decode()
    assert "CN-000001" in html and "Order change" in html and "-$4.00" in html and "$6.00" in html

    # Paid: $10.00 paid, then $2.50 credited to the balance.
    response = Api(acme.test).response("get", f"/v1/invoices/{paid.id}/pdf")
    save_docs_image("invoice-credit-note-example.png", lambda path: _save_page_png(response.content, path))
    text = _invoice_pdf(acme, paid)
    assert "Amount paid $10.00 Credited after payment -$2.50" in text
    assert f"Credit note (after payment) {after.number}" in text and "Product unsatisfactory -$2.50" in text

    # A void credit note credited nothing: it is no longer listed, the amount due is back.
    void_credit_note(CreditNote.objects.get(invoice=open_invoice).id, tenant_id=acme.tenant.id, livemode=False)
    text = _invoice_pdf(acme, open_invoice)
    assert "CN-000001" not in text and "Credit notes" not in text and "Amount due $10.00" in text


# ---------------------------------------------------------------------------------------------- usage


def test_a_usage_line_prints_the_units_used_and_the_period_they_were_used_in(book, acme, settings):
    tenant = acme.tenant
    anchor = _month_before(database_now() - timedelta(hours=2))
    customer = book.customer(tenant)
    sub = book.subscription(customer, book.price(tenant, amount=2000), anchor=anchor)
    metered = _metered_price(tenant, _meter(tenant), amount=2)  # 2 cents a call
    SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=metered)
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400  # to record period 0's usage after the fact
    day = timedelta(days=1)
    assert {r.status for r in _ingest(tenant, [_event(customer, 1234, anchor + day)])} == {"accepted"}
    settings.HARDCOUNT_USAGE_GRACE_S = 3600
    _drain(tenant)  # period 0, billed ahead: no usage yet
    first = Invoice.objects.get(subscription=sub)
    _drain(tenant)  # period 1, with period 0's 1,234 calls
    second = Invoice.objects.exclude(pk=first.pk).get(subscription=sub)
    # 1,234 calls × $0.02 = $24.68, on the $20.00 of period 1: $44.68.
    assert second.total == 2000 + 2468

    text = _invoice_pdf(acme, second)

    assert "1,234 × API calls usage" in text and "usage" in text
    assert "1,234 $0.02 $24.68" in text, text  # the units used, grouped as amounts are
    # The usage's period is period 0 (the first invoice's), the licensed line's period 1.
    first_period = f"{first.period_start:%B} {first.period_start.day}, {first.period_start.year} – "
    assert f"{first_period}{first.period_end:%B} {first.period_end.day}, {first.period_end.year}" in text
    assert "Total $44.68" in text


def test_a_usage_line_of_no_usage_prints_a_quantity_of_0_not_1(book, acme):
    tenant = acme.tenant
    metered = _metered_price(tenant, _meter(tenant), amount=2)
    sub = book.subscription(book.customer(tenant), metered, anchor=ANCHOR)
    _drain(tenant)  # a first invoice of metered items only: one line of no usage
    invoice = Invoice.objects.get(subscription=sub)
    assert [(line.quantity, line.amount) for line in invoice.lines.all()] == [(0, 0)]

    text = _invoice_pdf(acme, invoice)

    # The quantity cell follows the line's period: 0 units at $0.02, $0.00 (it printed 1 before usage lines).
    assert "0 × API calls usage" in text and "December 15, 2026 0 $0.02 $0.00" in text, text
    assert " 1 $0.02" not in text


# ---------------------------------------------------------------------------------------------- credit-note PDFs


def test_a_usd_credit_note_pdf_prints_the_invoice_it_credits_its_lines_tax_and_where_the_money_went(
    book, acme, settings
):
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    invoice = _subscribed(book, acme.tenant, amount=1000)
    # $10.00 + 20 % tax = $12.00 paid.
    assert (invoice.total, invoice.amount_paid) == (1200, 1200)
    line = invoice.lines.get()
    note = _credit(
        invoice,
        lines=[LineInput(invoice_line_item=line.id, amount=500)],
        reason="order_change",
        memo="Two seats unused in November.",
        refund_amount=400,
        credit_amount=200,
    )
    # $5.00 credited + 20 % tax $1.00 = $6.00: $4.00 to the card, $2.00 to the balance.
    assert (note.subtotal, note.tax, note.total) == (500, 100, 600)

    response = _note_pdf(acme, note)

    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert response["Content-Disposition"] == f'inline; filename="CreditNote-{note.number}.pdf"'
    text = _flat(response.content)
    for expected in (
        "Credit note",
        "Acme Analytics GmbH",
        "10119 Berlin",
        "Dana Scully",
        f"Credit note number {note.number}",
        f"Invoice {invoice.number}",
        "Reason Order change",
        "Two seats unused in November.",
        line.description,
        "Subtotal $5.00",
        "Tax $1.00",
        "Total credited $6.00",
        "Refunded to the card $4.00",
        "Added to the customer's credit balance $2.00",
        "$6.00 credited",
        "Amounts in USD",
    ):
        assert expected in text, (expected, text)
    assert "Taken off the amount due" not in text and "Returned outside" not in text
    save_docs_image("credit-note-example.png", lambda path: _save_page_png(response.content, path))


def test_a_jpy_credit_note_pdf_on_an_open_invoice_is_taken_off_the_amount_due_in_whole_yen(book, acme):
    invoice = _subscribed(book, acme.tenant, amount=12000, currency="jpy", card=DECLINING_CARD)
    note = _credit(invoice, amount=3000)
    invoice.refresh_from_db()
    # ¥12,000 − ¥3,000 = ¥9,000 due.
    assert (note.type, invoice.amount_due) == (CreditNote.PRE_PAYMENT, 9000)

    text = _flat(_note_pdf(acme, note).content)

    assert f"Credit on invoice {invoice.number}" in text  # by amount: one line of its subtotal
    assert "Subtotal ¥3,000" in text and "Tax ¥0" in text and "Total credited ¥3,000" in text
    assert "Taken off the amount due ¥3,000" in text
    assert "¥3,000.00" not in text and "¥30.00" not in text
    assert "Reason" not in text and "Refunded" not in text


def test_a_credit_note_pdf_is_the_same_bytes_each_time_dated_by_the_note_and_changes_when_voided(book, acme):
    invoice = _subscribed(book, acme.tenant, amount=1000, card=DECLINING_CARD)
    note = _credit(invoice, amount=300)

    first = _note_pdf(acme, note).content
    second = _note_pdf(acme, note).content

    assert first == second
    reader = pypdf.PdfReader(io.BytesIO(first))
    assert reader.metadata.creation_date == note.created_at.replace(microsecond=0)
    void_credit_note(note.id, tenant_id=acme.tenant.id, livemode=False)
    voided = _note_pdf(acme, note).content
    assert voided != first
    assert "$3.00 (void)" in _flat(voided) and "Date voided" in _flat(voided)


def test_a_credit_notes_pdf_is_its_tenants_and_modes_only_and_its_representation_links_it(book, acme, globex):
    invoice = _subscribed(book, acme.tenant, amount=1000, card=DECLINING_CARD)
    note = _credit(invoice, amount=300)

    status, body = Api(globex.test).get(f"/v1/credit_notes/{note.id}/pdf")
    assert (status, body["error"]["code"]) == (404, "resource_missing")
    status, body = Api(acme.live).get(f"/v1/credit_notes/{note.id}/pdf")
    assert (status, body["error"]["code"]) == (404, "resource_missing")
    status, body = Api(acme.test).get("/v1/credit_notes/cn_00000000000000000000000000/pdf")
    assert status in (404, 422) and body["error"]["code"] in ("resource_missing", "invalid_id")

    status, shown = Api(acme.test).get(f"/v1/credit_notes/{note.id}")
    assert status == 200 and shown["pdf"].endswith(f"/v1/credit_notes/{note.id}/pdf")
    assert shown["pdf"] == credit_note_data(note)["pdf"]
    path = shown["pdf"][shown["pdf"].index("/v1/") :]
    assert Api(acme.test).response("get", path).status_code == 200
    # A preview has no document.
    status, preview = Api(acme.test).get(f"/v1/credit_notes/preview?invoice={invoice.id}&amount=100")
    assert (status, preview["pdf"]) == (200, None)
