"""Invoice PDFs: ``GET /v1/invoices/{id}/pdf`` and the tenant's business details on ``/v1/account``.

Each PDF is read back as text (pypdf) and its first page rendered to pixels (pypdfium2): the numbers a
customer reads are asserted as formatted by hand (symbol, exponent, grouping), not by the code under test.
"""

from __future__ import annotations

import io
import os
import types
from datetime import UTC, datetime
from pathlib import Path

import pytest
from PIL import Image

from billing.models import Customer, Invoice
from billing.services.drain import drain_due
from billing.services.ledger import grant_credit
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import DECLINING_CARD, VISA

pypdf = pytest.importorskip("pypdf", reason="pypdf (requirements-dev.txt) reads the PDFs back")
pdfium = pytest.importorskip("pypdfium2", reason="pypdfium2 (requirements-dev.txt) renders the PDFs")

ANCHOR = datetime(2026, 11, 15, 9, 0, tzinfo=UTC)
PERIOD = "November 15, 2026 – December 15, 2026"


@pytest.fixture
def acme(book):
    keys = make_keys("acme-internal")
    status, _ = Api(keys.test).post(
        "/v1/account",
        {
            "business_name": "Acme Analytics GmbH",
            "address": {"line1": "Torstraße 12", "city": "Berlin", "postal_code": "10119", "country": "DE"},
        },
    )
    assert status == 200
    return keys


@pytest.fixture
def globex(book):
    return make_keys("Globex")


def _billed(
    book, tenant, *, amount: int, currency: str, quantity: int = 1, credit: int = 0, name: str = "", card=VISA
) -> Invoice:
    customer = book.customer(tenant, currency=currency, card=card)
    Customer.objects.filter(pk=customer.pk).update(name=name)
    if credit:
        grant_credit(customer.id, tenant_id=tenant.id, livemode=False, amount=credit)
    sub = book.subscription(
        customer, book.price(tenant, amount=amount, currency=currency), anchor=ANCHOR, quantity=quantity
    )
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    return Invoice.objects.get(subscription=sub)


def _pdf(keys, invoice_id: str):
    response = Api(keys.test).response("get", f"/v1/invoices/{invoice_id}/pdf")
    return response


def _text(pdf_bytes: bytes) -> str:
    reader = pypdf.PdfReader(io.BytesIO(pdf_bytes))
    return "\n".join(page.extract_text() for page in reader.pages)


def _ink_ratio(pdf_bytes: bytes) -> float:
    """The share of page 1's pixels that are not white, at 72 dpi."""
    document = pdfium.PdfDocument(pdf_bytes)
    image = document[0].render(scale=1).to_pil().convert("L")
    histogram = image.histogram()
    return 1 - sum(histogram[245:]) / (image.width * image.height)


def _png_pages(pdf_bytes: bytes) -> list[bytes]:
    """Each page rendered at 72 dpi, as PNG bytes."""
    pages = []
    for page in pdfium.PdfDocument(pdf_bytes):
        out = io.BytesIO()
        page.render(scale=1).to_pil().save(out, format="PNG")
        pages.append(out.getvalue())
    return pages


def save_docs_image(name: str, write) -> None:
    """With ``HARDCOUNT_DOCS_IMAGES`` set to a directory (``docs``), ``write(path)`` saves the image the docs show."""
    directory = os.environ.get("HARDCOUNT_DOCS_IMAGES")
    if directory:
        write(Path(directory) / name)


def _save_page_png(pdf_bytes: bytes, path: Path) -> None:
    pdfium.PdfDocument(pdf_bytes)[0].render(scale=1.5).to_pil().save(path, optimize=True)


