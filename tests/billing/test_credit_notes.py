"""Credit notes and refunds (docs/reference/credit-notes.md), against the real PostgreSQL and the strict dev Stripe.

A book's invoice is one 10.00 USD period (1000 cents, no tax), billed by the drain: paid with Visa, or left open by
a declining card. Expected amounts are worked out by hand in each test.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction

from billing.api.credit_notes import CreditNoteLine, CreditNoteOut, RefundOut
from billing.models import CreditNote, Customer, Invoice, LedgerEntry, PaymentAttempt, Refund
from billing.representations import refund_data
from billing.services import credit_notes
from billing.services.credit_notes import (
    CreditNoteStateError,
    LineInput,
    create_credit_note,
    reconcile_refunds,
    void_credit_note,
)
from billing.services.drain import drain_due
from billing.services.dunning_pass import process_due
from billing.services.payments import PaymentInFlight, key_safe_window
from dunning.models import DunningRun
from hardcount.errors import InvalidRequestError
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import DECLINING_CARD, VISA, events

DAY = timedelta(days=1)


def _paid(book, tenant, amount: int = 1000) -> Invoice:
    sub = book.subscribed(tenant, card=VISA, amount=amount)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == Invoice.PAID and invoice.amount_paid == amount
    return invoice


def _declined(book, tenant, amount: int = 1000) -> Invoice:
    sub = book.subscribed(tenant, card=DECLINING_CARD, amount=amount)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == Invoice.OPEN and invoice.payment_intent_id
    return invoice


def _refunds_sent(proxy) -> list:
    """Refund creates that reached localstripe (a replay is Stripe's stored answer, not a new refund)."""
    return proxy.entries("POST /v1/refunds", action="forwarded") + proxy.entries("POST /v1/refunds", action="reset")


def _gateway_refunds(stripe_client, invoice) -> list:
    return list(stripe_client.v1.refunds.list(params={"payment_intent": invoice.payment_intent_id}).data)


def _age(refund: Refund, by: timedelta) -> None:
    Refund.objects.filter(pk=refund.pk).update(
        started_at=refund.started_at - by, first_sent_at=refund.first_sent_at - by
    )


def _create(invoice, **kw) -> CreditNote:
    return create_credit_note(invoice.id, tenant_id=invoice.tenant_id, livemode=False, **kw)


# --- refunds to the card ----------------------------------------------------------------------------------------


def test_partial_credit_note_on_a_paid_invoice_refunds_the_card_once_even_when_the_request_is_replayed(
    book, stripe_proxy, stripe_client
):
    keys = make_keys("Acme")
    invoice = _paid(book, keys.tenant)
    api = Api(keys.test)
    body = {"invoice": invoice.id, "amount": 300, "refund_amount": 300, "reason": "product_unsatisfactory"}
    headers = {"Idempotency-Key": "cn-once-1"}

    status, note = api.post("/v1/credit_notes", body, headers=headers)
    assert status == 201, note
    assert (note["status"], note["type"], note["total"], note["refund_amount"], note["number"]) == (
        "issued",
        "post_payment",
        300,
        300,
        "CN-000001",
    )
    assert (note["refund"]["outcome"], note["refund"]["status"], note["refund"]["amount"]) == (
        "succeeded",
        "succeeded",
        300,
    )
    assert note["refund"]["idempotency_key"] == f"hc:{note['id']}:refund"
    # The same request again under the same key: the stored answer, nothing sent.
    assert api.post("/v1/credit_notes", body, headers=headers) == (201, note)

    assert len(_refunds_sent(stripe_proxy)) == 1
    (gateway_refund,) = _gateway_refunds(stripe_client, invoice)
    assert (gateway_refund.id, gateway_refund.amount, gateway_refund.status) == (
        note["refund"]["gateway_refund"],
        300,
        "succeeded",
    )
    assert gateway_refund.metadata["hardcount_refund"] == note["refund"]["id"]
    status, got = api.get(f"/v1/invoices/{invoice.id}")
    assert (got["post_payment_credit_notes_amount"], got["pre_payment_credit_notes_amount"], got["amount_paid"]) == (
        300,
        0,
        1000,
    )
    assert [e.data["id"] for e in events("credit_note.created")] == [note["id"]]
    (refunded,) = events("invoice.refunded")
    assert (refunded.data["id"], refunded.data["refund"]["amount"], refunded.data["credit_note"]) == (
        invoice.id,
        300,
        note["id"],
    )


def test_a_refund_whose_answer_was_lost_is_resent_under_its_key_by_the_reconciler(book, stripe_proxy, stripe_client):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    stripe_proxy.fail_next("reset", match="POST /v1/refunds")
    note = _create(invoice, amount=400, refund_amount=400)
    refund = Refund.objects.get(credit_note=note)
    assert refund.outcome == Refund.UNKNOWN
    assert len(_gateway_refunds(stripe_client, invoice)) == 1  # it ran at the gateway; the answer was lost

    assert reconcile_refunds(livemode=False) == {"refunds_resolved": 0, "refunds_unresolved": 0}  # still in flight
    _age(refund, timedelta(minutes=5))
    assert reconcile_refunds(livemode=False) == {"refunds_resolved": 1, "refunds_unresolved": 0}

    refund.refresh_from_db()
    assert (refund.outcome, refund.status, refund.amount) == (Refund.SUCCEEDED, "succeeded", 400)
    calls = stripe_proxy.entries("POST /v1/refunds")
    assert [e.action for e in calls] == ["reset", "replayed"]
    assert {e.request.idempotency_key for e in calls} == {f"hc:{note.id}:refund"}
    assert len(_gateway_refunds(stripe_client, invoice)) == 1
    assert len(events("invoice.refunded")) == 1


def test_a_refund_whose_key_may_have_expired_is_looked_up_by_metadata_not_sent_again(book, stripe_proxy, stripe_client):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    stripe_proxy.fail_next("reset", match="POST /v1/refunds")
    note = _create(invoice, amount=250, refund_amount=250)
    refund = Refund.objects.get(credit_note=note)
    # A day later the gateway forgot the key: a re-send under it would run as a new request (a second refund).
    assert stripe_proxy.expire_key(refund.idempotency_key)
    _age(refund, key_safe_window() + timedelta(hours=1))

    assert reconcile_refunds(livemode=False)["refunds_resolved"] == 1
    refund.refresh_from_db()
    assert refund.outcome == Refund.SUCCEEDED
    assert [e.action for e in stripe_proxy.entries("POST /v1/refunds")] == ["reset"]
    assert [r.amount for r in _gateway_refunds(stripe_client, invoice)] == [250]


def test_negative_control_without_the_lookup_an_expired_key_refunds_twice(book, stripe_proxy, stripe_client, no_doctor):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    stripe_proxy.fail_next("reset", match="POST /v1/refunds")
    note = _create(invoice, amount=250, refund_amount=250)
    refund = Refund.objects.get(credit_note=note)
    assert stripe_proxy.expire_key(refund.idempotency_key)
    # The guard removed: the refund is sent again as if its key were young.
    credit_notes.send_refund.__globals__["key_safe_window"] = lambda: timedelta(days=3650)
    try:
        _age(refund, timedelta(days=1, hours=1))
        reconcile_refunds(livemode=False)
    finally:
        credit_notes.send_refund.__globals__["key_safe_window"] = key_safe_window
    assert [r.amount for r in _gateway_refunds(stripe_client, invoice)] == [250, 250]


def test_a_refund_past_what_is_left_of_the_charge_is_refused_by_the_gateway_and_voids_its_credit_note(
    book, stripe_proxy, stripe_client
):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    # Someone refunded 800 of the 1000 straight at Stripe (the dashboard): 200 are left to refund.
    stripe_client.v1.refunds.create(params={"payment_intent": invoice.payment_intent_id, "amount": 800})
    with pytest.raises(credit_notes.RefundFailed) as refused:
        _create(invoice, amount=500, refund_amount=500)
    assert refused.value.status_code == 402
    (note,) = CreditNote.objects.filter(invoice=invoice)
    assert (note.status, Refund.objects.get(credit_note=note).outcome) == (CreditNote.VOID, Refund.ERROR)
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 0
    assert [r.amount for r in _gateway_refunds(stripe_client, invoice)] == [800]
    assert [e.data["id"] for e in events("credit_note.voided")] == [note.id]


def test_refunds_are_per_gateway_account(book, stripe_proxy, stripe_client):
    """A refund names its PaymentIntent; the strict dev Stripe answers another account 404, as Stripe does."""
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    other = stripe_client.__class__(
        "sk_test_someone_else", base_addresses={"api": stripe_proxy.api_base}, max_network_retries=0
    )
    with pytest.raises(Exception) as foreign:
        other.v1.refunds.create(params={"payment_intent": invoice.payment_intent_id, "amount": 100})
    assert getattr(foreign.value, "http_status", None) == 404
    assert _gateway_refunds(stripe_client, invoice) == []


# --- the sum of credit notes --------------------------------------------------------------------------------------


def test_credit_notes_past_the_invoice_total_are_refused(book):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    _create(invoice, amount=600, out_of_band_amount=600)
    with pytest.raises(InvalidRequestError) as refused:
        _create(invoice, amount=401, out_of_band_amount=401)
    assert refused.value.code == "credit_note_amount_too_large"
    last = _create(invoice, amount=400, out_of_band_amount=400)
    assert last.number == "CN-000002"  # the refused one took no number
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 1000


def test_numbers_are_gapless_per_tenant_a_refusal_takes_none_and_a_void_keeps_its_own(book):
    acme, globex = book.tenant("Acme"), book.tenant("Globex")
    first, other = _paid(book, acme), _paid(book, globex)

    one = _create(first, amount=100, credit_amount=100)
    with pytest.raises(InvalidRequestError):
        _create(first, amount=5000, out_of_band_amount=5000)  # past the total: refused, no number taken
    two = _create(first, amount=100, out_of_band_amount=100)
    void_credit_note(one.id, tenant_id=acme.id, livemode=False)
    three = _create(first, amount=100, out_of_band_amount=100)
    elsewhere = _create(other, amount=100, out_of_band_amount=100)

    assert [n.number for n in (one, two, three)] == ["CN-000001", "CN-000002", "CN-000003"]
    assert CreditNote.objects.get(pk=one.pk).status == CreditNote.VOID  # voided, its number kept
    assert elsewhere.number == "CN-000001"  # another tenant counts on its own


def _race(invoice, *, hold_first: bool = True) -> list:
    """Two credit notes of 600 on a 1000 invoice from two connections: the first holds its transaction open after
    its check until the second has started. Returns each one's result (a credit note, or the exception)."""
    inside, go = threading.Event(), threading.Event()
    real_number = credit_notes.next_credit_note_number
    results: dict[str, object] = {}

    def numbered(*args, **kwargs):
        if threading.current_thread().name == "first":
            inside.set()
            go.wait(10)
        return real_number(*args, **kwargs)

    def run(name):
        try:
            results[name] = _create(invoice, amount=600, out_of_band_amount=600)
        except Exception as exc:  # the refusal is the result
            results[name] = exc
        finally:
            connection.close()

    credit_notes.next_credit_note_number = numbered
    try:
        first = threading.Thread(target=run, args=("first",), name="first")
        first.start()
        assert inside.wait(10)
        second = threading.Thread(target=run, args=("second",), name="second")
        second.start()
        second.join(1.0)  # blocked on the invoice's row lock (or, without it, done already)
        go.set()
        first.join(10)
        second.join(10)
    finally:
        credit_notes.next_credit_note_number = real_number
    return [results["first"], results["second"]]


def test_two_connections_racing_past_the_total_the_second_is_refused(book):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    first, second = _race(invoice)
    assert isinstance(first, CreditNote)
    assert isinstance(second, InvalidRequestError) and second.status_code == 422
    assert second.code == "credit_note_amount_too_large"
    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 600


def test_negative_control_without_the_invoice_lock_both_credit_notes_pass(book, no_doctor):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    real = credit_notes._locked_invoice

    def unlocked(invoice_id, *, tenant_id, livemode):
        found = Invoice.objects.get(pk=invoice_id)
        return None, found

    credit_notes._locked_invoice = unlocked
    try:
        first, second = _race(invoice)
    finally:
        credit_notes._locked_invoice = real
    assert isinstance(first, CreditNote) and isinstance(second, CreditNote)
    total = sum(CreditNote.objects.filter(invoice=invoice).values_list("total", flat=True))
    assert total == 1200 > invoice.total


# --- credit to the balance, out of band, void ---------------------------------------------------------------------


def test_credit_to_the_balance_is_a_ledger_entry_and_voiding_takes_it_back(book):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, lines=[LineInput(invoice.lines.get().id, amount=350)], credit_amount=350, memo="late")
    customer = Customer.objects.get(pk=invoice.customer_id)
    assert (note.total, note.subtotal, note.tax, note.credit_amount, customer.credit_balance) == (350, 350, 0, 350, 350)
    entry = LedgerEntry.objects.get(pk=note.credit_entry_id)
    assert (entry.reason, entry.amount, entry.balance_after, entry.invoice_id) == ("credit_note", 350, 350, invoice.id)
    assert not Refund.objects.exists()

    voided = void_credit_note(note.id, tenant_id=tenant.id, livemode=False)
    assert voided.status == CreditNote.VOID
    customer.refresh_from_db()
    assert customer.credit_balance == 0
    assert list(
        LedgerEntry.objects.filter(customer=customer).order_by("created_at").values_list("amount", flat=True)
    ) == [
        350,
        -350,
    ]
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 0
    with pytest.raises(CreditNoteStateError):
        void_credit_note(note.id, tenant_id=tenant.id, livemode=False)


