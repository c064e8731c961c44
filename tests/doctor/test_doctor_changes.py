"""The doctor's checks of prorations, pending invoice items and subscription items (docs/doctor.md, decision 0146).

A book made through the API and the drain on a test clock (an upgrade with prorations, a pending item of the
customer's, the next period billed, a restarted cycle) is clean; then each check is shown to find the one
corruption planted for it, inside a savepoint that is rolled back (so the book fixture's closing sweep sees the
clean book again). Each corruption asserts the exact set of these checks that fail.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection, transaction

from billing.models import Invoice, InvoiceItem, InvoiceLineItem, Subscription, SubscriptionItem, TestClock
from billing.services.drain import drain_due
from ops import doctor
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import (  # noqa: F401  (fixtures, used by name)
    book,
    localstripe_base,
    make_card,
    proxy_session,
    stripe_client,
    stripe_proxy,
)

# ruff: noqa: F811  (test functions take the imported fixtures as arguments)

CHECKS = [
    "proration_matches_its_inputs",
    "invoice_item_on_one_invoice",
    "pending_invoice_item_swept",
    "billable_subscription_has_items",
]
APR_1, APR_16 = datetime(2027, 4, 1, tzinfo=UTC), datetime(2027, 4, 16, tzinfo=UTC)
MAY_1, MAY_16 = datetime(2027, 5, 1, tzinfo=UTC), datetime(2027, 5, 16, tzinfo=UTC)


def failing() -> dict[str, list[str]]:
    """The failing checks among :data:`CHECKS`, each with the refs it names (errors fail the test at once)."""
    results = doctor.run_checks(names=CHECKS)
    assert not [r for r in results if r.status == doctor.ERROR], [r.note for r in results]
    return {r.name: sorted(e.split(": ", 1)[0] for e in r.examples) for r in results if r.status == doctor.FAIL}


def planted(statement, params=()) -> dict[str, list[str]]:
    """Run ``statement`` (SQL, or a callable) in a savepoint, sweep, roll the savepoint back; the failing checks."""
    with transaction.atomic():
        if callable(statement):
            statement()
        else:
            with connection.cursor() as cursor:
                cursor.execute(statement, params)
        found = failing()
        transaction.set_rollback(True)
    return found


def _drop_unique_line_per_item() -> None:
    """Drop the line's UNIQUE ``invoice_item_id`` (inside the caller's savepoint): what the doctor sees without it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.conname FROM pg_constraint c JOIN pg_attribute a"
            " ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey)"
            " WHERE c.conrelid = 'billing_invoicelineitem'::regclass AND c.contype = 'u'"
            " AND a.attname = 'invoice_item_id'"
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'ALTER TABLE billing_invoicelineitem DROP CONSTRAINT "{name}"')


@pytest.fixture
def changed_book(book, stripe_proxy):
    """A subscription on a clock: April billed, upgraded on Apr 16 (two prorations, pending), a −100 credit item of
    the customer's, May billed (sweeping all three), then its cycle restarted on May 16 (a credit, swept at once)."""
    keys = make_keys("Acme")
    api = Api(keys.test)
    clock = TestClock.objects.create(tenant=keys.tenant, livemode=False, frozen_time=APR_1)
    customer = book.customer(keys.tenant, clock=clock)
    sub = book.subscription(customer, book.price(keys.tenant, amount=1000), anchor=APR_1)
    pro = book.price(keys.tenant, amount=2999)

    def bill(at):
        TestClock.objects.filter(pk=clock.pk).update(frozen_time=at)
        drain_due(livemode=False, trigger="test_clock", tenant_id=keys.tenant.id, test_clock_id=clock.id)

    bill(APR_1)
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=APR_16)
    item = SubscriptionItem.objects.get(subscription=sub)
    assert api.post(f"/v1/subscriptions/{sub.id}", {"items": [{"id": item.id, "price": pro.id}]})[0] == 200
    status, body = api.post(
        "/v1/invoiceitems", {"customer": customer.id, "amount": -100, "currency": "usd", "description": "Sorry"}
    )
    assert status == 201, body
    bill(MAY_1)
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=MAY_16)
    assert api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"})[0] == 200
    return sub


def test_a_book_of_changes_prorations_and_a_restarted_cycle_is_clean(changed_book):
    items = InvoiceItem.objects.filter(customer_id=changed_book.customer_id).order_by("created_at", "id")
    assert [(i.amount, i.proration) for i in items] == [(-500, True), (1500, True), (-100, False), (-1548, True)]
    assert all(i.invoice_id for i in items)
    # The restarted cycle's first invoice: 2,999 − 1,548 = 1,451 (the worked example of billing-changes.md).
    restarted = Invoice.objects.get(subscription=changed_book, period_start=MAY_16)
    assert (restarted.total, restarted.status) == (1451, "paid")
    assert failing() == {}


