"""The coupons API and discounts on customers and subscriptions: Stripe's shapes, 4xx for bad input (nothing
changed), tenant and mode scoping, and the events (docs/reference/discounts.md)."""

from __future__ import annotations

import pytest

from billing import representations
from billing import serializers as out
from billing.models import Coupon, Customer, Discount, Subscription
from outbox.models import Event


def _types() -> list[str]:
    return list(Event.objects.filter(type__contains="coupon").order_by("sequence").values_list("type", flat=True)) + [
        t for t in Event.objects.order_by("sequence").values_list("type", flat=True) if t.startswith("customer.disc")
    ]


def test_a_percent_coupon_is_created_in_stripes_shape_and_emits_coupon_created(api):
    status, coupon = api.post(
        "/v1/coupons",
        {"percent_off": 25.5, "duration": "repeating", "duration_in_months": 3, "name": "Spring", "max_redemptions": 5},
    )

    assert status == 201, coupon
    assert coupon["id"].startswith("co_")
    assert {k: v for k, v in coupon.items() if k not in ("id", "created")} == {
        "object": "coupon",
        "livemode": False,
        "name": "Spring",
        "percent_off": 25.5,
        "amount_off": None,
        "currency": None,
        "duration": "repeating",
        "duration_in_months": 3,
        "max_redemptions": 5,
        "redeem_by": None,
        "times_redeemed": 0,
        "valid": True,
        "metadata": {},
    }
    assert [e.data["id"] for e in Event.objects.filter(type="coupon.created")] == [coupon["id"]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"percent_off": 10, "amount_off": 100, "currency": "usd"}, "percent_off"),
        ({}, "percent_off"),
        ({"percent_off": 0}, "percent_off"),
        ({"percent_off": 100.01}, "percent_off"),
        ({"percent_off": 12.345}, "percent_off"),
        ({"percent_off": "25"}, "percent_off"),
        ({"percent_off": True}, "percent_off"),
        ({"amount_off": 100}, "currency"),
        ({"amount_off": 0, "currency": "usd"}, "amount_off"),
        ({"amount_off": 1.5, "currency": "usd"}, "amount_off"),
        ({"percent_off": 10, "currency": "usd"}, "currency"),
        ({"percent_off": 10, "duration": "repeating"}, "duration_in_months"),
        ({"percent_off": 10, "duration": "forever", "duration_in_months": 3}, "duration_in_months"),
        ({"percent_off": 10, "duration": "weekly"}, "duration"),
        ({"percent_off": 10, "redeem_by": "2001-01-01T00:00:00Z"}, "redeem_by"),
        ({"percent_off": 10, "id": "SUMMER"}, "id"),
    ],
)
def test_bad_coupon_terms_are_a_422_naming_the_field_and_create_nothing(api, body, param):
    status, error = api.post("/v1/coupons", body)

    assert status == 422, error
    assert error["error"]["param"] == param
    assert not Coupon.objects.exists() and not Event.objects.filter(type="coupon.created").exists()


def test_coupons_are_listed_retrieved_and_deleted_in_their_own_tenant_and_mode_only(api, live_api, other_api):
    _, first = api.post("/v1/coupons", {"percent_off": 10})
    _, second = api.post("/v1/coupons", {"amount_off": 500, "currency": "jpy", "duration": "once"})

    status, listed = api.get("/v1/coupons")
    assert status == 200 and [c["id"] for c in listed["data"]] == [second["id"], first["id"]]
    assert api.get(f"/v1/coupons/{first['id']}") == (200, first)
    assert other_api.get(f"/v1/coupons/{first['id']}")[0] == 404
    assert live_api.get(f"/v1/coupons/{first['id']}")[0] == 404
    assert other_api.delete(f"/v1/coupons/{first['id']}")[0] == 404

    assert api.delete(f"/v1/coupons/{first['id']}") == (200, {"id": first["id"], "object": "coupon", "deleted": True})
    assert api.get(f"/v1/coupons/{first['id']}")[0] == 404
    assert api.delete(f"/v1/coupons/{first['id']}")[0] == 404
    assert [c["id"] for c in api.get("/v1/coupons")[1]["data"]] == [second["id"]]
    assert _types() == ["coupon.created", "coupon.created", "coupon.deleted"]