def test_a_paid_invoices_credit_note_without_a_destination_goes_to_the_balance(book):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, amount=120)
    assert (note.credit_amount, Customer.objects.get(pk=invoice.customer_id).credit_balance) == (120, 120)


def test_out_of_band_credit_moves_no_money(book, stripe_proxy):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, amount=700, refund_amount=200, out_of_band_amount=500)
    assert (note.refund_amount, note.out_of_band_amount, note.credit_amount) == (200, 500, 0)
    assert Refund.objects.get(credit_note=note).amount == 200
    assert Customer.objects.get(pk=invoice.customer_id).credit_balance == 0
    with pytest.raises(InvalidRequestError) as mismatch:
        _create(invoice, amount=100, refund_amount=50, out_of_band_amount=40)
    assert mismatch.value.code == "credit_note_amounts_mismatch"


def test_a_credit_note_with_a_refund_cannot_be_voided(book, stripe_proxy):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, amount=100, refund_amount=100)
    with pytest.raises(CreditNoteStateError) as refused:
        void_credit_note(note.id, tenant_id=tenant.id, livemode=False)
    assert refused.value.code == "credit_note_has_refund"
    assert CreditNote.objects.get(pk=note.pk).status == CreditNote.ISSUED


def test_only_open_or_paid_invoices_take_credit_notes(book):
    tenant = book.tenant()
    invoice = _declined(book, tenant)
    Invoice.objects.filter(pk=invoice.pk).update(status=Invoice.UNCOLLECTIBLE)
    with pytest.raises(CreditNoteStateError):
        _create(invoice, amount=100)
    Invoice.objects.filter(pk=invoice.pk).update(status=Invoice.OPEN)


