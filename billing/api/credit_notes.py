"""Credit notes over HTTP: issue, preview, list, get and void (Stripe's ``/v1/credit_notes``).

Input serializers and output schemas live here too (the output ones document
:func:`billing.representations.credit_note_data`; they never render).
"""

from __future__ import annotations

import json

from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.response import Response

from billing.api.schemas import Empty
from billing.models import CreditNote
from billing.representations import credit_note_data
from billing.services import credit_notes as service
from hardcount.api import (
    ERROR,
    STARTING_AFTER_HELP,
    ApiView,
    IdField,
    ListQuery,
    QueryCharField,
    QueryIdField,
    QueryIntegerField,
    StrictCharField,
    StrictChoiceField,
    StrictIntegerField,
    StrictSerializer,
    id_path_parameter,
    list_of,
    object_field,
)
from hardcount.errors import InvalidRequestError
from hardcount.money import MAX_AMOUNT

# ---------------------------------------------------------------------------------------
# Input


class CreditNoteLineCreate(StrictSerializer):
    type = StrictChoiceField(choices=["invoice_line_item"], help_text="Only invoice lines are credited.")
    invoice_line_item = IdField("line_item", help_text="A line of the invoice.")
    amount = StrictIntegerField(
        required=False, min_value=1, max_value=MAX_AMOUNT, help_text="Minor units before tax; or give quantity."
    )
    quantity = StrictIntegerField(
        required=False, min_value=1, max_value=1_000_000, help_text="Units of the line to credit; or give amount."
    )
    description = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


AMOUNT_HELP = "Minor units of the invoice's currency."


class CreditNoteCreate(StrictSerializer):
    invoice = IdField("invoice", help_text="An open or paid invoice of the caller's; any other id is answered 404.")
    lines = CreditNoteLineCreate(
        many=True, required=False, help_text="What is credited, per invoice line (taxed at the invoice's rate)."
    )
    amount = StrictIntegerField(
        required=False, min_value=1, max_value=MAX_AMOUNT, help_text="The total credited, tax included; or lines."
    )
    reason = StrictChoiceField(choices=list(CreditNote.REASONS), required=False)
    memo = StrictCharField(max_length=500, required=False, allow_blank=True, default="")
    refund_amount = StrictIntegerField(
        required=False, min_value=0, max_value=MAX_AMOUNT, help_text="Paid invoices: refunded to the card."
    )
    credit_amount = StrictIntegerField(
        required=False, min_value=0, max_value=MAX_AMOUNT, help_text="Paid invoices: to the customer's balance."
    )
    out_of_band_amount = StrictIntegerField(
        required=False, min_value=0, max_value=MAX_AMOUNT, help_text="Paid invoices: returned outside Hardcount."
    )


class CreditNoteListQuery(ListQuery):
    starting_after = QueryIdField("credit_note", help_text=STARTING_AFTER_HELP)
    invoice = QueryIdField("invoice", help_text="Only this invoice's credit notes.")
    customer = QueryIdField("customer", help_text="Only this customer's credit notes.")


class CreditNotePreviewQuery(StrictSerializer):
    invoice = QueryIdField("invoice", required=True, help_text="An open or paid invoice of the caller's.")
    amount = QueryIntegerField(required=False, min_value=1, max_value=MAX_AMOUNT, help_text=AMOUNT_HELP)
    lines = QueryCharField(
        max_length=10_000,
        help_text='The lines as JSON: `[{"type": "invoice_line_item", "invoice_line_item": "il_…", "amount": 500}]`.',
    )
    refund_amount = QueryIntegerField(required=False, min_value=0, max_value=MAX_AMOUNT, help_text=AMOUNT_HELP)
    credit_amount = QueryIntegerField(required=False, min_value=0, max_value=MAX_AMOUNT, help_text=AMOUNT_HELP)
    out_of_band_amount = QueryIntegerField(required=False, min_value=0, max_value=MAX_AMOUNT, help_text=AMOUNT_HELP)


# ---------------------------------------------------------------------------------------
# Output


class CreditNoteLine(serializers.Serializer):
    id = serializers.CharField(allow_null=True, help_text="null in a preview.")
    object = object_field("credit_note_line_item")
    type = serializers.ChoiceField(choices=["invoice_line_item"])
    invoice_line_item = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    quantity = serializers.IntegerField(allow_null=True)
    amount = serializers.IntegerField(help_text="Minor units before tax.")


