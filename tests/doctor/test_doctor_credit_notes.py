"""The doctor's credit-note checks (ops/sql/credit_notes.sql): each finds the violation planted for it, and a
consistent credit note trips nothing. The clean book of tests/doctor/world.py, one planted row set per test,
rolled back; a CHECK constraint that forbids the violation is dropped first."""

from __future__ import annotations

import pytest
from django.db.models import F

from billing.models import CreditNote, CreditNoteCounter, Customer, Invoice, LedgerEntry, Refund
from tests.doctor.test_doctor import assert_only, sql
from tests.doctor.world import build_world, wipe


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        wipe()
        w = build_world()
    yield w
    with django_db_blocker.unblock():
        wipe()


def _note(invoice_id: str, *, number: int = 1, counter: int | None = None, **parts) -> CreditNote:
    """A post-payment credit note of ``parts`` (refund/credit/out_of_band amounts) on the invoice, counted on it."""
    invoice = Invoice.objects.get(pk=invoice_id)
    total = sum(parts.values())
    CreditNoteCounter.objects.update_or_create(
        tenant_id=invoice.tenant_id, livemode=invoice.livemode, defaults={"last_number": counter or number}
    )
    Invoice.objects.filter(pk=invoice.pk).update(
        post_payment_credit_notes_amount=F("post_payment_credit_notes_amount") + total
    )
    return CreditNote.objects.create(
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        invoice=invoice,
        customer_id=invoice.customer_id,
        number=f"CN-{number:06d}",
        type=CreditNote.POST_PAYMENT,
        currency=invoice.currency,
        subtotal=total,
        total=total,
        **parts,
    )


def _credit(note: CreditNote) -> None:
    """The ledger entry of the note's credit_amount, as the service writes it."""
    customer = Customer.objects.get(pk=note.customer_id)
    customer.credit_balance += note.credit_amount
    customer.save(update_fields=["credit_balance"])
    entry = LedgerEntry.objects.create(
        tenant_id=note.tenant_id,
        livemode=note.livemode,
        customer=customer,
        amount=note.credit_amount,
        currency=note.currency,
        balance_after=customer.credit_balance,
        reason=LedgerEntry.CREDIT_NOTE,
        invoice_id=note.invoice_id,
    )
    CreditNote.objects.filter(pk=note.pk).update(credit_entry=entry)


def test_a_consistent_credit_note_passes_every_check(world, db):
    note = _note(world.paid, credit_amount=200, out_of_band_amount=100)
    _credit(note)
    assert_only({})


def test_credit_notes_past_the_invoice_total_are_found_without_the_check_constraint(world, db):
    sql("ALTER TABLE billing_invoice DROP CONSTRAINT invoice_credit_notes_within_total")
    total = Invoice.objects.get(pk=world.paid).total
    _note(world.paid, out_of_band_amount=total + 1)
    assert_only({"credit_notes_within_invoice_total": [world.paid]})


def test_invoice_credit_note_amounts_out_of_step_are_found(world, db):
    _note(world.paid, out_of_band_amount=100)
    Invoice.objects.filter(pk=world.paid).update(post_payment_credit_notes_amount=0)
    assert_only({"credit_notes_within_invoice_total": [world.paid]})


def test_a_gap_in_credit_note_numbers_is_found(world, db):
    _note(world.paid, number=2, out_of_band_amount=100)
    assert_only({"credit_note_numbers_gapless": [world.acme]})


def test_a_refund_amount_without_its_refund_is_found(world, db):
    note = _note(world.paid, refund_amount=100)
    assert_only({"refund_has_its_credit_note": [note.id]})


def test_a_refund_left_unknown_is_found(world, db):
    note = _note(world.paid, refund_amount=100)
    invoice = Invoice.objects.get(pk=world.paid)
    refund = Refund.objects.create(
        tenant_id=note.tenant_id,
        livemode=note.livemode,
        credit_note=note,
        invoice=invoice,
        amount=100,
        currency=note.currency,
        payment_intent_id="pi_test",
        idempotency_key=f"hc:{note.id}:refund",
    )
    assert_only({}, unknown_after_s=3600)
    Refund.objects.filter(pk=refund.pk).update(started_at=F("started_at") - __import__("datetime").timedelta(hours=2))
    assert_only({"refund_has_its_credit_note": [refund.id]}, unknown_after_s=3600)


def test_a_credit_without_its_ledger_entry_is_found(world, db):
    note = _note(world.paid, credit_amount=150)
    assert_only({"ledger_agrees_with_credit_notes": [note.id, world.alice]})
