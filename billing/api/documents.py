"""Documents over HTTP: ``GET /v1/invoices/{id}/pdf``, ``POST /v1/invoices/{id}/rotate_hosted_url`` and
``GET /v1/credit_notes/{id}/pdf``.

The invoice PDF is the one the hosted page links to (:mod:`billing.documents`), here behind the API key; a
credit note's PDF is rendered by the same renderer, behind the API key only (docs/decisions/0169).
Both answer 409 ``invoice_not_finalized`` for a draft: it has no number and no document yet, as
Stripe's drafts have neither ``invoice_pdf`` nor ``hosted_invoice_url``.
"""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from billing.api import schemas as s
from billing.documents import credit_note_document, invoice_document, render_pdf
from billing.hosted import HostedUrlUnavailable, has_document, rotate_hosted_url
from billing.models import CreditNote, Invoice
from billing.representations import invoice_data
from billing.serializers import Invoice as InvoiceOut
from hardcount.api import ERROR, ApiView, id_path_parameter

_DRAFT = "Invoice {} is a draft; only a finalized invoice has a document."


def pdf_response(invoice: Invoice) -> HttpResponse:
    """The PDF of a finalized ``invoice`` as an ``application/pdf`` response, shown inline, named by its number."""
    response = HttpResponse(render_pdf(invoice_document(invoice)), content_type="application/pdf")
    response["Content-Disposition"] = f'inline; filename="Invoice-{invoice.number}.pdf"'
    # The document changes when the invoice does (paid, voided): never served from a cache.
    response["Cache-Control"] = "no-store"
    return response


class InvoicePdfView(ApiView):
    @extend_schema(
        operation_id="invoices_pdf",
        summary="Download an invoice's PDF",
        description="The invoice document: the tenant's business details, the customer, number, dates (UTC), "
        "lines with periods and quantities (a metered line: the units used over its period), subtotal, the "
        "discount (its coupon and the amount off), tax, credit applied, total, the credit notes issued on it, "
        "amount due and paid, and the payment's status, amounts in the invoice's currency. The same bytes for the "
        "same invoice in the same state. 409 `invoice_not_finalized` for a draft.",
        tags=["invoices"],
        parameters=[id_path_parameter("invoice")],
        responses={(200, "application/pdf"): OpenApiTypes.BINARY, 404: ERROR, 409: ERROR},
    )
    def get(self, request, id):
        invoice = self.get_scoped(Invoice, id, kind="invoice")
        if not has_document(invoice):
            raise HostedUrlUnavailable(_DRAFT.format(invoice.id))
        return pdf_response(invoice)


class CreditNotePdfView(ApiView):
    @extend_schema(
        operation_id="credit_notes_pdf",
        summary="Download a credit note's PDF",
        description="The credit note document: the tenant's business details, the customer, the credit note's "
        "number and date, the invoice it credits (number and date), reason, memo, lines, subtotal, tax, total, and "
        "where the total went (taken off the amount due, refunded to the card, added to the credit balance, "
        "returned outside), amounts in the invoice's currency. A void credit note's says so. The same bytes for "
        "the same credit note in the same state.",
        tags=["credit_notes"],
        parameters=[id_path_parameter("credit_note")],
        responses={(200, "application/pdf"): OpenApiTypes.BINARY, 404: ERROR},
    )
    def get(self, request, id):
        note = self.get_scoped(CreditNote, id, kind="credit_note")
        response = HttpResponse(render_pdf(credit_note_document(note)), content_type="application/pdf")
        response["Content-Disposition"] = f'inline; filename="CreditNote-{note.number}.pdf"'
        # A void changes the document: never served from a cache.
        response["Cache-Control"] = "no-store"
        return response


class InvoiceRotateHostedUrlView(ApiView):
    @extend_schema(
        operation_id="invoices_rotate_hosted_url",
        summary="Revoke an invoice's hosted URL and issue a new one",
        description="Every earlier `hosted_invoice_url` (and its `invoice_pdf`) of the invoice answers 404 from now "
        "on; the invoice comes back with the new ones. Recorded in the audit log. 409 `invoice_not_finalized` for a "
        "draft.",
        tags=["invoices"],
        request=s.Empty,
        parameters=[id_path_parameter("invoice")],
        responses={200: InvoiceOut, 404: ERROR, 409: ERROR},
    )
    def post(self, request, id):
        self.read_body(s.Empty)
        invoice = self.get_scoped(Invoice, id, kind="invoice")
        rotate_hosted_url(invoice.pk, tenant_id=self.tenant.pk, livemode=self.livemode, request=request)
        return Response(invoice_data(Invoice.objects.prefetch_related("lines").get(pk=invoice.pk)))
