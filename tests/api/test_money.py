"""Amounts are integer minor units of their currency's ISO 4217 exponent: JPY has none, USD two, KWD three."""

import pytest

from billing.models import Customer, Price
from hardcount.money import format_amount


def test_jpy_price_of_1000_is_1000_yen_stored_unscaled(api):
    status, body = api.post("/v1/prices", {"amount": 1000, "currency": "jpy", "interval": "month"})
    assert status == 201
    assert (body["amount"], body["currency"]) == (1000, "jpy")
    price = Price.objects.get(pk=body["id"])
    assert price.amount == 1000
    assert format_amount(price.amount, price.currency) == "1000 JPY"


def test_usd_price_of_1000_is_ten_dollars(api):
    status, body = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})
    assert status == 201
    price = Price.objects.get(pk=body["id"])
    assert price.amount == 1000
    assert format_amount(price.amount, price.currency) == "10.00 USD"


def test_kwd_has_three_decimals(api):
    status, body = api.post("/v1/prices", {"amount": 1500, "currency": "kwd", "interval": "year"})
    assert status == 201
    assert format_amount(Price.objects.get(pk=body["id"]).amount, "kwd") == "1.500 KWD"


def test_first_subscription_fixes_the_customers_currency(api):
    _, customer = api.post("/v1/customers", {"email": "yen@example.com"})
    assert customer["currency"] is None
    _, price = api.post("/v1/prices", {"amount": 1000, "currency": "jpy", "interval": "month"})
    assert api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})[0] == 201
    assert api.get(f"/v1/customers/{customer['id']}")[1]["currency"] == "jpy"


@pytest.mark.parametrize(("first", "second"), [("jpy", "usd"), ("usd", "eur")])
def test_subscription_in_another_currency_than_the_customers_is_422(api, first, second):
    _, customer = api.post("/v1/customers", {"email": "c@example.com"})
    _, price_a = api.post("/v1/prices", {"amount": 1000, "currency": first, "interval": "month"})
    _, price_b = api.post("/v1/prices", {"amount": 1000, "currency": second, "interval": "month"})
    assert api.post("/v1/subscriptions", {"customer": customer["id"], "price": price_a["id"]})[0] == 201
    status, body = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price_b["id"]})
    assert (status, body["error"]["code"], body["error"]["param"]) == (422, "currency_mismatch", "price")
    assert Customer.objects.get(pk=customer["id"]).currency == first
