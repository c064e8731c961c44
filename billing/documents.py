"""Invoice documents: what a finalized invoice prints, as a PDF (WeasyPrint) and on its hosted page.

:func:`invoice_document` reads an invoice into an :class:`InvoiceDocument`, every amount already
written for people (:func:`hardcount.money.display`: the invoice currency's symbol and exponent,
``HARDCOUNT_DOCUMENT_LOCALE``'s grouping), every date in UTC. The PDF template and the hosted page
render that one object, so both say the same. :func:`render_pdf` turns it into PDF bytes that are
the same for the same invoice in the same state: the PDF's dates are the invoice's own
(``dcterms.created``/``modified`` meta, which WeasyPrint writes as ``CreationDate``/``ModDate``) and
its file identifier is derived from the invoice's id (WeasyPrint's ``pdf_identifier``).

The totals are rows of one list and the document has a list of adjustments: the invoice's discount is
a row between the subtotal and the tax, named by its coupon (Stripe's invoice layout); the credit notes
issued against the invoice are adjustments, and their sums are rows of the totals (before payment they
lowered the amount due). A metered line prints the units used over its own period (the one before the
invoice's). A credit note's own PDF is another :class:`InvoiceDocument` (``title="Credit note"``,
:func:`credit_note_document`) through the same :func:`render_pdf`. Rules:
docs/reference/invoice-documents.md, docs/decisions/0160 and 0168.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime

from babel import Locale
from babel.numbers import format_decimal
from django.conf import settings
from django.template.loader import render_to_string

from billing import gateway as gw
from billing.hosted import has_document
from billing.models import CreditNote, Invoice, PaymentAttempt, Price
from hardcount.money import display

TEMPLATE = "billing/invoice_document.html"

# WeasyPrint logs every step of every render at INFO.
logging.getLogger("weasyprint").setLevel(logging.WARNING)
logging.getLogger("weasyprint.progress").setLevel(logging.WARNING)

# Where the system lacks HarfBuzz-Subset (Debian's libharfbuzz-subset0), WeasyPrint subsets the fonts with
# fontTools, which stamps each embedded font's ``head.modified`` with the time of the render: two renders a
# second apart differ. fontTools takes that time from SOURCE_DATE_EPOCH when set (the reproducible-builds
# convention), so a fixed one keeps the bytes the same. Its value is never shown: the PDF's own dates are
# the document's. docs/decisions/0211.
FONT_TIMESTAMP_EPOCH = "1767225600"  # 2026-01-01T00:00:00Z


class NotFinalized(ValueError):
    """Raised for a draft invoice: it has no number and no document yet."""


@dataclass(frozen=True)
class Party:
    """The seller or the customer as printed: a name, then address lines and contact lines (blank ones dropped)."""

    name: str
    lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class DocumentLine:
    """One line as printed: ``amount`` (and ``unit_amount``, blank when the line has none) formatted; ``quantity``
    blank when the line has none (a credit note by amount). ``usage``: a metered line, its quantity the units used."""

    description: str
    period: str
    quantity: int | str
    unit_amount: str
    amount: str
    proration: bool
    usage: bool = False


@dataclass(frozen=True)
class TotalRow:
    """One row of the totals: ``kind`` is ``subtotal``, ``discount``, ``tax``, ``total``, ``credit``,
    ``pre_payment_credit_notes``, ``amount_due``, ``amount_paid``, ``post_payment_credit_notes``, or on a credit
    note where its money went (``pre_payment``, ``refund``, ``credit_balance``, ``out_of_band``); ``amount`` is
    formatted (what lowers the amount negative)."""

    kind: str
    label: str
    amount: str
    emphasis: bool = False


@dataclass(frozen=True)
class Adjustment:
    """A document issued against this one (a credit note): its number, date, reason and amount, formatted."""

    label: str
    number: str
    date: str
    amount: str
    reason: str = ""


@dataclass(frozen=True)
class InvoiceDocument:
    """Everything a document shows, formatted. ``issued_at`` dates the PDF itself; ``memo`` is a credit note's."""

    title: str
    id: str
    number: str
    currency: str
    status: str
    payment_status: str
    requires_action: bool
    seller: Party
    bill_to: Party
    dates: tuple[tuple[str, str], ...]
    lines: tuple[DocumentLine, ...]
    totals: tuple[TotalRow, ...]
    amount_headline: str
    issued_at: datetime
    livemode: bool
    adjustments: tuple[Adjustment, ...] = field(default=())
    memo: str = ""


def locale() -> str:
    """The locale documents write amounts in (``HARDCOUNT_DOCUMENT_LOCALE``, a Babel name; ``en_US`` by default)."""
    return getattr(settings, "HARDCOUNT_DOCUMENT_LOCALE", "en_US")


