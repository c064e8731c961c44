"""Subscription items: created through the API, billed one line per item by both close paths."""

import importlib

import pytest
from django.db import connection

from billing.models import Invoice, Subscription, SubscriptionItem
from billing.services.drain import drain_due
from tests.api.conftest import Api, make_keys


@pytest.fixture
def acme(book):
    return make_keys("Acme")


def _drain(tenant):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


@pytest.mark.parametrize("page_close", ["1", "0"])
def test_a_multi_item_subscription_is_billed_one_line_per_item(book, acme, settings, stripe_proxy, page_close):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page_close == "1"
    customer = book.customer(acme.tenant)
    seat = book.price(acme.tenant, amount=1200)
    base = book.price(acme.tenant, amount=4900)
    api = Api(acme.test)

    status, sub = api.post(
        "/v1/subscriptions",
        {"customer": customer.id, "items": [{"price": base.id}, {"price": seat.id, "quantity": 3}]},
    )
    assert status == 201, sub
    assert sub["items"]["object"] == "list"
    assert [(i["object"], i["price"]["id"], i["quantity"]) for i in sub["items"]["data"]] == [
        ("subscription_item", base.id, 1),
        ("subscription_item", seat.id, 3),
    ]
    assert all(i["id"].startswith("si_") for i in sub["items"]["data"])
    assert sub["price"] == base.id

    _drain(acme.tenant)

    invoice = Invoice.objects.get(subscription_id=sub["id"])
    lines = list(invoice.lines.all())
    assert [(line.price_id, line.quantity, line.amount) for line in lines] == [(base.id, 1, 4900), (seat.id, 3, 3600)]
    assert [line.subscription_item for line in lines] == [i["id"] for i in sub["items"]["data"]]
    assert (invoice.subtotal, invoice.total, invoice.amount_due, invoice.amount_paid, invoice.status) == (
        8500,
        8500,
        8500,
        8500,
        "paid",
    )
    assert lines[1].description.startswith("3 × ")
    assert stripe_proxy.entries("POST /v1/payment_intents")[0].request.params["amount"] == "8500"
    status, shown = api.get(f"/v1/invoices/{invoice.id}")
    assert [line["subscription_item"] for line in shown["lines"]] == [i["id"] for i in sub["items"]["data"]]


@pytest.mark.parametrize(
    ("other", "detail"),
    [({"currency": "eur"}, "eur"), ({"interval": "year"}, "year")],
)
def test_items_of_another_currency_or_interval_are_refused_naming_the_item(book, acme, other, detail):
    customer = book.customer(acme.tenant)
    base = book.price(acme.tenant, amount=4900)
    odd = book.price(acme.tenant, amount=100, **other)
    before = (Subscription.objects.count(), SubscriptionItem.objects.count())

    status, body = Api(acme.test).post(
        "/v1/subscriptions", {"customer": customer.id, "items": [{"price": base.id}, {"price": odd.id}]}
    )

    assert status == 422, body
    assert (body["error"]["code"], body["error"]["param"]) == ("item_mismatch", "items[1]")
    assert detail in body["error"]["message"]
    assert (Subscription.objects.count(), SubscriptionItem.objects.count()) == before


def test_price_and_items_together_or_a_repeated_price_are_refused(book, acme):
    customer = book.customer(acme.tenant)
    base = book.price(acme.tenant)
    api = Api(acme.test)

    status, body = api.post(
        "/v1/subscriptions", {"customer": customer.id, "price": base.id, "items": [{"price": base.id}]}
    )
    assert (status, body["error"]["code"]) == (422, "price_or_items")
    status, body = api.post("/v1/subscriptions", {"customer": customer.id, "items": [{"price": base.id}] * 2})
    assert (status, body["error"]["code"], body["error"]["param"]) == (422, "item_duplicate_price", "items[1]")
    status, body = api.post(
        "/v1/subscriptions", {"customer": customer.id, "items": [{"price": base.id, "quantity": 0}]}
    )
    assert status == 400 or status == 422, body
    assert not Subscription.objects.exists()


def test_the_price_shorthand_makes_one_item_of_quantity_one(book, acme):
    customer = book.customer(acme.tenant)
    base = book.price(acme.tenant)

    status, sub = Api(acme.test).post("/v1/subscriptions", {"customer": customer.id, "price": base.id})

    assert status == 201, sub
    assert [(i["price"]["id"], i["quantity"]) for i in sub["items"]["data"]] == [(base.id, 1)]


def test_the_migration_gives_every_subscription_without_items_one_item(book, tenant):
    sub = book.subscribed(tenant)
    SubscriptionItem.objects.filter(subscription=sub).delete()
    migration = importlib.import_module("billing.migrations.0010_items_backfill_and_row_level_security")

    with connection.cursor() as cursor:
        cursor.execute(migration._BACKFILL)
        cursor.execute(migration._BACKFILL)  # idempotent

    (item,) = SubscriptionItem.objects.filter(subscription=sub)
    assert (item.price_id, item.quantity, item.tenant_id, item.livemode) == (sub.price_id, 1, tenant.id, False)
    assert item.id.startswith("si_") and len(item.id) == 29