# --- open invoices: pre-payment credit notes and dunning -----------------------------------------------------------


def test_a_credit_note_on_an_open_invoice_is_charged_reduced_by_the_next_dunning_retry_under_a_new_key(
    book, stripe_proxy, stripe_client, make_card
):
    tenant = book.tenant()
    invoice = _declined(book, tenant)
    run = DunningRun.objects.get(invoice=invoice)
    note = _create(invoice, amount=400, reason="order_change")
    invoice.refresh_from_db()
    assert (note.type, note.pre_payment_amount, invoice.amount_due, invoice.pre_payment_credit_notes_amount) == (
        "pre_payment",
        400,
        600,
        400,
    )
    with pytest.raises(InvalidRequestError):
        _create(invoice, amount=100, refund_amount=100)  # nothing was paid: no refund of an open invoice
    Customer.objects.filter(pk=invoice.customer_id).update(default_payment_method=make_card(VISA))

    assert process_due(livemode=False, as_of=run.first_declined_at + DAY) == 1

    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid, invoice.amount_due) == (Invoice.PAID, 600, 600)
    first, second = PaymentAttempt.objects.filter(invoice=invoice).order_by("attempt_number")
    assert (first.amount, second.amount) == (1000, 600)
    assert (first.idempotency_key, second.idempotency_key) == (f"hc:{invoice.id}:create", f"hc:{invoice.id}:attempt:2")
    bodies = {}
    for entry in stripe_proxy.entries("POST /v1/payment_intents"):
        bodies.setdefault(entry.request.idempotency_key, set()).add(tuple(sorted(entry.request.params.items())))
    assert all(len(b) == 1 for b in bodies.values()), "a key was sent with two bodies"
    assert dict(next(iter(bodies[f"hc:{invoice.id}:attempt:2:amount"])))["amount"] == "600"
    assert stripe_proxy.entries(action="conflict") == []
    intent = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id)
    assert (intent.amount, intent.status) == (600, "succeeded")


