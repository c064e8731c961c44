"""Creating customers and subscriptions, trials, anchors, test clocks, cancellation, and their events."""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from billing.models import Subscription, TestClock
from outbox.models import Event
from tests.api.conftest import create_catalog


def parse(value):
    return datetime.fromisoformat(value)


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@pytest.fixture
def customer_and_price(api):
    _, customer = api.post("/v1/customers", {"email": "a@example.com", "metadata": {"crm": "42"}})
    _, price = api.post("/v1/prices", {"amount": 2500, "currency": "usd", "interval": "month"})
    return customer, price


def test_customer_create_returns_every_field(api):
    status, body = api.post(
        "/v1/customers",
        {
            "email": "ada@example.com",
            "name": "Ada",
            "external_id": "crm-1",
            "default_payment_method": "pm_card_visa",
            "metadata": {"plan": "gold"},
        },
    )
    assert status == 201
    assert body["id"].startswith("cus_")
    assert (body["email"], body["name"], body["external_id"]) == ("ada@example.com", "Ada", "crm-1")
    assert body["default_payment_method"] == "pm_card_visa"
    assert body["metadata"] == {"plan": "gold"}
    assert body["created"].endswith("Z")
    event = Event.objects.get(type="customer.created")
    assert event.data == body


def test_subscription_defaults_anchor_to_the_database_now(api, customer_and_price):
    customer, price = customer_and_price
    before = db_now()
    status, body = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    after = db_now()
    assert status == 201
    anchor = parse(body["billing_cycle_anchor"])
    assert before <= anchor <= after
    assert body["next_billing_at"] == body["billing_cycle_anchor"]
    assert body["status"] == "active"
    assert body["current_period_start"] is None  # the first period is invoiced by the next drain
    assert Event.objects.get(type="subscription.created").data == body


def test_trial_period_days_moves_first_billing_to_trial_end(api, customer_and_price):
    customer, price = customer_and_price
    status, body = api.post(
        "/v1/subscriptions", {"customer": customer["id"], "price": price["id"], "trial_period_days": 14}
    )
    assert status == 201
    assert body["status"] == "trialing"
    trial_end = parse(body["trial_end"])
    assert parse(body["current_period_end"]) == trial_end
    assert parse(body["current_period_start"]) == trial_end - timedelta(days=14)
    assert body["next_billing_at"] == body["trial_end"] == body["billing_cycle_anchor"]


def test_explicit_anchor_within_one_interval_is_kept(api, customer_and_price):
    customer, price = customer_and_price
    anchor = (db_now() + timedelta(days=10)).replace(microsecond=0)
    status, body = api.post(
        "/v1/subscriptions",
        {"customer": customer["id"], "price": price["id"], "billing_cycle_anchor": anchor.isoformat()},
    )
    assert status == 201
    assert parse(body["billing_cycle_anchor"]) == anchor
    assert parse(body["next_billing_at"]) == anchor


def test_anchor_offset_is_normalised_to_utc(api, customer_and_price):
    customer, price = customer_and_price
    local = (db_now() + timedelta(days=1)).astimezone(UTC).replace(microsecond=0)
    sent = local.astimezone(datetime.strptime("+0530", "%z").tzinfo).isoformat()
    _, body = api.post(
        "/v1/subscriptions", {"customer": customer["id"], "price": price["id"], "billing_cycle_anchor": sent}
    )
    assert body["billing_cycle_anchor"] == local.isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"billing_cycle_anchor": "2001-01-01T00:00:00Z"}, "billing_cycle_anchor_out_of_range", "billing_cycle_anchor"),
        ({"billing_cycle_anchor": "2099-01-01T00:00:00Z"}, "billing_cycle_anchor_out_of_range", "billing_cycle_anchor"),
        ({"billing_cycle_anchor": "2027-01-01T00:00:00"}, "parameter_invalid", "billing_cycle_anchor"),
        ({"billing_cycle_anchor": "9999-12-31T23:00:00-05:00"}, "date_out_of_range", "billing_cycle_anchor"),
        ({"trial_period_days": 3, "trial_end": "2099-01-01T00:00:00Z"}, "trial_conflict", "trial_period_days"),
        ({"trial_end": "2001-01-01T00:00:00Z"}, "trial_end_out_of_range", "trial_end"),
        ({"trial_period_days": 731}, "parameter_out_of_range", "trial_period_days"),
        ({"trial_period_days": 5, "billing_cycle_anchor": "2099-01-01T00:00:00Z"}, "trial_conflict", None),
    ],
)
def test_bad_anchor_and_trial_combinations_are_422(api, customer_and_price, extra, code, param):
    customer, price = customer_and_price
    status, body = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"], **extra})
    assert status == 422, body
    assert body["error"]["code"] == code
    if param:
        assert body["error"]["param"] == param
    assert not Subscription.objects.exists()


