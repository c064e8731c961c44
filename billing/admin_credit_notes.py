"""The operators' console for credit notes: their list and page, and issuing one from an invoice's page.

Every operation goes through :mod:`billing.services.credit_notes`, as the API does, with the operator
recorded on the credit note (``created_by``: ``admin:<username>``) and in the audit log. Registered from
:mod:`billing.admin` (imported at its end); the invoice page links to :func:`issue_credit_note_view`.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse

from billing.models import CreditNote, CreditNoteCounter, CreditNoteLineItem, Invoice, Refund
from billing.services import credit_notes
from hardcount import audit
from hardcount.admin import ReadOnlyAdmin, id_link, mode_filter, money, prefixed_search, short_time
from hardcount.errors import ServiceError

ISSUE, VOID = "invoice.credit_note", "credit_note.void"
AUDIT_ACTIONS = audit.actions(ISSUE, VOID)
DESTINATIONS = (
    ("refund", "Refund to the card"),
    ("credit", "Credit the customer's balance"),
    ("out_of_band", "Returned outside Hardcount (out of band)"),
)


class CreditNoteForm(forms.Form):
    """An amount (minor units of the invoice's currency), where the money goes (paid invoices), a reason, a memo."""

    amount = forms.IntegerField(min_value=1, help_text="Minor units of the invoice's currency (cents for USD).")
    destination = forms.ChoiceField(
        choices=DESTINATIONS, required=False, help_text="Paid invoices only; an open invoice's amount due is reduced."
    )
    reason = forms.ChoiceField(choices=[("", "—"), *CreditNote.REASON_CHOICES], required=False)
    memo = forms.CharField(max_length=500, required=False)


def issue_credit_note_view(model_admin: ReadOnlyAdmin, request, object_id: str):
    """``GET``: the form for invoice ``object_id``; ``POST``: issue the credit note through the service."""
    invoice = get_object_or_404(Invoice, pk=object_id)
    page = reverse("admin:billing_invoice_change", args=[invoice.pk])
    if not model_admin.has_operate_permission(request):
        model_admin.message_user(request, "You may not issue credit notes.", messages.ERROR)
        return HttpResponseRedirect(page)
    form = CreditNoteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        amount, destination = form.cleaned_data["amount"], form.cleaned_data["destination"] or "credit"
        parts = {} if invoice.status == Invoice.OPEN else {f"{destination}_amount": amount}
        try:
            note = credit_notes.create_credit_note(
                invoice.id,
                tenant_id=invoice.tenant_id,
                livemode=invoice.livemode,
                created_by=f"admin:{request.user.get_username()}",
                amount=amount,
                reason=form.cleaned_data["reason"],
                memo=form.cleaned_data["memo"],
                **parts,
            )
        except ServiceError as exc:
            model_admin.record_action(request, ISSUE, invoice, f"Refused: {exc.message}")
            form.add_error(None, exc.message)
        else:
            message = f"Credit note {note.number} of {money(note.total, note.currency)} issued on {invoice.id}."
            model_admin.record_action(request, ISSUE, invoice, message)
            model_admin.message_user(request, message, messages.SUCCESS)
            return HttpResponseRedirect(page)
    left = invoice.total - invoice.pre_payment_credit_notes_amount - invoice.post_payment_credit_notes_amount
    total, due = money(invoice.total, invoice.currency), money(invoice.amount_due, invoice.currency)
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": "Issue a credit note",
        "invoice": invoice,
        "invoice_label": model_admin.object_label(invoice),
        "form": form,
        "explanation": (
            f"Invoice {invoice.number or invoice.id} is {invoice.status}: total {total}, "
            f"{money(left, invoice.currency)} left to credit, amount due {due}."
        ),
    }
    return TemplateResponse(request, "admin/billing/credit_note_form.html", context)


class RefundInline(admin.TabularInline):
    model = Refund
    fields = ("id", "amount", "currency", "gateway_refund_id", "status", "outcome", "idempotency_key", "completed_at")
    readonly_fields = fields
    can_delete = False
    extra = 0
    max_num = 0


@admin.register(CreditNote)
class CreditNoteAdmin(ReadOnlyAdmin):
    """Credit notes, newest first; voided through the service (one with a refund cannot be)."""

    list_display = ("id", "number", "created", "invoice", "total_display", "type", "status", "created_by")
    list_filter = (mode_filter(), "status", "type", "reason")
    list_select_related = ("invoice",)
    search_fields = ("id",)
    search_help_text = "Exact credit note id (cn_…), number, or invoice id (in_…)."
    inlines = [RefundInline]
    actions = ["void"]
    object_actions = (("void", "Void"),)
    readonly_fields = ("invoice_link", "total_display")
    exclude = ("invoice",)

    @admin.display(description="total")
    def total_display(self, note: CreditNote) -> str:
        return money(note.total, note.currency)

    @admin.display(description="at")
    def created(self, note: CreditNote) -> str:
        return short_time(note.created_at)

    @admin.display(description="invoice")
    def invoice_link(self, note: CreditNote):
        return id_link(Invoice, note.invoice_id)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"cn_": "pk", "in_": "invoice_id"}, default="number")

    def object_action_applies(self, note: CreditNote, action: str) -> bool:
        return note.status == CreditNote.ISSUED and not note.refund_amount

    @admin.action(description="Void (credit notes without a refund)", permissions=["operate"])
    def void(self, request, queryset):
        rows = self.selected_rows(request, queryset)
        if rows is None:
            return None
        for note in rows:
            try:
                credit_notes.void_credit_note(note.id, tenant_id=note.tenant_id, livemode=note.livemode)
            except ServiceError as exc:
                self.message_user(request, f"{note.number}: not voided. {exc.message}", messages.WARNING)
                self.record_action(request, VOID, note, f"Refused: {exc.message}")
                continue
            self.message_user(request, f"{note.number}: voided.", messages.SUCCESS)
            self.record_action(request, VOID, note, "Voided.")
        return self.after_action(request, rows)


@admin.register(CreditNoteLineItem)
class CreditNoteLineItemAdmin(ReadOnlyAdmin):
    list_display = ("id", "credit_note", "invoice_line_item", "amount", "quantity")
    list_select_related = ("credit_note",)
    search_fields = ("id",)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(queryset, search_term, {"cnli_": "pk", "cn_": "credit_note_id"})


@admin.register(CreditNoteCounter)
class CreditNoteCounterAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "last_number")
    list_select_related = ("tenant",)


@admin.register(Refund)
class RefundAdmin(ReadOnlyAdmin):
    """Refunds to the card, one per credit note with a refund_amount; resolved by the reconciler, never edited."""

    list_display = ("id", "credit_note", "invoice", "amount_display", "outcome", "status", "gateway_refund_id")
    list_filter = (mode_filter(), "outcome", "status")
    list_select_related = ("credit_note", "invoice")
    search_fields = ("id",)
    search_help_text = "Exact refund id (rfnd_…), credit note id (cn_…), invoice id (in_…) or gateway refund (re_…)."

    @admin.display(description="amount")
    def amount_display(self, refund: Refund) -> str:
        return money(refund.amount, refund.currency)

    def get_search_results(self, request, queryset, search_term):
        return prefixed_search(
            queryset,
            search_term,
            {"rfnd_": "pk", "cn_": "credit_note_id", "in_": "invoice_id", "re_": "gateway_refund_id"},
        )