def test_a_proration_whose_amount_is_not_its_formula_is_reported(changed_book):
    # May 16 → Jun 1 is 16 of May's 31 days: −2999 × 1,382,400 / 2,678,400 = −1,547.87 → −1,548; −1,547 is off by one.
    credit = InvoiceItem.objects.get(amount=-1548)
    assert (credit.proration_full_amount, credit.proration_remaining_s, credit.proration_period_s) == (
        -2999,
        1_382_400,
        2_678_400,
    )
    # The line moves with the item, so only the formula's check fires.
    found = planted(
        "UPDATE billing_invoiceitem SET amount = -1547 WHERE id = %(id)s;"
        " UPDATE billing_invoicelineitem SET amount = -1547 WHERE invoice_item_id = %(id)s",
        {"id": credit.id},
    )
    assert found == {"proration_matches_its_inputs": [credit.id]}
    found = planted("UPDATE billing_invoiceitem SET proration_period_s = NULL WHERE id = %s", [credit.id])
    assert found == {"proration_matches_its_inputs": [credit.id]}
    found = planted("UPDATE billing_invoiceitem SET proration_remaining_s = 2678401 WHERE id = %s", [credit.id])
    assert found == {"proration_matches_its_inputs": [credit.id]}


def test_an_item_billed_on_two_invoices_or_pending_yet_billed_is_reported(changed_book):
    may = Invoice.objects.get(subscription=changed_book, period_start=MAY_1)
    restarted = Invoice.objects.get(subscription=changed_book, previous_billing_cycle_anchor__isnull=False)
    sorry = InvoiceItem.objects.get(amount=-100)
    assert sorry.invoice_id == may.id
    # A second line for the item on the restarted cycle's invoice (the line's UNIQUE index dropped first).

    def second_line():
        _drop_unique_line_per_item()
        line = InvoiceLineItem.objects.get(invoice_item=sorry)
        line.pk, line.invoice_id = InvoiceLineItem._meta.pk.get_default(), restarted.id
        line.save(force_insert=True)

    found = planted(second_line)
    assert found == {"invoice_item_on_one_invoice": [sorry.id]}
    # Pending again though billed: also one that May's invoice should have swept.
    found = planted("UPDATE billing_invoiceitem SET invoice_id = NULL WHERE id = %s", [sorry.id])
    assert found == {"invoice_item_on_one_invoice": [sorry.id], "pending_invoice_item_swept": [sorry.id]}
    found = planted("UPDATE billing_invoiceitem SET invoice_id = %s WHERE id = %s", [restarted.id, sorry.id])
    assert found == {"invoice_item_on_one_invoice": [sorry.id]}


def test_an_item_left_pending_past_an_invoice_that_should_have_swept_it_is_reported(changed_book):
    sub = changed_book
    # Created on Apr 20 for this subscription, still pending after May's invoice and the restart's: missed.
    missed = InvoiceItem.objects.create(
        tenant_id=sub.tenant_id,
        livemode=False,
        customer_id=sub.customer_id,
        subscription=sub,
        amount=250,
        currency="usd",
        description="Setup",
        period_start=datetime(2027, 4, 20, tzinfo=UTC),
        period_end=datetime(2027, 4, 20, tzinfo=UTC),
        created_at=datetime(2027, 4, 20, tzinfo=UTC),
    )
    try:
        assert failing() == {"pending_invoice_item_swept": [missed.id]}
        # Created after the last invoice began, it waits for the next one: not reported.
        InvoiceItem.objects.filter(pk=missed.pk).update(created_at=datetime(2027, 5, 20, tzinfo=UTC))
        assert failing() == {}
    finally:
        missed.delete()


def test_a_billable_subscription_without_items_is_reported_a_canceled_one_is_not(changed_book):
    sub = changed_book
    found = planted("DELETE FROM billing_subscriptionitem WHERE subscription_id = %s", [sub.id])
    assert found == {"billable_subscription_has_items": [sub.id]}
    other = Subscription.objects.exclude(pk=sub.id).values_list("price_id", flat=True).first()
    assert other is None  # one subscription in the book
    found = planted(
        "UPDATE billing_subscriptionitem SET price_id = (SELECT id FROM billing_price WHERE amount = 1000 LIMIT 1)"
        " WHERE subscription_id = %s",
        [sub.id],
    )
    assert found == {"billable_subscription_has_items": [sub.id]}
    found = planted(
        "DELETE FROM billing_subscriptionitem WHERE subscription_id = %(id)s;"
        " UPDATE billing_subscription SET status = 'canceled' WHERE id = %(id)s",
        {"id": sub.id},
    )
    assert found == {}


def test_a_restarted_cycle_without_its_record_is_reported_as_overlapping_and_off_cycle(changed_book):
    # The record of the anchor a restart replaced is what lets the period checks accept the restarted cycle.
    restarted = Invoice.objects.get(subscription=changed_book, previous_billing_cycle_anchor__isnull=False)
    earlier = Invoice.objects.filter(subscription=changed_book, period_start__lt=MAY_16).order_by("period_start")
    names = ["invoice_periods_disjoint", "invoice_period_on_billing_cycle"]
    with transaction.atomic():
        assert all(r.status == doctor.OK for r in doctor.run_checks(names=names))
        Invoice.objects.filter(pk=restarted.pk).update(previous_billing_cycle_anchor=None)
        results = {r.name: sorted(e.split(": ", 1)[0] for e in r.examples) for r in doctor.run_checks(names=names)}
        transaction.set_rollback(True)
    assert results == {
        "invoice_periods_disjoint": [restarted.id],
        "invoice_period_on_billing_cycle": sorted(i.id for i in earlier),
    }