def test_a_credit_note_for_the_whole_amount_due_pays_the_open_invoice(book):
    tenant = book.tenant()
    invoice = _declined(book, tenant)
    _create(invoice, amount=1000)
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_due, invoice.amount_paid) == (Invoice.PAID, 0, 0)
    assert DunningRun.objects.get(invoice=invoice).status != "active"
    assert [e.data["id"] for e in events("invoice.paid")] == [invoice.id]


def test_a_pre_payment_credit_note_waits_for_a_payment_in_flight_and_voids_back_onto_amount_due(book):
    tenant = book.tenant()
    invoice = _declined(book, tenant)
    with transaction.atomic():
        attempt = PaymentAttempt.objects.filter(invoice=invoice).get()
        PaymentAttempt.objects.filter(pk=attempt.pk).update(outcome=PaymentAttempt.UNKNOWN)
    with pytest.raises(PaymentInFlight):
        _create(invoice, amount=100)
    PaymentAttempt.objects.filter(pk=attempt.pk).update(outcome=PaymentAttempt.DECLINED)

    note = _create(invoice, amount=300)
    void_credit_note(note.id, tenant_id=tenant.id, livemode=False)
    invoice.refresh_from_db()
    assert (invoice.amount_due, invoice.pre_payment_credit_notes_amount) == (1000, 0)