class RefundOut(serializers.Serializer):
    """The refund to the card of a credit note's `refund_amount`."""

    id = serializers.CharField()
    object = object_field("refund")
    livemode = serializers.BooleanField()
    credit_note = serializers.CharField()
    invoice = serializers.CharField()
    payment_intent = serializers.CharField()
    gateway_refund = serializers.CharField(allow_null=True, help_text="The gateway's refund id (`re_…`).")
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    status = serializers.CharField(allow_null=True, help_text="The gateway refund's status; null before an answer.")
    outcome = serializers.ChoiceField(choices=["unknown", "succeeded", "pending", "failed", "error"])
    idempotency_key = serializers.CharField()
    error_message = serializers.CharField(allow_null=True)
    created = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)


@extend_schema_field(RefundOut(allow_null=True))
class _RefundField(serializers.Field):
    pass


class CreditNoteOut(serializers.Serializer):
    """A credit note: `total = subtotal + tax = pre_payment_amount + refund_amount + credit_amount +
    out_of_band_amount` (minor units)."""

    id = serializers.CharField(allow_null=True, help_text="null in a preview.")
    object = object_field("credit_note")
    livemode = serializers.BooleanField()
    number = serializers.CharField(allow_null=True, help_text="Gapless per tenant and mode; null in a preview.")
    invoice = serializers.CharField()
    customer = serializers.CharField()
    status = serializers.ChoiceField(choices=["issued", "void"])
    type = serializers.ChoiceField(choices=["pre_payment", "post_payment"])
    reason = serializers.CharField(allow_null=True)
    memo = serializers.CharField(allow_null=True)
    currency = serializers.CharField()
    lines = CreditNoteLine(many=True)
    subtotal = serializers.IntegerField()
    tax = serializers.IntegerField()
    total = serializers.IntegerField()
    amount = serializers.IntegerField(help_text="The total (Stripe's name).")
    pre_payment_amount = serializers.IntegerField()
    post_payment_amount = serializers.IntegerField()
    refund_amount = serializers.IntegerField()
    credit_amount = serializers.IntegerField()
    out_of_band_amount = serializers.IntegerField()
    refund = _RefundField()
    customer_balance_transaction = serializers.CharField(allow_null=True)
    created = serializers.DateTimeField(allow_null=True)
    voided_at = serializers.DateTimeField(allow_null=True)
    pdf = serializers.CharField(
        allow_null=True,
        help_text="The credit note's PDF (`GET /v1/credit_notes/{id}/pdf`, with the API key); null in a preview.",
    )


# ---------------------------------------------------------------------------------------
# Views


def _line_inputs(raw) -> list[service.LineInput] | None:
    if not raw:  # no lines, or an empty list: the credit note is by amount
        return None
    return [
        service.LineInput(
            invoice_line_item=line["invoice_line_item"],
            amount=line.get("amount"),
            quantity=line.get("quantity"),
            description=line.get("description", ""),
        )
        for line in raw
    ]


def _request_of(data: dict, lines) -> dict:
    return {
        "lines": lines,
        "amount": data.get("amount"),
        "refund_amount": data.get("refund_amount"),
        "credit_amount": data.get("credit_amount"),
        "out_of_band_amount": data.get("out_of_band_amount"),
        "reason": data.get("reason") or "",
        "memo": data.get("memo") or "",
    }


def draft_data(draft: service.Draft, *, livemode: bool) -> dict:
    """A preview in the credit note's shape: no id or number, nothing written."""
    invoice = draft.invoice
    return {
        "id": None,
        "object": "credit_note",
        "livemode": livemode,
        "number": None,
        "invoice": invoice.id,
        "customer": invoice.customer_id,
        "status": CreditNote.ISSUED,
        "type": draft.type,
        "reason": draft.reason or None,
        "memo": draft.memo or None,
        "currency": invoice.currency,
        "lines": [
            {
                "id": None,
                "object": "credit_note_line_item",
                "type": "invoice_line_item",
                "invoice_line_item": line.id,
                "description": text,
                "quantity": quantity,
                "amount": amount,
            }
            for line, amount, quantity, text in draft.lines
        ],
        "subtotal": draft.subtotal,
        "tax": draft.tax,
        "total": draft.total,
        "amount": draft.total,
        "pre_payment_amount": draft.pre_payment_amount,
        "post_payment_amount": draft.total - draft.pre_payment_amount,
        "refund_amount": draft.refund_amount,
        "credit_amount": draft.credit_amount,
        "out_of_band_amount": draft.out_of_band_amount,
        "refund": None,
        "customer_balance_transaction": None,
        "created": None,
        "voided_at": None,
        "pdf": None,
    }