def test_inactive_price_is_refused(api, customer_and_price):
    customer, _ = customer_and_price
    _, price = api.post("/v1/prices", {"amount": 1, "currency": "usd", "interval": "day", "active": False})
    status, body = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    assert (status, body["error"]["code"]) == (422, "price_inactive")


def test_customer_on_a_test_clock_pins_its_subscriptions_to_the_clock_time(api, acme):
    frozen = datetime(2027, 1, 31, 9, 30, tzinfo=UTC)
    clock = TestClock.objects.create(tenant=acme.tenant, livemode=False, frozen_time=frozen)
    status, customer = api.post("/v1/customers", {"email": "clock@example.com", "test_clock": clock.id})
    assert status == 201
    assert customer["test_clock"] == clock.id
    _, price = api.post("/v1/prices", {"amount": 100, "currency": "usd", "interval": "month"})
    status, body = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    assert status == 201
    assert body["test_clock"] == clock.id
    assert body["billing_cycle_anchor"] == body["next_billing_at"] == "2027-01-31T09:30:00Z"
    assert Event.objects.get(type="subscription.created").created_at == frozen


def test_test_clocks_are_refused_in_live_mode(live_api, acme):
    clock = TestClock.objects.create(tenant=acme.tenant, livemode=False, frozen_time=datetime(2027, 1, 1, tzinfo=UTC))
    status, body = live_api.post("/v1/customers", {"email": "x@example.com", "test_clock": clock.id})
    assert (status, body["error"]["code"], body["error"]["param"]) == (422, "test_mode_only", "test_clock")


def test_another_tenants_test_clock_is_404(other_api, acme):
    clock = TestClock.objects.create(tenant=acme.tenant, livemode=False, frozen_time=datetime(2027, 1, 1, tzinfo=UTC))
    status, body = other_api.post("/v1/customers", {"email": "x@example.com", "test_clock": clock.id})
    assert (status, body["error"]["param"]) == (404, "test_clock")


def test_cancel_now_ends_the_subscription(api):
    subscription = create_catalog(api)["subscription"]
    status, body = api.post(f"/v1/subscriptions/{subscription['id']}/cancel", {})
    assert status == 200
    assert body["status"] == "canceled"
    assert body["canceled_at"] == body["ended_at"] is not None
    assert body["next_billing_at"] is None
    event = Event.objects.get(type="subscription.canceled")
    assert event.data == body


def test_cancel_at_period_end_only_sets_the_flag(api):
    subscription = create_catalog(api)["subscription"]
    path = f"/v1/subscriptions/{subscription['id']}/cancel"
    status, body = api.post(path, {"at_period_end": True})
    assert status == 200
    assert (body["status"], body["cancel_at_period_end"], body["ended_at"]) == ("active", True, None)
    assert body["next_billing_at"] == subscription["next_billing_at"]
    assert Event.objects.filter(type="subscription.updated").count() == 1
    # Asking again changes nothing and emits nothing.
    assert api.post(path, {"at_period_end": True})[1] == body
    assert Event.objects.filter(type="subscription.updated").count() == 1


def test_cancel_at_period_end_on_update_schedules_and_withdraws_the_cancellation(api):
    subscription = create_catalog(api)["subscription"]
    path = f"/v1/subscriptions/{subscription['id']}"

    status, body = api.post(path, {"cancel_at_period_end": True})
    assert status == 200, body
    assert (body["status"], body["cancel_at_period_end"], body["ended_at"]) == ("active", True, None)
    canceled_at = body["canceled_at"]
    assert canceled_at is not None
    assert api.post(path, {"cancel_at_period_end": True}) == (200, body)  # already so: nothing emitted

    status, body = api.post(path, {"cancel_at_period_end": False})
    assert status == 200, body
    assert (body["status"], body["cancel_at_period_end"], body["canceled_at"]) == ("active", False, None)
    assert body["next_billing_at"] == subscription["next_billing_at"]
    assert api.post(path, {"cancel_at_period_end": False}) == (200, body)

    updated = Event.objects.filter(type="subscription.updated").order_by("created_at", "id")
    assert [e.data["previous_attributes"] for e in updated] == [
        {"cancel_at_period_end": False, "canceled_at": None},
        {"cancel_at_period_end": True, "canceled_at": canceled_at},
    ]
    assert updated.last().data["cancel_at_period_end"] is False