# --- the API ------------------------------------------------------------------------------------------------------


def test_api_lists_gets_previews_and_voids(book, stripe_proxy):
    keys = make_keys("Acme")
    invoice = _paid(book, keys.tenant)
    api = Api(keys.test)
    line = invoice.lines.get()
    status, preview = api.get(
        "/v1/credit_notes/preview",
        {
            "invoice": invoice.id,
            "lines": f'[{{"type": "invoice_line_item", "invoice_line_item": "{line.id}", "quantity": 1}}]',
            "out_of_band_amount": "1000",
        },
    )
    assert status == 200, preview
    assert (preview["id"], preview["total"], preview["lines"][0]["amount"]) == (None, 1000, 1000)
    assert not CreditNote.objects.exists()

    status, note = api.post("/v1/credit_notes", {"invoice": invoice.id, "amount": 100, "credit_amount": 100})
    assert status == 201
    # The OpenAPI output schemas declare exactly the keys the representations return.
    assert set(note) == set(CreditNoteOut().fields) and set(preview) == set(note)
    assert set(note["lines"][0] if note["lines"] else preview["lines"][0]) == set(CreditNoteLine().fields)
    assert set(refund_data(Refund(credit_note_id="cn_x", invoice_id="in_x"))) == set(RefundOut().fields)
    assert api.get(f"/v1/credit_notes/{note['id']}") == (200, note)
    status, listed = api.get("/v1/credit_notes", {"invoice": invoice.id})
    assert (status, [n["id"] for n in listed["data"]]) == (200, [note["id"]])
    status, voided = api.post(f"/v1/credit_notes/{note['id']}/void", {})
    assert (status, voided["status"]) == (200, "void")
    status, error = api.post("/v1/credit_notes", {"invoice": invoice.id})
    assert (status, error["error"]["code"]) == (422, "credit_note_lines_or_amount")
    other = Api(make_keys("Globex").test)
    assert other.get(f"/v1/credit_notes/{note['id']}")[0] == 404
    assert other.post("/v1/credit_notes", {"invoice": invoice.id, "amount": 1})[0] == 404