class CreditNoteListView(ApiView):
    get_query = CreditNoteListQuery

    @extend_schema(
        operation_id="credit_notes_create",
        summary="Issue a credit note against an open or paid invoice",
        description="Give `lines` or `amount`. On an open invoice it reduces `amount_due` (at zero the invoice is "
        "paid). On a paid invoice `refund_amount + credit_amount + out_of_band_amount` must equal the total "
        "(none given: all to the customer's balance); the refund is sent to the card at once under a key derived "
        "from the credit note. The non-void credit notes of an invoice never exceed its total. 409 when the "
        "invoice is neither open nor paid, or a payment of it is in flight; 402 when the gateway refuses the "
        "refund (the credit note is then void).",
        tags=["credit_notes"],
        request=CreditNoteCreate,
        responses={201: CreditNoteOut, 402: ERROR, 404: ERROR},
    )
    def post(self, request):
        data = self.read_body(CreditNoteCreate)
        note = service.create_credit_note(
            data["invoice"],
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            request_key=self.idempotency_key or "",
            **_request_of(data, _line_inputs(data.get("lines"))),
        )
        return Response(credit_note_data(note), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="credit_notes_list",
        summary="List credit notes, newest first",
        tags=["credit_notes"],
        responses=list_of(CreditNoteOut, "CreditNoteList"),
    )
    def get(self, request):
        query = self.read_query()
        notes = self.filter_by_query(self.scoped(CreditNote), query, invoice="invoice_id", customer="customer_id")
        return self.paginate(notes, credit_note_data, query, kind="credit_note")


class CreditNotePreviewView(ApiView):
    get_query = CreditNotePreviewQuery

    @extend_schema(
        operation_id="credit_notes_preview",
        summary="Preview a credit note (nothing is written)",
        description="The credit note `POST /v1/credit_notes` would issue with these parameters now.",
        tags=["credit_notes"],
        responses={200: CreditNoteOut, 404: ERROR},
    )
    def get(self, request):
        query = self.read_query()
        lines = None
        if query.get("lines"):
            try:
                raw = json.loads(query["lines"])
            except ValueError:
                raw = None
            serializer = CreditNoteLineCreate(data=raw, many=True)
            if not isinstance(raw, list) or not serializer.is_valid():
                raise InvalidRequestError(
                    "lines must be a JSON array of credit note lines.", code="credit_note_line_invalid", param="lines"
                )
            lines = _line_inputs(serializer.validated_data)
        draft = service.preview_credit_note(
            query["invoice"], tenant_id=self.tenant.pk, livemode=self.livemode, **_request_of(query, lines)
        )
        return Response(draft_data(draft, livemode=self.livemode))


class CreditNoteDetailView(ApiView):
    @extend_schema(
        operation_id="credit_notes_retrieve",
        summary="Get a credit note",
        tags=["credit_notes"],
        parameters=[id_path_parameter("credit_note")],
        responses={200: CreditNoteOut},
    )
    def get(self, request, id):
        return Response(credit_note_data(self.get_scoped(CreditNote, id, kind="credit_note")))


class CreditNoteVoidView(ApiView):
    @extend_schema(
        operation_id="credit_notes_void",
        summary="Void a credit note",
        description="Reverses what it can: a pre-payment credit note's amount goes back on its still-open "
        "invoice; a credit to the balance is taken back. 409 for a credit note with a refund (a refund sent "
        "cannot be unsent), one already void, or one whose credit the customer already used.",
        tags=["credit_notes"],
        request=Empty,
        parameters=[id_path_parameter("credit_note")],
        responses={200: CreditNoteOut},
    )
    def post(self, request, id):
        self.read_body(Empty)
        note = self.get_scoped(CreditNote, id, kind="credit_note")
        note = service.void_credit_note(note.pk, tenant_id=self.tenant.pk, livemode=self.livemode)
        return Response(credit_note_data(note))
