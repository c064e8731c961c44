"""The hosted invoice page: ``/i/<token>`` (HTML) and ``/i/<token>/pdf``, for customers, with no login.

The token is the credential (:mod:`billing.hosted`). It is resolved as the connecting role; from then
on the request reads as the invoice's tenant and mode under row-level security, like an API request
(docs/decisions/0130). An unknown, forged or revoked token, and a draft's, answer the same small
HTML 404 page. An open invoice whose payment requires the customer's action (3-D Secure) offers the
step that completes it: Stripe.js, loaded from ``HARDCOUNT_STRIPE_JS_URL``, confirms the
PaymentIntent with its ``client_secret``, retrieved from the gateway when the page is shown (the
secret is never stored). Every answer carries a Content-Security-Policy that allows scripts from
Stripe.js's origin and this response's nonce only, ``Referrer-Policy: no-referrer`` (the URL is a
credential) and ``X-Frame-Options: DENY``. Reference: docs/reference/invoice-documents.md.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from functools import wraps
from urllib.parse import urlsplit

import stripe
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.template.loader import render_to_string
from django.views.decorators.csrf import csrf_exempt

from billing import gateway as gw
from billing import gateway_accounts
from billing.api.documents import pdf_response
from billing.documents import invoice_document
from billing.hosted import hosted_invoice_pdf_url, resolve
from billing.models import Invoice
from billing.vault import SecretUnreadable
from hardcount import tenancy

logger = logging.getLogger(__name__)

# Stripe.js's own needs besides its script (https://docs.stripe.com/security/guide#content-security-policy):
# its API, and the frames of 3-D Secure challenges.
STRIPE_CONNECT_SRC = "https://api.stripe.com"
STRIPE_FRAME_SRC = "https://js.stripe.com https://hooks.stripe.com"


@dataclass(frozen=True)
class PaymentAction:
    """What the page's script needs to let the customer complete the payment, or why it cannot."""

    client_secret: str = ""
    publishable_key: str = ""
    stripe_account: str = ""
    unavailable: str = ""


def stripe_js_origin() -> str:
    """``scheme://host[:port]`` of ``HARDCOUNT_STRIPE_JS_URL``: the one script origin the page allows."""
    parts = urlsplit(settings.HARDCOUNT_STRIPE_JS_URL)
    return f"{parts.scheme}://{parts.netloc}"


def _secure(response: HttpResponse, nonce: str) -> HttpResponse:
    origin = stripe_js_origin()
    response["Content-Security-Policy"] = "; ".join(
        (
            "default-src 'none'",
            f"script-src 'nonce-{nonce}' {origin}",
            f"style-src 'nonce-{nonce}'",
            "img-src 'self' data:",
            f"connect-src {STRIPE_CONNECT_SRC} {origin}",
            f"frame-src {STRIPE_FRAME_SRC} {origin}",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    response["Referrer-Policy"] = "no-referrer"
    response["X-Frame-Options"] = "DENY"
    response["X-Content-Type-Options"] = "nosniff"
    response["Cache-Control"] = "no-store"
    return response


def _reads_only(view):
    """GET and HEAD only: any other method is a 405 with the page's headers. Exempt from CSRF, which would
    answer a POST with Django's own 403 page first: the page takes no form, so there is nothing to forge."""

    @csrf_exempt
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            return _secure(HttpResponseNotAllowed(["GET", "HEAD"]), secrets.token_urlsafe(16))
        return view(request, *args, **kwargs)

    return wrapper


def not_found(request: HttpRequest) -> HttpResponse:
    """The one answer to a token that opens nothing: a plain HTML 404 that names nothing."""
    nonce = secrets.token_urlsafe(16)
    html = render_to_string("billing/hosted_not_found.html", {"nonce": nonce})
    return _secure(HttpResponse(html, status=404, content_type="text/html; charset=utf-8"), nonce)


def payment_action(invoice: Invoice) -> PaymentAction:
    """The PaymentIntent's ``client_secret`` and the Stripe.js key of the account that charges ``invoice``.

    The platform's account and a Connect account use ``STRIPE_PUBLISHABLE_KEY`` (with ``stripeAccount``
    for Connect); a tenant's own secret key has no publishable key stored here, so the step is not
    offered. A gateway that does not answer, or a PaymentIntent no longer waiting, offers nothing.
    """
    account = gateway_accounts.account_of(invoice.tenant_id, invoice.livemode)
    if account is not None and not account.connect_account:
        return PaymentAction(unavailable="Please contact us to complete this payment.")
    if not settings.STRIPE_PUBLISHABLE_KEY:
        return PaymentAction(unavailable="Please contact us to complete this payment.")
    try:
        intent = gateway_accounts.gateway_for(invoice.tenant_id, invoice.livemode).retrieve_payment_intent(
            invoice.payment_intent_id
        )
    except (stripe.StripeError, SecretUnreadable):
        logger.warning("hosted invoice %s: the PaymentIntent could not be retrieved", invoice.id, exc_info=True)
        return PaymentAction(unavailable="The payment step could not be loaded. Please try again in a moment.")
    if intent.status != gw.REQUIRES_ACTION or not getattr(intent, "client_secret", None):
        return PaymentAction(unavailable="This payment is being processed. Please check back shortly.")
    return PaymentAction(
        client_secret=intent.client_secret,
        publishable_key=settings.STRIPE_PUBLISHABLE_KEY,
        stripe_account=account.connect_account if account is not None else "",
    )


@_reads_only
def hosted_invoice(request: HttpRequest, token: str) -> HttpResponse:
    """The customer's page of the invoice: the document, its PDF link, and the payment step when one is due."""
    found = resolve(token)
    if found is None:
        return not_found(request)
    # From here on the request reads as the invoice's tenant and mode only (row-level security).
    tenancy.enter(found.tenant_id, found.livemode)
    try:
        invoice = Invoice.objects.select_related("tenant", "customer").prefetch_related("lines").get(pk=found.pk)
        document = invoice_document(invoice)
        action = payment_action(invoice) if document.requires_action else None
        nonce = secrets.token_urlsafe(16)
        html = render_to_string(
            "billing/hosted_invoice.html",
            {
                "doc": document,
                "hosted": True,
                "pdf_url": hosted_invoice_pdf_url(invoice),
                "action": action,
                "stripe_js_url": settings.HARDCOUNT_STRIPE_JS_URL,
                "nonce": nonce,
            },
        )
    finally:
        tenancy.leave()
    return _secure(HttpResponse(html, content_type="text/html; charset=utf-8"), nonce)


@_reads_only
def hosted_invoice_pdf(request: HttpRequest, token: str) -> HttpResponse:
    """The invoice's PDF (the bytes ``GET /v1/invoices/{id}/pdf`` answers), under the page's token."""
    found = resolve(token)
    if found is None:
        return not_found(request)
    # From here on the request reads as the invoice's tenant and mode only (row-level security).
    tenancy.enter(found.tenant_id, found.livemode)
    try:
        response = pdf_response(Invoice.objects.select_related("tenant", "customer").get(pk=found.pk))
    finally:
        tenancy.leave()
    return _secure(response, secrets.token_urlsafe(16))
