"""Paying and voiding invoices, their payment attempts, and customer credit over HTTP."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.response import Response

from billing.api import schemas as s
from billing.models import Customer, Invoice, InvoiceItem, LedgerEntry, PaymentAttempt
from billing.representations import invoice_data, invoice_item_data, ledger_entry_data, payment_attempt_data
from billing.serializers import Invoice as InvoiceOut
from billing.services.invoice_items import create_invoice_item
from billing.services.invoices import pay_invoice, void_invoice
from billing.services.ledger import grant_credit
from hardcount.api import ERROR, ApiView, id_path_parameter, list_of


class InvoiceActionView(ApiView):
    """``POST /v1/invoices/{id}/<action>``: an empty body; runs :meth:`act` on the caller's invoice and
    answers the invoice as it then is. A subclass implements :meth:`act` and documents its ``post``
    with :func:`invoice_action_schema`."""

    def post(self, request, id):
        self.read_body(s.Empty)
        invoice = self.get_scoped(Invoice, id, kind="invoice")
        return Response(invoice_data(self.act(invoice.pk)))

    def act(self, invoice_id: str) -> Invoice:
        """Run the action on the invoice ``invoice_id`` (the caller's); returns the invoice after it."""
        raise NotImplementedError


def invoice_action_schema(*, operation_id: str, summary: str, description: str):
    """The class decorator documenting an :class:`InvoiceActionView`'s ``post``: no body, the invoice back."""
    return extend_schema_view(
        post=extend_schema(
            operation_id=operation_id,
            summary=summary,
            description=description,
            tags=["invoices"],
            request=s.Empty,
            parameters=[id_path_parameter("invoice")],
            responses={200: InvoiceOut},
        )
    )


@invoice_action_schema(
    operation_id="invoices_pay",
    summary="Charge an open invoice now",
    description="Charges `amount_due` to the customer's current default payment method (a new attempt with "
    "its own idempotency key at the gateway). Answers the invoice: `paid`, or still `open` after a decline "
    "(see its payment attempts). 409 when the invoice is not open or a payment of it is in flight.",
)
class InvoicePayView(InvoiceActionView):
    def act(self, invoice_id: str) -> Invoice:
        invoice, _attempt, _outcome = pay_invoice(invoice_id, tenant_id=self.tenant.pk, livemode=self.livemode)
        return invoice


@invoice_action_schema(
    operation_id="invoices_void",
    summary="Void a draft or open invoice",
    description="The balance applied to it returns to the customer and its dunning stops. The period is not "
    "advanced: a subscription still on that period is invoiced afresh by the next drain. 409 when the "
    "invoice is paid, void or uncollectible, or a payment's outcome is still unknown.",
)
class InvoiceVoidView(InvoiceActionView):
    def act(self, invoice_id: str) -> Invoice:
        return void_invoice(invoice_id, tenant_id=self.tenant.pk, livemode=self.livemode)


class InvoicePaymentAttemptsView(ApiView):
    get_query = s.PaymentAttemptListQuery

    @extend_schema(
        operation_id="invoices_payment_attempts",
        summary="List an invoice's payment attempts, newest first",
        tags=["invoices"],
        parameters=[id_path_parameter("invoice")],
        responses=list_of(s.PaymentAttempt, "PaymentAttemptList"),
    )
    def get(self, request, id):
        query = self.read_query()
        invoice = self.get_scoped(Invoice, id, kind="invoice")
        attempts = PaymentAttempt.objects.filter(invoice=invoice)
        return self.paginate(attempts, payment_attempt_data, query, kind="payment_attempt", cursor_scope=attempts)


class CustomerCreditsView(ApiView):
    get_query = s.LedgerListQuery

    @extend_schema(
        operation_id="customers_credits_create",
        summary="Grant credit to (or debit) a customer's balance",
        description="Appends a ledger entry. Credit is applied to the customer's next finalised invoices, after "
        "tax; an invoice already finalised keeps its amount.",
        tags=["customers"],
        request=s.CreditCreate,
        parameters=[id_path_parameter("customer")],
        responses={201: s.LedgerEntry},
    )
    def post(self, request, id):
        data = self.read_body(s.CreditCreate)
        customer = self.get_scoped(Customer, id, kind="customer")
        entry = grant_credit(
            customer.pk,
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            amount=data["amount"],
            currency=data.get("currency"),
            description=data["description"],
        )
        return Response(ledger_entry_data(entry), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="customers_credits_list",
        summary="List a customer's credit ledger, newest first",
        tags=["customers"],
        parameters=[id_path_parameter("customer")],
        responses=list_of(s.LedgerEntry, "LedgerEntryList"),
    )
    def get(self, request, id):
        query = self.read_query()
        customer = self.get_scoped(Customer, id, kind="customer")
        entries = LedgerEntry.objects.filter(customer=customer)
        return self.paginate(entries, ledger_entry_data, query, kind="ledger_entry", cursor_scope=entries)


class InvoiceItemListView(ApiView):
    get_query = s.InvoiceItemListQuery

    @extend_schema(
        operation_id="invoiceitems_create",
        summary="Add a pending invoice item",
        description="A one-off amount (negative: a credit) for the customer's next invoice, or the given "
        "subscription's next invoice. The invoice that takes it shows it as a line; an item is billed once.",
        tags=["invoices"],
        request=s.InvoiceItemCreate,
        responses={201: s.InvoiceItem, 404: ERROR},
    )
    def post(self, request):
        data = self.read_body(s.InvoiceItemCreate)
        item = create_invoice_item(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            customer_id=data["customer"],
            amount=data["amount"],
            currency=data["currency"],
            description=data["description"],
            subscription_id=data.get("subscription"),
        )
        return Response(invoice_item_data(item), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="invoiceitems_list",
        summary="List invoice items, newest first",
        tags=["invoices"],
        responses=list_of(s.InvoiceItem, "InvoiceItemList"),
    )
    def get(self, request):
        query = self.read_query()
        items = self.filter_by_query(
            self.scoped(InvoiceItem), query, customer="customer_id", subscription="subscription_id"
        )
        return self.paginate(items, invoice_item_data, query, kind="invoice_item")
