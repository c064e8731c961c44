"""The invoice list: filters by status, tax status, tenant and mode; retry payment and void through the services."""

import pytest
from django.urls import reverse

from billing.models import Invoice, PaymentAttempt
from billing.services.customers import update_customer
from billing.services.drain import drain_due
from hardcount.models import Tenant
from outbox.models import Event
from tests.admin import rows
from tests.admin.conftest import changelist_ids, messages_of
from tests.billing.conftest import DECLINING_CARD

INVOICES = reverse("admin:billing_invoice_changelist")


@pytest.mark.django_db
def test_each_filter_narrows_the_invoice_list(operator):
    acme, globex = Tenant.objects.create(name="Acme"), Tenant.objects.create(name="Globex")
    acme_sub, globex_sub = rows.subscription(acme), rows.subscription(globex)
    live_sub = rows.subscription(acme, livemode=True)
    paid = rows.invoice(acme_sub, status="paid", tax_status="calculated")
    open_ = rows.invoice(acme_sub, status="open", offset=1)
    draft = rows.invoice(globex_sub, status="draft", tax_status="pending")
    void = rows.invoice(globex_sub, status="void", offset=1)
    live = rows.invoice(live_sub, status="open", tax_status="calculated")
    cases = [
        ({}, {paid.pk, open_.pk, draft.pk, void.pk, live.pk}),
        ({"status__exact": "open"}, {open_.pk, live.pk}),
        ({"status__exact": "void"}, {void.pk}),
        ({"tax_status__exact": "pending"}, {draft.pk}),
        ({"tax_status__exact": "calculated"}, {paid.pk, live.pk}),
        ({"tenant__id__exact": globex.pk}, {draft.pk, void.pk}),
        ({"mode": "live"}, {live.pk}),
        ({"tenant__id__exact": acme.pk, "status__exact": "open", "mode": "test"}, {open_.pk}),
    ]
    for params, expected in cases:
        assert changelist_ids(operator, INVOICES, params) == expected, params


@pytest.mark.django_db
def test_invoice_search_is_routed_by_id_prefix(tenant, operator):
    sub = rows.subscription(tenant)
    invoice = rows.invoice(sub)
    Invoice.objects.filter(pk=invoice.pk).update(number="ACME-0007", payment_intent_id="pi_123")
    rows.invoice(rows.subscription(tenant))

    for term in (invoice.pk, sub.pk, sub.customer_id, "pi_123", "ACME-0007"):
        assert changelist_ids(operator, INVOICES, {"q": term}) == {invoice.pk}, term


def test_retry_payment_charges_an_open_invoice_with_the_customers_new_card(
    book, stripe_proxy, make_card, stripe_client, operator
):
    tenant = book.tenant()
    sub = book.subscribed(tenant, card=DECLINING_CARD)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == "open"  # declined: dunning has started
    update_customer(
        tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, default_payment_method=make_card()
    )

    response = operator.post(INVOICES, {"action": "retry_payment", "_selected_action": [invoice.pk]}, follow=True)

    assert messages_of(response) == [f"{invoice.pk}: paid (charged)."]
    invoice.refresh_from_db()
    assert invoice.status == "paid"
    outcomes = list(PaymentAttempt.objects.filter(invoice=invoice).order_by("attempt_number").values_list("outcome"))
    assert outcomes == [("declined",), ("succeeded",)]
    assert stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).status == "succeeded"


@pytest.mark.django_db
def test_retry_payment_refuses_an_invoice_that_is_not_open(tenant, operator):
    invoice = rows.invoice(rows.subscription(tenant), status="paid")

    response = operator.post(INVOICES, {"action": "retry_payment", "_selected_action": [invoice.pk]}, follow=True)

    assert messages_of(response) == [
        f"{invoice.pk}: not charged. Invoice {invoice.pk} is paid; only open invoices can be paid."
    ]
    assert not PaymentAttempt.objects.exists()


@pytest.mark.django_db
def test_void_asks_for_confirmation_then_voids_and_emits_the_event(tenant, operator):
    invoice = rows.invoice(rows.subscription(tenant))

    confirm = operator.post(INVOICES, {"action": "void", "_selected_action": [invoice.pk]})
    assert confirm.status_code == 200 and invoice.pk.encode() in confirm.content
    invoice.refresh_from_db()
    assert invoice.status == "open"

    response = operator.post(
        INVOICES, {"action": "void", "_selected_action": [invoice.pk], "confirmed": "yes"}, follow=True
    )

    assert messages_of(response) == [f"{invoice.pk}: voided."]
    invoice.refresh_from_db()
    assert invoice.status == "void" and invoice.voided_at is not None
    assert Event.objects.filter(type="invoice.voided", data__id=invoice.pk).count() == 1


@pytest.mark.django_db
def test_the_invoice_page_cannot_be_edited(tenant, operator):
    invoice = rows.invoice(rows.subscription(tenant))

    response = operator.post(reverse("admin:billing_invoice_change", args=[invoice.pk]), {"status": "void"})

    assert response.status_code == 403
    invoice.refresh_from_db()
    assert invoice.status == "open"
