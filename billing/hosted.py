"""The hosted invoice page's address: a signed token per finalized invoice, revoked by rotation.

A token is ``<invoice id>.v<version>.<signature>``: Django's :class:`~django.core.signing.Signer`
(HMAC-SHA256 under ``SECRET_KEY``, salted for this use) over the invoice's id and its
``hosted_url_version``. Nothing is stored per token, so every finalized invoice has its URL from the
moment it is finalized, in its representation and its events alike; one more ``hosted_url_version``
(:func:`rotate_hosted_url`) makes every earlier token answer 404. Only a finalized invoice has one
(Stripe's ``hosted_invoice_url`` is null on a draft). Rules: docs/decisions/0161, the reference:
docs/reference/invoice-documents.md.
"""

from __future__ import annotations

import re

from django.conf import settings
from django.core import signing
from django.db import transaction

from billing.lock_objects import invoice_qs_select_for_update
from billing.models import Invoice
from hardcount import audit
from hardcount.errors import NotFoundError, StateConflictError

SALT = "hardcount.hosted_invoice"
# Register the audit action: a rotation revokes a credential the customer holds.
AUDIT_ROTATED = "invoice.hosted_url_rotated"
AUDIT_ACTIONS = audit.actions(AUDIT_ROTATED)
# What the signature covers: the invoice's id and version.
_VALUE = re.compile(r"^(in_[0-9a-z]{26})\.v([0-9]{1,9})$")


class HostedUrlUnavailable(StateConflictError):
    """409: a draft invoice has no hosted page (nor a document) until it is finalized."""

    default_code = "invoice_not_finalized"


def _signer() -> signing.Signer:
    return signing.Signer(salt=SALT, sep=".", algorithm="sha256")


def has_document(invoice: Invoice) -> bool:
    """True once ``invoice`` was finalized (``open``, ``paid``, ``void``, ``uncollectible``): only then it has a
    number, a PDF and a hosted page. Stripe's drafts have neither ``invoice_pdf`` nor ``hosted_invoice_url``."""
    return invoice.status != Invoice.DRAFT and invoice.finalized_at is not None


def hosted_token(invoice: Invoice) -> str | None:
    """The current token of ``invoice``'s hosted page, or None for a draft."""
    if not has_document(invoice):
        return None
    return _signer().sign(f"{invoice.id}.v{invoice.hosted_url_version}")


def hosted_invoice_url(invoice: Invoice) -> str | None:
    """``<HARDCOUNT_PUBLIC_URL>/i/<token>``, or None for a draft."""
    token = hosted_token(invoice)
    return None if token is None else f"{settings.HARDCOUNT_PUBLIC_URL.rstrip('/')}/i/{token}"


def hosted_invoice_pdf_url(invoice: Invoice) -> str | None:
    """The hosted page's PDF (``…/i/<token>/pdf``, Stripe's ``invoice_pdf``), or None for a draft."""
    url = hosted_invoice_url(invoice)
    return None if url is None else f"{url}/pdf"


def resolve(token: str) -> Invoice | None:
    """The finalized invoice whose current token is ``token``; None for anything else.

    None for a malformed or forged token, one of an earlier version (rotated), and one of an invoice
    that is gone or back to draft: the page answers each with the same 404. Reads as the connecting
    role (the caller has no tenant yet; the invoice found decides it).
    """
    try:
        value = _signer().unsign(token)
    except signing.BadSignature:
        return None
    match = _VALUE.match(value)
    if match is None:
        return None
    invoice = Invoice.objects.filter(pk=match[1], hosted_url_version=int(match[2])).first()
    if invoice is None or not has_document(invoice):
        return None
    return invoice


def rotate_hosted_url(invoice_id: str, *, tenant_id: str, livemode: bool, request=None) -> Invoice:
    """Revoke ``invoice_id``'s hosted URL and issue the next one; returns the invoice with its new URL.

    Raises :class:`~hardcount.errors.NotFoundError` (not the caller's invoice) and
    :class:`HostedUrlUnavailable` (409: a draft has no URL to rotate). Recorded in the audit log.
    """
    with transaction.atomic():
        # The invoice row alone: two rotations at once give two versions, never the same one twice.
        invoice = invoice_qs_select_for_update().filter(tenant_id=tenant_id, livemode=livemode, pk=invoice_id).first()
        if invoice is None:
            raise NotFoundError(f"No such invoice: '{invoice_id}'.", param="id")
        if not has_document(invoice):
            raise HostedUrlUnavailable(f"Invoice {invoice.id} is a draft; only a finalized invoice has a hosted URL.")
        invoice.hosted_url_version += 1
        invoice.save(update_fields=["hosted_url_version"])
        audit.record(
            AUDIT_ROTATED,
            obj=invoice,
            request=request,
            message=f"Hosted invoice URL rotated to version {invoice.hosted_url_version}; earlier URLs revoked.",
        )
    return invoice