def test_a_coupon_on_customer_create_becomes_its_discount_and_is_deleted_by_delete_discount(api):
    _, coupon = api.post("/v1/coupons", {"percent_off": 20, "max_redemptions": 1})
    status, customer = api.post("/v1/customers", {"email": "a@example.com", "coupon": coupon["id"]})

    assert status == 201, customer
    discount = customer["discount"]
    assert discount["object"] == "discount" and discount["id"].startswith("di_")
    assert (discount["customer"], discount["subscription"], discount["end"]) == (customer["id"], None, None)
    assert discount["coupon"]["times_redeemed"] == 1 and discount["coupon"]["valid"] is False  # used up
    # Used up: the next redemption is refused, and that customer is not created.
    status, error = api.post("/v1/customers", {"email": "b@example.com", "discounts": [{"coupon": coupon["id"]}]})
    assert (status, error["error"]["code"]) == (422, "coupon_exhausted")
    assert Customer.objects.count() == 1

    status, deleted = api.delete(f"/v1/customers/{customer['id']}/discount")
    assert status == 200 and deleted["deleted"] is True and deleted["id"] == discount["id"]
    assert api.get(f"/v1/customers/{customer['id']}")[1]["discount"] is None
    assert api.delete(f"/v1/customers/{customer['id']}/discount")[0] == 404
    assert _types() == ["coupon.created", "customer.discount.created", "customer.discount.deleted"]


def test_discounts_on_a_subscription_are_set_replaced_and_removed_through_create_and_update(api):
    _, ten = api.post("/v1/coupons", {"percent_off": 10})
    _, five = api.post("/v1/coupons", {"amount_off": 500, "currency": "usd"})
    _, customer = api.post("/v1/customers", {"email": "a@example.com"})
    _, price = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})

    status, sub = api.post(
        "/v1/subscriptions", {"customer": customer["id"], "price": price["id"], "discounts": [{"coupon": ten["id"]}]}
    )
    assert status == 201, sub
    assert sub["discount"]["coupon"]["id"] == ten["id"] and sub["discounts"] == [sub["discount"]["id"]]
    assert sub["discount"]["subscription"] == sub["id"]

    status, replaced = api.post(f"/v1/subscriptions/{sub['id']}", {"coupon": five["id"]})
    assert status == 200, replaced
    assert replaced["discount"]["coupon"]["id"] == five["id"]
    status, removed = api.post(f"/v1/subscriptions/{sub['id']}", {"discounts": []})
    assert status == 200 and removed["discount"] is None and removed["discounts"] == []
    assert Discount.objects.filter(subscription_id=sub["id"], deleted_at__isnull=True).count() == 0
    assert api.delete(f"/v1/subscriptions/{sub['id']}/discount")[0] == 404


def test_bad_discount_requests_are_refused_and_change_nothing(api, other_api):
    _, eur = api.post("/v1/coupons", {"amount_off": 500, "currency": "eur"})
    _, customer = api.post("/v1/customers", {"email": "a@example.com"})
    _, price = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})
    _, foreign = other_api.post("/v1/coupons", {"percent_off": 10})

    status, error = api.post(
        "/v1/subscriptions", {"customer": customer["id"], "price": price["id"], "coupon": eur["id"]}
    )
    assert (status, error["error"]["code"]) == (422, "coupon_currency_mismatch")
    status, error = api.post(
        "/v1/subscriptions", {"customer": customer["id"], "price": price["id"], "coupon": foreign["id"]}
    )
    assert (status, error["error"]["param"]) == (404, "coupon")
    both = {"customer": customer["id"], "price": price["id"], "coupon": eur["id"], "discounts": []}
    assert api.post("/v1/subscriptions", both)[1]["error"]["code"] == "coupon_or_discounts"
    two = [{"coupon": eur["id"]}, {"coupon": eur["id"]}]
    assert api.post(f"/v1/customers/{customer['id']}", {"discounts": two})[0] == 422
    assert api.post(f"/v1/customers/{customer['id']}", {"coupon": "SUMMER"})[0] == 422
    assert not Subscription.objects.exists()
    assert not Discount.objects.exists()
    assert Coupon.objects.get(pk=eur["id"]).times_redeemed == 0


def test_output_schemas_of_coupons_and_discounts_match_the_representations(api):
    _, coupon = api.post("/v1/coupons", {"percent_off": 10})
    _, customer = api.post("/v1/customers", {"email": "a@example.com", "coupon": coupon["id"]})
    discount = Discount.objects.get()

    assert set(out.Coupon().fields) == set(representations.coupon_data(Coupon.objects.get()))
    assert set(out.Discount().fields) == set(representations.discount_data(discount))
    assert set(out.DeletedDiscount().fields) == set(api.delete(f"/v1/customers/{customer['id']}/discount")[1])
    assert set(out.DeletedCoupon().fields) == set(api.delete(f"/v1/coupons/{coupon['id']}")[1])


def test_a_discount_with_a_change_of_items_is_one_transaction_refused_whole(api):
    _, coupon = api.post("/v1/coupons", {"percent_off": 10})
    _, customer = api.post("/v1/customers", {"email": "a@example.com"})
    _, price = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})
    _, yearly = api.post("/v1/prices", {"amount": 9000, "currency": "usd", "interval": "year"})
    _, sub = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    item = sub["items"]["data"][0]["id"]

    # Another billing interval is refused: the coupon in the same body is not redeemed either.
    status, error = api.post(
        f"/v1/subscriptions/{sub['id']}", {"coupon": coupon["id"], "items": [{"id": item, "price": yearly["id"]}]}
    )
    assert status == 422, error
    assert Coupon.objects.get(pk=coupon["id"]).times_redeemed == 0 and not Discount.objects.exists()
    pause = {"coupon": coupon["id"], "pause_collection": {"behavior": "void"}}
    assert api.post(f"/v1/subscriptions/{sub['id']}", pause)[1]["error"]["code"] == "pause_with_discount"

    status, changed = api.post(
        f"/v1/subscriptions/{sub['id']}", {"coupon": coupon["id"], "items": [{"id": item, "quantity": 2}]}
    )
    assert status == 200, changed
    assert changed["discount"]["coupon"]["id"] == coupon["id"] and changed["items"]["data"][0]["quantity"] == 2