def test_the_doctor_finds_every_refund_at_the_gateway_and_a_refund_the_books_misstate(book, stripe_proxy, no_doctor):
    from ops import doctor

    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, amount=300, refund_amount=300)
    result = doctor.check_gateway_refunds()
    assert (result.status, result.note) == (doctor.OK, "1 refunds compared")

    Refund.objects.filter(credit_note=note).update(outcome=Refund.UNKNOWN, gateway_refund_id="")
    assert doctor.check_gateway_refunds().status == doctor.OK  # found by its metadata
    Refund.objects.filter(credit_note=note).update(amount=299)
    result = doctor.check_gateway_refunds()
    assert result.status == doctor.FAIL
    assert result.examples == [f"{Refund.objects.get(credit_note=note).id}: 299 usd in the books, 300 usd refunded"]


def test_lines_are_taxed_at_the_invoices_rate_and_quantities_take_whole_units(book, no_doctor):
    tenant = book.tenant()
    invoice = _paid(book, tenant)
    # The invoice as a taxed one of 3 units: subtotal 1,200 (3 × 400), tax 10 % = 120, total 1,320.
    line = invoice.lines.get()
    type(line).objects.filter(pk=line.pk).update(quantity=3, amount=1200)
    Invoice.objects.filter(pk=invoice.pk).update(
        subtotal=1200, tax=120, tax_rate_bps=1000, total=1320, amount_due=1320, amount_paid=1320
    )
    draft = credit_notes.preview_credit_note(
        invoice.id, tenant_id=tenant.id, livemode=False, lines=[LineInput(line.id, quantity=1)]
    )
    assert (draft.subtotal, draft.tax, draft.total, draft.credit_amount) == (400, 40, 440, 440)
    draft = credit_notes.preview_credit_note(
        invoice.id, tenant_id=tenant.id, livemode=False, lines=[LineInput(line.id, amount=1005)], refund_amount=1106
    )
    assert (draft.subtotal, draft.tax, draft.total, draft.refund_amount) == (1005, 101, 1106, 1106)  # 100.5 rounds up
    with pytest.raises(InvalidRequestError) as too_many:
        credit_notes.preview_credit_note(
            invoice.id, tenant_id=tenant.id, livemode=False, lines=[LineInput(line.id, quantity=4)]
        )
    assert too_many.value.param == "lines[0].quantity"


def test_a_credit_already_used_cannot_be_voided(book):
    from billing.services.ledger import grant_credit

    tenant = book.tenant()
    invoice = _paid(book, tenant)
    note = _create(invoice, amount=350, credit_amount=350)
    grant_credit(invoice.customer_id, tenant_id=tenant.id, livemode=False, amount=-300)  # 50 of it left
    with pytest.raises(CreditNoteStateError) as refused:
        void_credit_note(note.id, tenant_id=tenant.id, livemode=False)
    assert refused.value.code == "credit_already_applied"
    assert Customer.objects.get(pk=invoice.customer_id).credit_balance == 50


def test_yen_are_credited_as_stored(book):
    tenant = book.tenant()
    sub = book.subscribed(tenant, card=VISA, amount=1200, currency="jpy")
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    note = _create(invoice, amount=500, out_of_band_amount=500)
    invoice.refresh_from_db()
    assert (note.currency, note.total, invoice.post_payment_credit_notes_amount, invoice.amount_paid) == (
        "jpy",
        500,
        500,
        1200,
    )


def test_a_discounted_line_is_credited_up_to_what_was_billed_for_it(book):
    # 1999 at 25 % off: the line was billed 1999 − 500 = 1499 (499.75 rounds up), the whole line credits 1499.
    from decimal import Decimal

    from billing.services import discounts

    tenant = book.tenant()
    sub = book.subscribed(tenant, card=VISA, amount=1999)
    coupon = discounts.create_coupon(tenant_id=tenant.id, livemode=False, percent_off=Decimal("25"), duration="forever")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    (line,) = invoice.lines.all()
    assert (line.amount, line.discount_amount, invoice.amount_paid) == (1999, 500, 1499)

    with pytest.raises(InvalidRequestError) as refused:
        _create(invoice, lines=[LineInput(line.id, amount=1500)], refund_amount=1500)
    assert refused.value.code == "credit_note_line_invalid"
    note = _create(invoice, lines=[LineInput(line.id, quantity=1)], refund_amount=1499)

    assert (note.subtotal, note.total, note.refund_amount) == (1499, 1499, 1499)
    assert [item.amount for item in note.lines.all()] == [1499]
