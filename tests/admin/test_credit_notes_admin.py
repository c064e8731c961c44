"""Credit notes from an invoice's page: issued through the service with the operator recorded; voided likewise."""

from django.urls import reverse

from billing.models import CreditNote, Customer, Invoice, Refund
from billing.services.drain import drain_due
from hardcount.models import AuditLogEntry
from tests.billing.conftest import VISA


def _paid(book):
    tenant = book.tenant()
    sub = book.subscribed(tenant, card=VISA)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    return Invoice.objects.get(subscription=sub, status="paid")


def test_an_operator_refunds_part_of_a_paid_invoice_from_its_page(book, stripe_proxy, operator):
    invoice = _paid(book)
    page = reverse("admin:billing_invoice_change", args=[invoice.pk])
    form_url = reverse("admin:billing_invoice_credit_note", args=[invoice.pk])
    assert form_url.encode() in operator.get(page).content
    assert b"$10.00" in operator.get(form_url).content

    response = operator.post(form_url, {"amount": "250", "destination": "refund", "reason": "duplicate", "memo": "x"})
    assert response.status_code == 302, response.content[:800]
    note = CreditNote.objects.get(invoice=invoice)
    assert (note.refund_amount, note.reason, note.created_by) == (250, "duplicate", "admin:operator-admin-test")
    assert Refund.objects.get(credit_note=note).outcome == Refund.SUCCEEDED
    shown = operator.get(page).content.decode()
    assert "Credit notes after payment" in shown and "$2.50" in shown
    entry = AuditLogEntry.objects.get(action="invoice.credit_note")
    assert entry.object_id == invoice.pk and "$2.50" in entry.message

    # Past what is left: refused by the service, shown on the form, recorded, nothing written.
    response = operator.post(form_url, {"amount": "900", "destination": "credit"})
    assert response.status_code == 200 and b"left to credit" in response.content
    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    assert AuditLogEntry.objects.filter(action="invoice.credit_note", message__startswith="Refused").count() == 1


def test_an_operator_voids_a_credit_to_the_balance(book, stripe_proxy, operator):
    invoice = _paid(book)
    form_url = reverse("admin:billing_invoice_credit_note", args=[invoice.pk])
    operator.post(form_url, {"amount": "300", "destination": "credit"})
    note = CreditNote.objects.get(invoice=invoice)
    assert Customer.objects.get(pk=invoice.customer_id).credit_balance == 300
    response = operator.post(
        reverse("admin:billing_creditnote_changelist"), {"action": "void", "_selected_action": [note.pk]}
    )
    assert response.status_code == 302
    assert CreditNote.objects.get(pk=note.pk).status == CreditNote.VOID
    assert Customer.objects.get(pk=invoice.customer_id).credit_balance == 0
    assert AuditLogEntry.objects.filter(action="credit_note.void", object_id=note.pk).exists()


def test_a_viewer_cannot_issue_a_credit_note(book, stripe_proxy, viewer):
    invoice = _paid(book)
    response = viewer.post(reverse("admin:billing_invoice_credit_note", args=[invoice.pk]), {"amount": "100"})
    assert response.status_code == 302
    assert not CreditNote.objects.exists()
