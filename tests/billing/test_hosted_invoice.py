"""The hosted invoice page ``/i/<token>``: no login, a signed token that rotation revokes, the security headers, and
(in Debian's Chromium through Playwright) the Stripe.js step that completes a payment requiring action.

The browser loads a stub Stripe.js from a server of its own on another port (``HARDCOUNT_STRIPE_JS_URL``): the
page's Content-Security-Policy must allow that origin and its own nonce, nothing else, for the step to run.
"""

from __future__ import annotations

import http.server
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from billing.hosted import hosted_invoice_url, hosted_token
from billing.models import Invoice
from billing.services.drain import drain_due
from hardcount.models import AuditLogEntry
from tests.api.conftest import Api, make_keys
from tests.billing.test_invoice_documents import ANCHOR, save_docs_image

AUTHENTICATION_CARD = "4000002760003184"  # Stripe's "authentication required on all transactions" card

STUB_STRIPE_JS = b"""
window.__stripeCalls = [];
window.Stripe = function (key, options) {
  window.__stripeCalls.push({ fn: "Stripe", key: key, options: options || {} });
  return {
    confirmCardPayment: function (clientSecret) {
      window.__stripeCalls.push({ fn: "confirmCardPayment", clientSecret: clientSecret });
      return Promise.resolve({ paymentIntent: { id: clientSecret.split("_secret_")[0], status: "succeeded" } });
    }
  };
};
"""


@pytest.fixture
def acme(book):
    keys = make_keys("Acme")
    status, _ = Api(keys.test).post("/v1/account", {"business_name": "Acme Analytics", "address": {"country": "US"}})
    assert status == 200
    return keys


@pytest.fixture
def globex(book):
    return make_keys("Globex")


def _billed(book, tenant, *, card=None, amount=4200, currency="usd") -> Invoice:
    customer = book.customer(tenant, currency=currency, **({"card": card} if card else {}))
    sub = book.subscription(customer, book.price(tenant, amount=amount, currency=currency), anchor=ANCHOR)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    return Invoice.objects.get(subscription=sub)


def _path(invoice: Invoice) -> str:
    return f"/i/{hosted_token(invoice)}"


# ------------------------------------------------------------------ the page over plain HTTP


