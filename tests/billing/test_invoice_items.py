"""Pending invoice items: created through the API, swept into the next invoice exactly once."""

import threading
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction

from billing.models import Invoice, InvoiceItem, InvoiceLineItem, LedgerEntry
from billing.periods import period_bounds
from billing.services import close as close_module
from billing.services.drain import drain_due
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events


@pytest.fixture
def acme(book):
    return make_keys("Acme")


def _drain(tenant):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


@pytest.mark.parametrize("page_close", [True, False])
def test_an_item_is_swept_into_the_next_invoice_once(book, acme, settings, stripe_proxy, page_close):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page_close
    sub = book.subscribed(acme.tenant, amount=1000)
    api = Api(acme.test)

    status, item = api.post(
        "/v1/invoiceitems",
        {"customer": sub.customer_id, "amount": 250, "currency": "usd", "description": "Setup fee"},
    )
    assert status == 201, item
    assert (item["object"], item["invoice"], item["amount"], item["subscription"]) == ("invoiceitem", None, 250, None)
    assert [e.data["id"] for e in events("invoiceitem.created")] == [item["id"]]
    status, credit = api.post(
        "/v1/invoiceitems",
        {"customer": sub.customer_id, "amount": -100, "currency": "usd", "subscription": sub.id},
    )
    assert status == 201, credit

    _drain(acme.tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert [(line.amount, line.invoice_item_id) for line in invoice.lines.all()] == [
        (1000, None),
        (250, item["id"]),
        (-100, credit["id"]),
    ]
    assert (invoice.subtotal, invoice.amount_due, invoice.amount_paid, invoice.status) == (1150, 1150, 1150, "paid")
    assert set(InvoiceItem.objects.values_list("invoice_id", flat=True)) == {invoice.id}
    status, listed = api.get("/v1/invoiceitems", {"customer": sub.customer_id})
    assert [(i["id"], i["invoice"]) for i in listed["data"]] == [(credit["id"], invoice.id), (item["id"], invoice.id)]

    # The next period's invoice takes nothing again.
    sub.refresh_from_db()
    type(sub).objects.filter(pk=sub.pk).update(next_billing_at=database_now() - timedelta(seconds=1))
    _drain(acme.tenant)
    assert InvoiceLineItem.objects.filter(invoice_item__isnull=False).count() == 2
    assert Invoice.objects.filter(subscription=sub).count() == 2


def test_credits_larger_than_the_invoice_go_to_the_balance(book, acme, stripe_proxy):
    sub = book.subscribed(acme.tenant, amount=1000)
    status, _ = Api(acme.test).post(
        "/v1/invoiceitems", {"customer": sub.customer_id, "amount": -1500, "currency": "usd"}
    )
    assert status == 201

    _drain(acme.tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.subtotal, invoice.total, invoice.credit_applied, invoice.amount_due, invoice.status) == (
        -500,
        -500,
        -500,
        0,
        "paid",
    )
    entry = LedgerEntry.objects.get(customer_id=sub.customer_id)
    assert (entry.amount, entry.balance_after, entry.invoice_id) == (500, 500, invoice.id)
    assert stripe_proxy.entries("POST /v1/payment_intents") == []


def test_bad_items_are_refused_and_write_nothing(book, acme):
    sub = book.subscribed(acme.tenant, amount=1000)
    other = make_keys("Globex")
    theirs = book.subscribed(other.tenant)
    api = Api(acme.test)

    assert api.post("/v1/invoiceitems", {"customer": sub.customer_id, "amount": 5, "currency": "eur"})[0] == 422
    assert api.post("/v1/invoiceitems", {"customer": sub.customer_id, "amount": 0, "currency": "usd"})[0] == 422
    assert api.post("/v1/invoiceitems", {"customer": theirs.customer_id, "amount": 5, "currency": "usd"})[0] == 404
    status, body = api.post(
        "/v1/invoiceitems", {"customer": sub.customer_id, "amount": 5, "currency": "usd", "subscription": theirs.id}
    )
    assert (status, body["error"]["param"]) == (404, "subscription")
    assert not InvoiceItem.objects.exists()


def _two_subscriptions_of_one_customer(book, tenant):
    customer = book.customer(tenant)
    subs = [book.subscription(customer, book.price(tenant, amount=1000)) for _ in range(2)]
    item = InvoiceItem.objects.create(
        tenant=tenant,
        livemode=False,
        customer=customer,
        amount=300,
        currency="usd",
        period_start=database_now(),
        period_end=database_now(),
    )
    return subs, item


def test_a_sweep_that_waited_on_the_items_lock_passes_over_the_item_taken_meanwhile(book, tenant):
    (first, second), item = _two_subscriptions_of_one_customer(book, tenant)
    swept_first, release, done = threading.Event(), threading.Event(), {}

    def sweep(sub, hold):
        try:
            sub.refresh_from_db()
            start, end = period_bounds(sub.billing_cycle_anchor, "month", 1, 0)
            with transaction.atomic():
                _invoice, lines = close_module.materialise_period_invoice(sub, start, end, database_now())
                done[sub.id] = [line.invoice_item_id for line in lines]
                if hold:
                    swept_first.set()
                    release.wait(10)
        finally:
            connection.close()

    a = threading.Thread(target=sweep, args=(first, True))
    a.start()
    assert swept_first.wait(10)
    b = threading.Thread(target=sweep, args=(second, False))
    b.start()
    b.join(1)
    assert b.is_alive(), "the second sweep waits on the item's row lock"
    release.set()
    a.join(10)
    b.join(10)

    assert done == {first.id: [None, item.id], second.id: [None]}
    item.refresh_from_db()
    assert item.invoice.subscription_id == first.id
    assert Invoice.objects.get(subscription=second).subtotal == 1000


def test_two_racing_drains_bill_an_item_once(book, tenant, settings, stripe_proxy):
    settings.HARDCOUNT_BILLING_CONCURRENCY = 1
    (first, second), item = _two_subscriptions_of_one_customer(book, tenant)
    barrier = threading.Barrier(2)

    def drain():
        try:
            barrier.wait(10)
            _drain(tenant)
        finally:
            connection.close()

    threads = [threading.Thread(target=drain) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    lines = InvoiceLineItem.objects.filter(invoice_item=item)
    assert lines.count() == 1
    assert Invoice.objects.filter(subscription__in=[first, second]).count() == 2
    assert sorted(Invoice.objects.values_list("subtotal", flat=True)) == [1000, 1300]


def test_the_database_refuses_a_second_line_for_one_item(book, tenant):
    (first, _), item = _two_subscriptions_of_one_customer(book, tenant)
    _ = first
    invoice = Invoice.objects.create(
        tenant=tenant,
        livemode=False,
        customer_id=item.customer_id,
        currency="usd",
        period_start=item.period_start,
        period_end=item.period_end,
        billing_reason=Invoice.MANUAL,
    )
    line = dict(invoice=invoice, description="", amount=300, currency="usd", period_start=item.period_start)
    InvoiceLineItem.objects.create(invoice_item=item, period_end=item.period_end, **line)
    with pytest.raises(IntegrityError), transaction.atomic():
        InvoiceLineItem.objects.create(invoice_item=item, period_end=item.period_end, **line)
    InvoiceLineItem.objects.all().delete()
    invoice.delete()