def test_a_usd_invoice_pdf_prints_the_seller_customer_lines_and_totals(book, acme):
    invoice = _billed(book, acme.tenant, amount=1999, currency="usd", quantity=3, name="Dana Scully")
    assert (invoice.status, invoice.subtotal, invoice.tax, invoice.total) == ("paid", 5997, 0, 5997)

    response = _pdf(acme, invoice.id)

    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert response["Content-Disposition"] == f'inline; filename="Invoice-{invoice.number}.pdf"'
    text = _text(response.content)
    for expected in (
        "Acme Analytics GmbH",
        "Torstraße 12",
        "10119 Berlin",
        "Germany",
        "Dana Scully",
        invoice.customer.email,
        invoice.number,
        invoice.lines.get().description,
        PERIOD,
        "$19.99",  # the unit price: 1999 cents
        "$59.97",  # 3 × $19.99: the line, the subtotal, the total, the amount paid
        "Paid on",
        "Amounts in USD. Dates are UTC.",
    ):
        assert expected in text, (expected, text)
    assert text.count("$59.97") == 6  # headline, line, subtotal, total, amount due, amount paid
    assert "$0.00" in text  # the tax row of an untaxed invoice
    assert 0.005 < _ink_ratio(response.content) < 0.3
    save_docs_image("invoice-example.png", lambda path: _save_page_png(response.content, path))


def test_a_eur_invoice_pdf_has_its_tax_rate_and_euro_amounts(book, acme, settings):
    settings.HARDCOUNT_TAX_RATES_BPS = {"eur": 2000}
    invoice = _billed(book, acme.tenant, amount=1299, currency="eur")
    # 20 % of 12.99 is 2.598, rounded half up to 2.60.
    assert (invoice.subtotal, invoice.tax, invoice.total) == (1299, 260, 1559)

    content = _pdf(acme, invoice.id).content
    text = _text(content)

    assert "€12.99" in text and "Tax (20%)" in text and "€2.60" in text and "€15.59" in text
    assert "Amounts in EUR" in text
    # Every page renders to a PNG with ink on it (A4, 595.28 × 841.89 points, at 72 dpi: 596 × 842 pixels).
    pages = _png_pages(content)
    assert len(pages) == len(pypdf.PdfReader(io.BytesIO(content)).pages) >= 1
    for png in pages:
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        image = Image.open(io.BytesIO(png)).convert("L")
        assert image.size == (596, 842)
        assert 0.005 < 1 - sum(image.histogram()[245:]) / (596 * 842) < 0.3


def test_a_jpy_invoice_pdf_has_no_minor_digits_and_shows_the_credit_applied(book, acme):
    invoice = _billed(book, acme.tenant, amount=1000, currency="jpy", credit=300)
    assert (invoice.total, invoice.credit_applied, invoice.amount_due) == (1000, 300, 700)

    response = _pdf(acme, invoice.id)
    text = _text(response.content)

    assert "¥1,000" in text and "-¥300" in text and "¥700" in text
    assert "¥1,000.00" not in text and "¥10.00" not in text
    assert "Credit applied" in text
    assert 0.005 < _ink_ratio(response.content) < 0.3


def test_two_renders_of_one_invoice_are_the_same_bytes_dated_by_the_invoice(book, acme):
    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")

    first = _pdf(acme, invoice.id).content
    second = _pdf(acme, invoice.id).content

    assert first == second
    reader = pypdf.PdfReader(io.BytesIO(first))
    # The PDF's dates are the invoice's finalization, not the time of the render.
    assert reader.metadata.creation_date == invoice.finalized_at.replace(microsecond=0)
    assert reader.metadata.modification_date == invoice.finalized_at.replace(microsecond=0)
    # The file identifier is derived from the invoice, so another invoice's differs.
    identifier = reader.trailer["/ID"][0]
    other = _billed(book, acme.tenant, amount=1999, currency="usd")
    assert pypdf.PdfReader(io.BytesIO(_pdf(acme, other.id).content)).trailer["/ID"][0] != identifier


def test_renders_an_hour_apart_are_the_same_bytes_when_fonts_are_subset_by_fonttools(book, acme, monkeypatch):
    """Without HarfBuzz-Subset WeasyPrint subsets fonts with fontTools, which stamps each font with the time of the
    render; the renderer pins that stamp. The clock fontTools reads is moved an hour between two renders."""
    import weasyprint.pdf.fonts
    from fontTools.misc import timeTools

    from billing import documents

    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")
    monkeypatch.setattr(weasyprint.pdf.fonts, "harfbuzz_subset", None)  # the fontTools path, on any system
    ticks = iter(range(1_800_000_000, 1_900_000_000, 3600))
    monkeypatch.setattr(timeTools, "time", types.SimpleNamespace(time=lambda: next(ticks)))
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)

    first = documents.render_invoice_pdf(invoice)
    second = documents.render_invoice_pdf(invoice)

    assert first == second
    # Negative control: the same HTML through WeasyPrint without the pin differs an hour later.
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    html = documents.render_html(documents.invoice_document(invoice))
    unpinned = [weasyprint.HTML(string=html).write_pdf(pdf_identifier=b"0" * 32) for _ in range(2)]
    assert unpinned[0] != unpinned[1]