def test_the_page_shows_the_invoice_with_its_pdf_link_and_strict_headers(book, acme, settings):
    settings.HARDCOUNT_STRIPE_JS_URL = "https://js.example.test/v3/"
    invoice = _billed(book, acme.tenant, amount=123456, currency="jpy")

    response = Client().get(_path(invoice))

    assert response.status_code == 200
    html = response.content.decode()
    assert invoice.number in html and "¥123,456" in html and "Acme Analytics" in html and "United States" in html
    assert f'href="{hosted_invoice_url(invoice)}/pdf"' in html
    csp = response["Content-Security-Policy"]
    script_src = next(d for d in csp.split("; ") if d.startswith("script-src"))
    assert script_src.split()[1].startswith("'nonce-") and script_src.split()[2:] == ["https://js.example.test"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert (response["Referrer-Policy"], response["X-Frame-Options"]) == ("no-referrer", "DENY")
    # Nothing to confirm on a paid invoice: Stripe.js is not even loaded.
    assert "js.example.test" not in html and "confirm-payment" not in html


def test_the_pages_pdf_is_the_apis_pdf(book, acme):
    invoice = _billed(book, acme.tenant)

    hosted = Client().get(_path(invoice) + "/pdf")
    api = Api(acme.test).response("get", f"/v1/invoices/{invoice.id}/pdf")

    assert hosted.status_code == 200 and hosted["Content-Type"] == "application/pdf"
    assert hosted.content == api.content and hosted.content.startswith(b"%PDF-")


def test_unknown_forged_and_other_invoices_tokens_are_one_plain_404(book, acme, globex):
    invoice = _billed(book, acme.tenant)
    theirs = _billed(book, globex.tenant)
    token = hosted_token(invoice)
    # The signature of one invoice's token on another invoice's id.
    forged = theirs.id + token[len(invoice.id) :]

    for path in (f"/i/{forged}", f"/i/{token[:-1]}x", "/i/nothing", f"/i/{forged}/pdf", f"/i/{invoice.id}.v0"):
        response = Client().get(path)
        assert response.status_code == 404, path
        assert response["Content-Type"].startswith("text/html")
        body = response.content.decode()
        assert "not valid" in body and theirs.number not in body and "Traceback" not in body
        assert response["Referrer-Policy"] == "no-referrer"
    # As a browser would send them: with CSRF checks on, which the test client leaves off by default.
    browser = Client(enforce_csrf_checks=True)
    for method in (browser.post, browser.put, browser.delete):
        for path in (_path(invoice), _path(invoice) + "/pdf"):
            response = method(path)
            assert response.status_code == 405, (method, path)
            assert (response["Allow"], response["Referrer-Policy"]) == ("GET, HEAD", "no-referrer"), path
            assert "frame-ancestors 'none'" in response["Content-Security-Policy"]


def test_the_page_reads_as_the_invoices_tenant_and_gives_the_connection_back(book, acme, monkeypatch):
    from billing import hosted_views
    from hardcount import tenancy

    invoice = _billed(book, acme.tenant)
    seen = []
    render = hosted_views.invoice_document

    def spy(found):
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_user, current_setting('hardcount.tenant_id', true)")
            seen.append(cursor.fetchone())
        return render(found)

    monkeypatch.setattr(hosted_views, "invoice_document", spy)

    assert Client().get(_path(invoice)).status_code == 200
    assert seen == [(tenancy.TENANT_ROLE, acme.tenant.id)]
    assert tenancy.current_role() != tenancy.TENANT_ROLE


def test_rotation_revokes_the_old_url_and_only_the_owner_may_rotate(book, acme, globex, settings):
    invoice = _billed(book, acme.tenant)
    old_url = hosted_invoice_url(invoice)
    assert Api(acme.test).get(f"/v1/invoices/{invoice.id}")[1]["hosted_invoice_url"] == old_url

    assert Api(globex.test).post(f"/v1/invoices/{invoice.id}/rotate_hosted_url")[0] == 404
    assert Api(acme.live).post(f"/v1/invoices/{invoice.id}/rotate_hosted_url")[0] == 404
    status, rotated = Api(acme.test).post(f"/v1/invoices/{invoice.id}/rotate_hosted_url")

    assert status == 200
    new_url = rotated["hosted_invoice_url"]
    assert new_url != old_url and rotated["invoice_pdf"] == new_url + "/pdf"
    old_path = old_url.removeprefix(settings.HARDCOUNT_PUBLIC_URL)
    new_path = new_url.removeprefix(settings.HARDCOUNT_PUBLIC_URL)
    assert Client().get(old_path).status_code == 404 and Client().get(old_path + "/pdf").status_code == 404
    assert Client().get(new_path).status_code == 200
    assert Api(acme.test).get(f"/v1/invoices/{invoice.id}")[1]["hosted_invoice_url"] == new_url
    entry = AuditLogEntry.objects.get(action="invoice.hosted_url_rotated")
    assert (entry.object_id, entry.tenant_id) == (invoice.id, acme.tenant.id)


def test_a_draft_has_no_hosted_url_to_rotate(book, acme, settings):
    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.DownTaxProvider"
    draft = _billed(book, acme.tenant)
    assert draft.status == Invoice.DRAFT and hosted_token(draft) is None

    status, body = Api(acme.test).post(f"/v1/invoices/{draft.id}/rotate_hosted_url")

    assert (status, body["error"]["code"]) == (409, "invoice_not_finalized")
    # Even a correctly signed token of it (as one finalized would have) opens nothing while it is a draft.
    as_if_finalized = Invoice(id=draft.id, status=Invoice.OPEN, finalized_at=draft.created_at)
    assert Client().get(f"/i/{hosted_token(as_if_finalized)}").status_code == 404


def test_a_payment_requiring_action_offers_the_step_with_its_client_secret(book, acme, settings, stripe_client):
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_hardcount"
    invoice = _billed(book, acme.tenant, card=AUTHENTICATION_CARD)
    assert invoice.status == Invoice.OPEN
    secret = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).client_secret

    html = Client().get(_path(invoice)).content.decode()

    assert f'data-client-secret="{secret}"' in html and 'data-publishable-key="pk_test_hardcount"' in html
    assert "Payment needs your confirmation" in html
    # Without a publishable key the page cannot offer the step, and says so instead.
    settings.STRIPE_PUBLISHABLE_KEY = ""
    html = Client().get(_path(invoice)).content.decode()
    assert secret not in html and "Please contact us" in html