def _date(value: datetime | None) -> str:
    """``January 31, 2027`` in UTC; blank for None."""
    return "" if value is None else value.astimezone(UTC).strftime("%B %-d, %Y")


def _period(start: datetime, end: datetime) -> str:
    return f"{_date(start)} – {_date(end)}"


def _country_name(code: str) -> str:
    """``Germany`` for ``DE`` (CLDR's English names, through Babel); the code itself when unknown."""
    return Locale("en").territories.get(code, code) if code else ""


def _seller(tenant) -> Party:
    place = " ".join(p for p in (tenant.postal_code, tenant.city) if p)
    lines = (tenant.address_line1, tenant.address_line2, place, tenant.state, _country_name(tenant.country))
    return Party(tenant.display_name, tuple(line for line in lines if line))


def _bill_to(customer) -> Party:
    # Customers carry a name and an email today; an address, when customers have one, goes between them.
    if customer.name:
        return Party(customer.name, (customer.email,) if customer.email else ())
    return Party(customer.email)


def _usage_unit_amount(price: Price, money) -> str:
    """A metered price's amount per unit used; blank when there is no one (tiers, units billed in packages)."""
    if price.billing_scheme == Price.TIERED or price.transform_divide_by:
        return ""
    return money(price.amount)


def _line(line, money) -> DocumentLine:
    price = line.price
    if price is not None and price.is_metered:
        # Billed in arrears: the quantity is the units used (none is 0, not 1) over the line's own period,
        # the one before the invoice's (docs/decisions/0166).
        return DocumentLine(
            description=line.description,
            period=_period(line.period_start, line.period_end),
            quantity=format_decimal(line.quantity, locale=locale()),
            unit_amount=_usage_unit_amount(price, money),
            amount=money(line.amount),
            proration=line.proration,
            usage=True,
        )
    quantity = line.quantity or 1
    unit = money(line.amount // quantity) if line.amount % quantity == 0 else ""
    return DocumentLine(
        description=line.description,
        period=_period(line.period_start, line.period_end),
        quantity=quantity,
        unit_amount=unit,
        amount=money(line.amount),
        proration=line.proration,
    )


def _percent(value) -> str:
    """``25`` for Decimal("25.00"), ``12.5`` for Decimal("12.50")."""
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _discount_label(invoice: Invoice) -> str:
    """The coupon's name (its id when it has none) and its terms: ``Launch (25% off)``, ``Loyal ($5.00 off)``."""
    discount = invoice.discount
    if discount is None:
        return "Discount"
    coupon = discount.coupon
    name = coupon.name or coupon.id
    if coupon.percent_off is not None:
        return f"{name} ({_percent(coupon.percent_off)}% off)"
    return f"{name} ({display(coupon.amount_off, coupon.currency, locale=locale())} off)"


def _tax_label(invoice: Invoice) -> str:
    if invoice.tax_status == Invoice.TAX_NOT_APPLICABLE or not invoice.tax_rate_bps:
        return "Tax"
    percent = f"{invoice.tax_rate_bps / 100:.2f}".rstrip("0").rstrip(".")
    return f"Tax ({percent}%)"


def _totals(invoice: Invoice, money) -> tuple[TotalRow, ...]:
    """Subtotal, the discount (its coupon and the amount taken off, before tax as Stripe's), tax, total, credit
    applied, the credit notes issued while open, amount due, on a paid invoice the amount paid, and the credit
    notes issued after payment. ``subtotal - discount + tax = total`` and ``total - credit applied - credit notes
    before payment = amount due`` read down the rows."""
    rows = [TotalRow("subtotal", "Subtotal", money(invoice.subtotal))]
    if invoice.total_discount:
        rows.append(TotalRow("discount", _discount_label(invoice), money(-invoice.total_discount)))
    rows.append(TotalRow("tax", _tax_label(invoice), money(invoice.tax)))
    rows.append(TotalRow("total", "Total", money(invoice.total)))
    if invoice.credit_applied:
        rows.append(TotalRow("credit", "Credit applied", money(-invoice.credit_applied)))
    if invoice.pre_payment_credit_notes_amount:
        amount = money(-invoice.pre_payment_credit_notes_amount)
        rows.append(TotalRow("pre_payment_credit_notes", "Credit notes", amount))
    rows.append(TotalRow("amount_due", "Amount due", money(invoice.amount_due), emphasis=True))
    if invoice.status == Invoice.PAID:
        rows.append(TotalRow("amount_paid", "Amount paid", money(invoice.amount_paid)))
    if invoice.post_payment_credit_notes_amount:
        amount = money(-invoice.post_payment_credit_notes_amount)
        rows.append(TotalRow("post_payment_credit_notes", "Credited after payment", amount))
    return tuple(rows)


def reason_text(reason: str) -> str:
    """``Order change`` for ``order_change``; blank for none."""
    return reason.replace("_", " ").capitalize()


def _adjustments(invoice: Invoice, money) -> tuple[Adjustment, ...]:
    """The invoice's issued credit notes, oldest first (a void one credited nothing: Stripe's sums leave it out)."""
    notes = invoice.credit_notes.filter(status=CreditNote.ISSUED).order_by("created_at", "number")
    return tuple(
        Adjustment(
            label="Credit note" + (" (before payment)" if note.type == CreditNote.PRE_PAYMENT else " (after payment)"),
            number=note.number,
            date=_date(note.created_at),
            amount=money(-note.total),
            reason=reason_text(note.reason),
        )
        for note in notes
    )


def _latest_attempt(invoice: Invoice) -> PaymentAttempt | None:
    return invoice.payment_attempts.order_by("-attempt_number", "-started_at").first()


def payment_status(invoice: Invoice, attempt: PaymentAttempt | None) -> tuple[str, bool]:
    """``(what the document says of the payment, whether it waits for the customer's action)``.

    An open invoice whose last attempt's PaymentIntent is ``requires_action`` waits for the customer to
    authenticate (docs/reference/payments.md); ``processing`` settles by itself later.
    """
    if invoice.status == Invoice.PAID:
        return f"Paid on {_date(invoice.paid_at)}", False
    if invoice.status == Invoice.VOID:
        return f"Void since {_date(invoice.voided_at)}: nothing is owed", False
    if invoice.status == Invoice.UNCOLLECTIBLE:
        return "Uncollectible", False
    if attempt is not None and attempt.outcome == PaymentAttempt.UNKNOWN:
        if attempt.payment_intent_status == gw.REQUIRES_ACTION:
            return "Payment needs your confirmation", True
        if attempt.payment_intent_status == gw.PROCESSING:
            return "Payment processing", False
        return "Payment in progress", False
    if attempt is not None and attempt.outcome == PaymentAttempt.DECLINED:
        return "Payment failed: due", False
    return "Due", False


def invoice_document(invoice: Invoice) -> InvoiceDocument:
    """The document of a finalized ``invoice`` (any status but draft). Raises :class:`NotFinalized` for a draft.

    Reads the invoice's tenant, customer, lines and their prices, discount and coupon, credit notes and latest
    payment attempt (a handful of queries).
    """
    if not has_document(invoice):
        raise NotFinalized(f"Invoice {invoice.id} is a draft: it has no document until it is finalized.")

    def money(amount: int) -> str:
        return display(amount, invoice.currency, locale=locale())

    status, requires_action = payment_status(invoice, _latest_attempt(invoice))
    dates = [("Invoice number", invoice.number or ""), ("Date of issue", _date(invoice.finalized_at))]
    dates.append(("Billing period", _period(invoice.period_start, invoice.period_end)))
    if invoice.paid_at is not None:
        dates.append(("Date paid", _date(invoice.paid_at)))
    if invoice.voided_at is not None:
        dates.append(("Date voided", _date(invoice.voided_at)))
    headline = {
        Invoice.PAID: f"{money(invoice.amount_paid)} paid",
        Invoice.VOID: f"{money(invoice.total)} (void)",
        Invoice.UNCOLLECTIBLE: f"{money(invoice.amount_due)} (uncollectible)",
    }.get(invoice.status, f"{money(invoice.amount_due)} due")
    return InvoiceDocument(
        title="Invoice",
        id=invoice.id,
        number=invoice.number or "",
        currency=invoice.currency.upper(),
        status=invoice.status,
        payment_status=status,
        requires_action=requires_action and invoice.status == Invoice.OPEN,
        seller=_seller(invoice.tenant),
        bill_to=_bill_to(invoice.customer),
        dates=tuple(dates),
        lines=tuple(_line(line, money) for line in invoice.lines.select_related("price")),
        totals=_totals(invoice, money),
        amount_headline=headline,
        issued_at=invoice.finalized_at,
        livemode=invoice.livemode,
        adjustments=_adjustments(invoice, money),
    )


def _credit_note_lines(note: CreditNote, invoice: Invoice, money) -> tuple[DocumentLine, ...]:
    """The credited lines, each with the period of the invoice line it credits; a credit note by amount has
    none, and prints one line of its subtotal against the invoice."""
    lines = []
    for line in note.lines.select_related("invoice_line_item"):
        credited = line.invoice_line_item
        lines.append(
            DocumentLine(
                description=line.description or credited.description,
                period=_period(credited.period_start, credited.period_end),
                quantity=line.quantity if line.quantity else "",
                unit_amount="",
                amount=money(line.amount),
                proration=credited.proration,
            )
        )
    if not lines:
        lines.append(
            DocumentLine(
                description=f"Credit on invoice {invoice.number}",
                period=_period(invoice.period_start, invoice.period_end),
                quantity="",
                unit_amount="",
                amount=money(note.subtotal),
                proration=False,
            )
        )
    return tuple(lines)


def _credit_note_totals(note: CreditNote, money) -> tuple[TotalRow, ...]:
    """Subtotal, tax, total, then where the total went: ``total = pre_payment + refund + credit + out_of_band``."""
    rows = [
        TotalRow("subtotal", "Subtotal", money(note.subtotal)),
        TotalRow("tax", "Tax", money(note.tax)),
        TotalRow("total", "Total credited", money(note.total), emphasis=True),
    ]
    for kind, label, amount in (
        ("pre_payment", "Taken off the amount due", note.pre_payment_amount),
        ("refund", "Refunded to the card", note.refund_amount),
        ("credit_balance", "Added to the customer's credit balance", note.credit_amount),
        ("out_of_band", "Returned outside this account", note.out_of_band_amount),
    ):
        if amount:
            rows.append(TotalRow(kind, label, money(amount)))
    return tuple(rows)


def credit_note_document(note: CreditNote) -> InvoiceDocument:
    """The document of ``note`` (issued or void): the seller, the customer, its number, the invoice it credits
    (number and date), date, reason, memo, lines, subtotal, tax, total and where the total went, in the
    invoice's currency. Reads the tenant, customer, invoice and lines (a few queries).
    """
    invoice = note.invoice

    def money(amount: int) -> str:
        return display(amount, note.currency, locale=locale())

    dates = [
        ("Credit note number", note.number),
        ("Date of issue", _date(note.created_at)),
        ("Invoice", invoice.number or invoice.id),
        ("Invoice date", _date(invoice.finalized_at)),
    ]
    if note.reason:
        dates.append(("Reason", reason_text(note.reason)))
    if note.voided_at is not None:
        dates.append(("Date voided", _date(note.voided_at)))
    void = note.status == CreditNote.VOID
    return InvoiceDocument(
        title="Credit note",
        id=note.id,
        number=note.number,
        currency=note.currency.upper(),
        status=note.status,
        payment_status=f"Void since {_date(note.voided_at)}: nothing was credited"
        if void
        else f"Credits invoice {invoice.number}",
        requires_action=False,
        seller=_seller(note.tenant),
        bill_to=_bill_to(note.customer),
        dates=tuple(dates),
        lines=_credit_note_lines(note, invoice, money),
        totals=_credit_note_totals(note, money),
        amount_headline=f"{money(note.total)} (void)" if void else f"{money(note.total)} credited",
        issued_at=note.created_at,
        livemode=note.livemode,
        memo=note.memo,
    )


def pdf_identifier(document: InvoiceDocument) -> bytes:
    """The PDF's file identifier: 32 hex digits derived from the document's id (stable across renders)."""
    return hashlib.sha256(f"hardcount:{document.title}:{document.id}".encode()).hexdigest()[:32].encode()


def render_html(document: InvoiceDocument) -> str:
    """The print HTML of ``document`` (the PDF's source)."""
    return render_to_string(TEMPLATE, {"doc": document, "created": document.issued_at.astimezone(UTC).isoformat()})


def render_pdf(document: InvoiceDocument) -> bytes:
    """PDF bytes of ``document``: the same bytes for the same document (dates and identifier fixed). Fetches
    nothing: no file, no URL."""
    # Imported here: WeasyPrint loads Pango through cffi, which only the document paths need.
    import weasyprint
    from weasyprint.urls import URLFetcher

    # The template needs no resource; a fetcher that allows no scheme keeps any URL that reached the HTML
    # (a tenant's text is escaped, this is the second wall) from reading a file or calling out.
    fetch_nothing = URLFetcher(allowed_protocols=())
    os.environ.setdefault("SOURCE_DATE_EPOCH", FONT_TIMESTAMP_EPOCH)
    return weasyprint.HTML(string=render_html(document), url_fetcher=fetch_nothing).write_pdf(
        pdf_identifier=pdf_identifier(document)
    )


def render_invoice_pdf(invoice: Invoice) -> bytes:
    """PDF bytes of a finalized ``invoice``; raises :class:`NotFinalized` for a draft."""
    return render_pdf(invoice_document(invoice))


def render_credit_note_pdf(note: CreditNote) -> bytes:
    """PDF bytes of ``note``: the same bytes for the same credit note in the same state."""
    return render_pdf(credit_note_document(note))