def test_a_draft_has_no_document_and_another_tenants_invoice_is_404(book, acme, globex, settings):
    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")
    # A tax provider that does not answer keeps the next invoice a draft (waiting for tax).
    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.DownTaxProvider"
    draft = _billed(book, acme.tenant, amount=500, currency="usd")
    assert (draft.status, draft.number) == (Invoice.DRAFT, None)

    status, body = Api(acme.test).get(f"/v1/invoices/{draft.id}/pdf")
    assert (status, body["error"]["code"]) == (409, "invoice_not_finalized")
    status, body = Api(globex.test).get(f"/v1/invoices/{invoice.id}/pdf")
    assert (status, body["error"]["code"]) == (404, "resource_missing")
    status, body = Api(acme.live).get(f"/v1/invoices/{invoice.id}/pdf")
    assert (status, body["error"]["code"]) == (404, "resource_missing")
    # The draft's representation has no document links; the finalized one's has both.
    assert Api(acme.test).get(f"/v1/invoices/{draft.id}")[1]["hosted_invoice_url"] is None
    shown = Api(acme.test).get(f"/v1/invoices/{invoice.id}")[1]
    assert (
        shown["hosted_invoice_url"].startswith("http://")
        and shown["invoice_pdf"] == shown["hosted_invoice_url"] + "/pdf"
    )


def test_account_business_details_are_validated_and_kept(book, acme):
    api = Api(acme.test)

    status, body = api.post("/v1/account", {"address": {"country": "XX"}})
    assert (status, body["error"]["param"]) == (422, "address.country")
    status, body = api.post("/v1/account", {"address": {"planet": "Mars"}})
    assert status == 422
    status, account = api.post("/v1/account", {"address": {"line2": "Hinterhaus"}})

    assert status == 200
    assert account == {
        "id": acme.tenant.id,
        "object": "account",
        "name": "acme-internal",
        "business_name": "Acme Analytics GmbH",
        "address": {
            "line1": "Torstraße 12",
            "line2": "Hinterhaus",
            "city": "Berlin",
            "postal_code": "10119",
            "state": None,
            "country": "DE",
        },
    }
    assert api.get("/v1/account") == (200, account)


def test_a_void_invoice_keeps_its_document_marked_void(book, acme):
    invoice = _billed(book, acme.tenant, amount=2500, currency="usd", card=DECLINING_CARD)
    assert invoice.status == Invoice.OPEN
    assert Api(acme.test).post(f"/v1/invoices/{invoice.id}/void")[0] == 200

    text = _text(_pdf(acme, invoice.id).content)

    assert "$25.00 (void)" in text and "Void since" in text and "Date voided" in text
    assert "$25.00 due" not in text


def test_the_tenants_text_is_printed_as_text(book, acme):
    Api(acme.test).post("/v1/account", {"business_name": '<b>Evil</b> & <img src="file:///etc/hostname">'})
    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")

    text = _text(_pdf(acme, invoice.id).content)

    assert '<b>Evil</b> & <img src="file:///etc/hostname">' in text


def test_the_renderer_fetches_no_file_even_from_html_that_names_one(book, acme, monkeypatch):
    from billing import documents

    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")
    image = Path(__file__).resolve().parents[2] / "docs" / "invoice-example.png"
    html = f'<html><body><p>x</p><img src="{image.as_uri()}"></body></html>'
    monkeypatch.setattr(documents, "render_html", lambda document: html)

    rendered = documents.render_pdf(documents.invoice_document(invoice))

    assert len(pypdf.PdfReader(io.BytesIO(rendered)).pages[0].images) == 0
    # Negative control: WeasyPrint's own fetcher reads the file into the PDF.
    import weasyprint

    fetched = weasyprint.HTML(string=html).write_pdf()
    assert len(pypdf.PdfReader(io.BytesIO(fetched)).pages[0].images) == 1