def test_the_cancel_endpoints_at_period_end_is_withdrawn_by_the_update_and_false_cancels_now(api):
    # The cancel endpoint is Stripe's DELETE /v1/subscriptions/{id}: without at_period_end (or with false) it
    # cancels now, even one set to cancel at its period end; undoing a scheduled cancellation is the update's.
    subscription = create_catalog(api)["subscription"]
    cancel = f"/v1/subscriptions/{subscription['id']}/cancel"
    assert api.post(cancel, {"at_period_end": True})[1]["cancel_at_period_end"] is True
    status, body = api.post(f"/v1/subscriptions/{subscription['id']}", {"cancel_at_period_end": False})
    assert (status, body["cancel_at_period_end"], body["canceled_at"]) == (200, False, None)
    assert api.post(cancel, {"at_period_end": True})[1]["cancel_at_period_end"] is True

    status, body = api.post(cancel, {"at_period_end": False})

    assert (status, body["status"]) == (200, "canceled")
    assert body["ended_at"] is not None and body["next_billing_at"] is None
    status, body = api.post(f"/v1/subscriptions/{subscription['id']}", {"cancel_at_period_end": False})
    assert (status, body["error"]["code"]) == (409, "subscription_canceled")


@pytest.mark.parametrize(
    "other",
    [
        {"items": [{"price": "PRICE", "quantity": 2}]},
        {"pause_collection": {"behavior": "void"}},
        {"billing_cycle_anchor": "now"},
        {"proration_date": 1},
        {"effective_at": "period_end"},
        {"discounts": []},
    ],
)
def test_cancel_at_period_end_with_another_change_is_a_422_and_changes_nothing(api, other):
    catalog = create_catalog(api)
    subscription = catalog["subscription"]
    if "items" in other:
        other = {"items": [{"price": catalog["price"]["id"], "quantity": 2}]}

    status, body = api.post(f"/v1/subscriptions/{subscription['id']}", {"cancel_at_period_end": True, **other})

    assert (status, body["error"]["code"], body["error"]["param"]) == (
        422,
        "cancel_with_changes",
        "cancel_at_period_end",
    )
    row = Subscription.objects.get(pk=subscription["id"])
    assert (row.cancel_at_period_end, row.canceled_at, row.pause_collection_behavior) == (False, None, "")
    assert not Event.objects.filter(type="subscription.updated").exists()


def test_cancelling_a_canceled_subscription_is_409(api):
    subscription = create_catalog(api)["subscription"]
    path = f"/v1/subscriptions/{subscription['id']}/cancel"
    api.post(path)
    status, body = api.post(path)
    assert (status, body["error"]["code"]) == (409, "subscription_canceled")
    assert Event.objects.filter(type="subscription.canceled").count() == 1


def test_subscription_list_filters_by_customer_and_status(api):
    first = create_catalog(api)
    second = create_catalog(api)
    api.post(f"/v1/subscriptions/{second['subscription']['id']}/cancel")
    _, body = api.get("/v1/subscriptions", {"customer": first["customer"]["id"]})
    assert [row["id"] for row in body["data"]] == [first["subscription"]["id"]]
    _, body = api.get("/v1/subscriptions", {"status": "canceled"})
    assert [row["id"] for row in body["data"]] == [second["subscription"]["id"]]


def test_invoice_get_and_list_filters(api):
    from tests.api.conftest import create_invoice

    catalog = create_catalog(api)
    paid = create_invoice(catalog["subscription"]["id"], status="paid")
    status, body = api.get(f"/v1/invoices/{paid.id}")
    assert status == 200
    assert (body["status"], body["total"], body["currency"]) == ("paid", 1000, "usd")
    assert [line["amount"] for line in body["lines"]] == [1000]
    assert [row["id"] for row in api.get("/v1/invoices", {"status": "paid"})[1]["data"]] == [paid.id]
    assert api.get("/v1/invoices", {"status": "open"})[1]["data"] == []
    assert [row["id"] for row in api.get("/v1/invoices", {"customer": catalog["customer"]["id"]})[1]["data"]] == [
        paid.id
    ]


def test_subscription_list_filters_by_billing_state(api):
    ok, waiting, parked = (create_catalog(api)["subscription"]["id"] for _ in range(3))
    now = db_now()
    Subscription.objects.filter(pk=waiting).update(
        billing_failure_count=1, next_billing_attempt_at=now + timedelta(minutes=15)
    )
    # A parked subscription keeps its last ladder time: parked must still win, as in billing_state.
    Subscription.objects.filter(pk=parked).update(
        billing_failure_count=8, next_billing_attempt_at=now, billing_parked_at=now
    )
    for state, expected in (("ok", ok), ("waiting", waiting), ("parked", parked)):
        status, body = api.get("/v1/subscriptions", {"billing_state": state})
        assert status == 200
        assert [row["id"] for row in body["data"]] == [expected]
        assert body["data"][0]["billing_state"] == state
    status, body = api.get("/v1/subscriptions", {"billing_state": "failing"})
    assert (status, body["error"]["param"]) == (422, "billing_state")


def test_subscription_list_documents_its_filters(api):
    _, schema = api.get("/v1/openapi.json")
    params = {p["name"]: p for p in schema["paths"]["/v1/subscriptions"]["get"]["parameters"]}
    assert params["billing_state"]["schema"]["enum"] == ["ok", "waiting", "parked", "paused"]
    assert "status" in params