@pytest.mark.parametrize(
    ("field", "param"), [("coupon", "coupon"), ("discounts", "discounts[0][coupon]")], ids=["coupon", "discounts"]
)
def test_an_amount_off_coupon_in_another_currency_is_refused_naming_the_field_the_body_used(api, field, param):
    _, eur = api.post("/v1/coupons", {"amount_off": 500, "currency": "eur"})
    _, usd = api.post("/v1/coupons", {"amount_off": 500, "currency": "usd"})
    _, customer = api.post("/v1/customers", {"email": "a@example.com"})
    _, price = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})
    _, sub = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    item = sub["items"]["data"][0]["id"]

    def body(coupon_id: str) -> dict:
        return {"coupon": coupon_id} if field == "coupon" else {"discounts": [{"coupon": coupon_id}]}

    # The customer is billed in usd (its subscription's currency) and the subscription is usd: eur is refused on
    # either, on a new subscription, and with a change of items, each naming the body's field.
    requests = [
        (f"/v1/customers/{customer['id']}", body(eur["id"])),
        (f"/v1/subscriptions/{sub['id']}", body(eur["id"])),
        (f"/v1/subscriptions/{sub['id']}", {**body(eur["id"]), "items": [{"id": item, "quantity": 2}]}),
        ("/v1/subscriptions", {"customer": customer["id"], "price": price["id"], **body(eur["id"])}),
    ]
    for path, request in requests:
        status, error = api.post(path, request)
        assert (status, error["error"]["code"], error["error"]["param"]) == (422, "coupon_currency_mismatch", param)
    assert Coupon.objects.get(pk=eur["id"]).times_redeemed == 0 and not Discount.objects.exists()
    assert Subscription.objects.count() == 1 and sub["items"]["data"][0]["quantity"] == 1
    assert api.get(f"/v1/subscriptions/{sub['id']}")[1]["items"]["data"][0]["quantity"] == 1
    # A coupon that is not there (deleted) is named the same way.
    _, gone = api.post("/v1/coupons", {"percent_off": 10})
    api.delete(f"/v1/coupons/{gone['id']}")
    status, error = api.post(f"/v1/customers/{customer['id']}", body(gone["id"]))
    assert (status, error["error"]["param"]) == (404, param)

    # Negative control: the same requests with the usd coupon are accepted.
    status, updated = api.post(f"/v1/customers/{customer['id']}", body(usd["id"]))
    assert (status, updated["discount"]["coupon"]["id"]) == (200, usd["id"])
    status, updated = api.post(f"/v1/subscriptions/{sub['id']}", body(usd["id"]))
    assert (status, updated["discount"]["coupon"]["id"]) == (200, usd["id"])


def test_a_customer_without_a_currency_takes_any_coupon_which_then_decides_its_subscriptions_currency(api):
    _, eur = api.post("/v1/coupons", {"amount_off": 500, "currency": "eur"})
    _, usd_price = api.post("/v1/prices", {"amount": 1000, "currency": "usd", "interval": "month"})
    _, eur_price = api.post("/v1/prices", {"amount": 1000, "currency": "eur", "interval": "month"})
    status, customer = api.post("/v1/customers", {"email": "a@example.com", "discounts": [{"coupon": eur["id"]}]})
    assert (status, customer["discount"]["coupon"]["id"]) == (201, eur["id"])

    for request, param in (({"price": usd_price["id"]}, "price"), ({"items": [{"price": usd_price["id"]}]}, "items")):
        status, error = api.post("/v1/subscriptions", {"customer": customer["id"], **request})
        assert (status, error["error"]["code"], error["error"]["param"]) == (422, "coupon_currency_mismatch", param)
    assert not Subscription.objects.exists() and Customer.objects.get(pk=customer["id"]).currency == ""

    status, sub = api.post("/v1/subscriptions", {"customer": customer["id"], "price": eur_price["id"]})
    assert status == 201, sub
    # Negative control: without the discount a usd subscription would be refused for the customer's currency
    # (eur, set by its first subscription), not for the coupon.
    assert api.delete(f"/v1/customers/{customer['id']}/discount")[0] == 200
    status, error = api.post("/v1/subscriptions", {"customer": customer["id"], "price": usd_price["id"]})
    assert (status, error["error"]["code"]) == (422, "currency_mismatch")