# ------------------------------------------------------------------ in a real browser


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None or not Path(found).exists():
        pytest.skip("Debian's Chromium is not installed (make test installs it: apt-get install -y chromium)")
    return found


@pytest.fixture
def stub_stripe_js():
    """``http://127.0.0.1:<port>/v3/``: a stub Stripe.js served from an origin of its own."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/javascript")
            self.send_header("Content-Length", str(len(STUB_STRIPE_JS)))
            self.end_headers()
            self.wfile.write(STUB_STRIPE_JS)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v3/"
    server.shutdown()
    server.server_close()


@pytest.fixture
def browser(monkeypatch):
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, which makes Django refuse the test's own
    # queries; they are plain synchronous calls between the browser's steps.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
            viewport={"width": 1000, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def _serve_pages(settings, live_server, stub_stripe_js) -> None:
    """Hosted URLs point at the test's live server, and the page loads the offline Stripe.js stub."""
    settings.HARDCOUNT_PUBLIC_URL = live_server.url
    settings.HARDCOUNT_STRIPE_JS_URL = stub_stripe_js
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_hardcount"


def _page_watching_csp(browser):
    """A new browser page and the list its Content-Security-Policy violations are collected in."""
    page = browser.new_page()
    violations: list[str] = []
    page.on("console", lambda message: violations.append(message.text) if "Content Security" in message.text else None)
    return page, violations


def test_in_a_browser_the_page_confirms_the_payment_with_stripe_js_and_a_revoked_url_is_404(
    book, acme, settings, live_server, stub_stripe_js, browser, stripe_client
):
    _serve_pages(settings, live_server, stub_stripe_js)
    invoice = _billed(book, acme.tenant, card=AUTHENTICATION_CARD, amount=1999, currency="eur")
    secret = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).client_secret
    url = Api(acme.test).get(f"/v1/invoices/{invoice.id}")[1]["hosted_invoice_url"]
    page, violations = _page_watching_csp(browser)

    response = page.goto(url)

    assert response.status == 200
    assert page.locator(".headline .amount").inner_text() == "€19.99 due"
    assert invoice.number in page.locator("table.dates").inner_text()
    page.wait_for_function("() => typeof window.Stripe === 'function'")
    save_docs_image("hosted-invoice.png", lambda path: page.screenshot(path=str(path), full_page=True))
    page.click("#confirm-payment")
    page.wait_for_function("() => window.__stripeCalls.length === 2")
    calls = page.evaluate("() => window.__stripeCalls")
    assert calls == [
        {"fn": "Stripe", "key": "pk_test_hardcount", "options": {}},
        {"fn": "confirmCardPayment", "clientSecret": secret},
    ]
    assert "payment is confirmed" in page.locator("#payment-message").inner_text()
    assert violations == []

    status, _ = Api(acme.test).post(f"/v1/invoices/{invoice.id}/rotate_hosted_url")
    assert status == 200
    revoked = page.goto(url)
    assert revoked.status == 404
    assert "not valid" in page.content() and invoice.number not in page.content()


def test_in_a_browser_a_paid_invoice_shows_paid_offers_no_payment_step_and_its_pdf_link_works(
    book, acme, settings, live_server, stub_stripe_js, browser
):
    _serve_pages(settings, live_server, stub_stripe_js)
    invoice = _billed(book, acme.tenant, amount=1999, currency="usd")
    assert invoice.status == Invoice.PAID
    url = Api(acme.test).get(f"/v1/invoices/{invoice.id}")[1]["hosted_invoice_url"]
    page, violations = _page_watching_csp(browser)

    response = page.goto(url)

    assert response.status == 200
    assert page.locator(".headline .amount").inner_text() == "$19.99 paid"
    assert invoice.number in page.locator("table.dates").inner_text()
    # No pending action: no button, and Stripe.js is never loaded (the stub would define window.Stripe).
    assert page.locator("#confirm-payment").count() == 0
    assert page.evaluate("() => typeof window.Stripe") == "undefined"
    pdf = page.request.get(url + "/pdf")
    assert (pdf.status, pdf.headers["content-type"]) == (200, "application/pdf")
    assert pdf.body() == Api(acme.test).response("get", f"/v1/invoices/{invoice.id}/pdf").content
    assert violations == []
