"""The test-clock API: create, retrieve, list, delete, advance; test mode only; bad input changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from billing.models import BillingRun, Invoice, TestClock
from billing.services.clocks import wait_for_advances
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events


@pytest.fixture
def acme(db):
    return make_keys("Acme")


@pytest.fixture
def api(acme) -> Api:
    """Acme's test-mode api."""
    return Api(acme.test)


@pytest.fixture
def live_api(acme) -> Api:
    """Acme's live-mode api."""
    return Api(acme.live)


@pytest.fixture
def other_api(db) -> Api:
    """Globex's test-mode api."""
    return Api(make_keys("Globex").test)


def _create(api, **body):
    return api.post("/v1/test_clocks", {"frozen_time": "2027-01-31T09:30:00Z", **body})


def test_creating_a_clock_answers_it_ready_at_its_time_and_emits_test_clock_created(api):
    status, clock = _create(api, name="January", frozen_time="2027-01-31T10:30:00+01:00")

    assert status == 201
    assert {k: v for k, v in clock.items() if k not in ("id", "created")} == {
        "object": "test_clock",
        "livemode": False,
        "name": "January",
        "frozen_time": "2027-01-31T09:30:00Z",
        "status": "ready",
        "advance_target": None,
        "last_failure": None,
    }
    assert clock["id"].startswith("clock_")
    assert [e.data["id"] for e in events("test_clock.created")] == [clock["id"]]


def test_a_live_key_cannot_create_a_clock(live_api):
    status, body = _create(live_api)

    assert (status, body["error"]["code"]) == (422, "test_mode_only")
    assert not TestClock.objects.exists()


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"frozen_time": "2027-01-31T09:30:00"}, None, "frozen_time"),  # no zone: refused, not guessed
        ({"frozen_time": "2200-01-01T00:00:00Z"}, "frozen_time_out_of_range", "frozen_time"),
        ({"frozen_time": "1969-12-31T23:59:59Z"}, "frozen_time_out_of_range", "frozen_time"),
        ({"frozen_time": 1801000000}, None, "frozen_time"),
        ({"name": "x" * 201}, None, "name"),
        ({"speed": "fast"}, "parameter_unknown", "speed"),
    ],
)
def test_bad_input_to_create_is_a_422_and_writes_nothing(api, body, code, param):
    status, answer = api.post("/v1/test_clocks", {"frozen_time": "2027-01-31T09:30:00Z", **body})

    assert (status, answer["error"]["param"]) == (422, param)
    if code is not None:
        assert answer["error"]["code"] == code
    assert not TestClock.objects.exists()


def test_clocks_are_listed_newest_first_and_never_across_tenants_or_modes(api, other_api, live_api):
    _, first = _create(api, name="first")
    _, second = _create(api, name="second")
    _, theirs = _create(other_api)

    status, page = api.get("/v1/test_clocks")
    assert status == 200
    assert [c["id"] for c in page["data"]] == [second["id"], first["id"]]
    assert api.get(f"/v1/test_clocks/{first['id']}") == (200, first)
    assert api.get(f"/v1/test_clocks/{theirs['id']}")[0] == 404
    assert live_api.get(f"/v1/test_clocks/{first['id']}")[0] == 404
    assert live_api.get("/v1/test_clocks")[1]["data"] == []
    assert api.get("/v1/test_clocks/clock_nope")[0] == 404


def test_advance_rules_refuse_a_time_not_later_or_too_far_and_change_nothing(api):
    _, clock = _create(api)
    path = f"/v1/test_clocks/{clock['id']}/advance"

    for frozen_time, code in [
        ("2027-01-31T09:30:00Z", "test_clock_time_not_later"),
        ("2027-01-01T00:00:00Z", "test_clock_time_not_later"),
        ("2032-01-31T09:30:01Z", "test_clock_advance_too_far"),
        ("2200-01-01T00:00:00Z", "frozen_time_out_of_range"),
    ]:
        status, body = api.post(path, {"frozen_time": frozen_time})
        assert (status, body["error"]["code"], body["error"]["param"]) == (422, code, "frozen_time")
    assert api.post(path, {})[0] == 422
    assert api.get(f"/v1/test_clocks/{clock['id']}")[1] == clock


def test_advancing_an_advancing_clock_is_a_409(api):
    # Inside the test's transaction the background walk never starts: the clock stays advancing.
    _, clock = _create(api)
    path = f"/v1/test_clocks/{clock['id']}/advance"

    status, advancing = api.post(path, {"frozen_time": "2027-03-31T09:30:00Z"})
    assert (status, advancing["status"], advancing["advance_target"]) == (200, "advancing", "2027-03-31T09:30:00Z")
    assert advancing["frozen_time"] == "2027-01-31T09:30:00Z"

    status, body = api.post(path, {"frozen_time": "2027-06-30T09:30:00Z"})
    assert (status, body["error"]["code"]) == (409, "test_clock_advancing")
    assert TestClock.objects.get(pk=clock["id"]).advance_target.isoformat() == "2027-03-31T09:30:00+00:00"


def test_another_tenants_clock_cannot_be_advanced_or_deleted(api, other_api):
    _, clock = _create(other_api)

    assert api.post(f"/v1/test_clocks/{clock['id']}/advance", {"frozen_time": "2027-03-01T00:00:00Z"})[0] == 404
    assert api.response("delete", f"/v1/test_clocks/{clock['id']}").status_code == 404
    assert TestClock.objects.get(pk=clock["id"]).status == "ready"


def test_a_clock_with_nothing_attached_is_deleted_and_one_with_a_customer_is_refused(api):
    _, empty = _create(api)
    _, used = _create(api)
    assert api.post("/v1/customers", {"email": "c@example.com", "test_clock": used["id"]})[0] == 201

    response = api.response("delete", f"/v1/test_clocks/{empty['id']}")
    assert (response.status_code, response.json()) == (
        200,
        {"id": empty["id"], "object": "test_clock", "deleted": True},
    )
    assert api.get(f"/v1/test_clocks/{empty['id']}")[0] == 404
    assert [e.data["id"] for e in events("test_clock.deleted")] == [empty["id"]]

    response = api.response("delete", f"/v1/test_clocks/{used['id']}")
    assert (response.status_code, response.json()["error"]["code"]) == (409, "test_clock_in_use")
    assert TestClock.objects.filter(pk=used["id"]).exists()


def test_an_advance_through_the_api_answers_at_once_and_bills_in_the_background(book, tenant):
    from hardcount.models import ApiKey

    _, key = ApiKey.issue(tenant, livemode=False)
    api = Api(key)
    _, clock = _create(api)
    status, customer = api.post(
        "/v1/customers",
        {"email": "c@example.com", "test_clock": clock["id"], "default_payment_method": book_card(book)},
    )
    assert status == 201
    _, price = api.post("/v1/prices", {"amount": 2500, "currency": "usd", "interval": "month"})
    status, sub = api.post("/v1/subscriptions", {"customer": customer["id"], "price": price["id"]})
    assert (status, sub["test_clock"], sub["next_billing_at"]) == (201, clock["id"], "2027-01-31T09:30:00Z")

    status, advancing = api.post(f"/v1/test_clocks/{clock['id']}/advance", {"frozen_time": "2027-04-01T00:00:00Z"})
    assert (status, advancing["status"]) == (200, "advancing")
    assert wait_for_advances(timeout_s=120)

    status, ready = api.get(f"/v1/test_clocks/{clock['id']}")
    assert (status, ready["status"], ready["frozen_time"], ready["advance_target"]) == (
        200,
        "ready",
        "2027-04-01T00:00:00Z",
        None,
    )
    _, invoices = api.get("/v1/invoices", {"subscription": sub["id"]})
    assert [(i["period_start"], i["created"], i["status"]) for i in reversed(invoices["data"])] == [
        ("2027-01-31T09:30:00Z", "2027-01-31T09:30:00Z", "paid"),
        ("2027-02-28T09:30:00Z", "2027-02-28T09:30:00Z", "paid"),
        ("2027-03-31T09:30:00Z", "2027-03-31T09:30:00Z", "paid"),
    ]
    _, runs = api.get("/v1/billing/runs")
    assert [(r["trigger"], r["test_clock"], r["as_of"]) for r in reversed(runs["data"])] == [
        ("test_clock", clock["id"], "2027-01-31T09:30:00Z"),
        ("test_clock", clock["id"], "2027-02-28T09:30:00Z"),
        ("test_clock", clock["id"], "2027-03-31T09:30:00Z"),
    ]
    assert BillingRun.objects.filter(test_clock_id=clock["id"]).count() == 3
    assert Invoice.objects.filter(subscription_id=sub["id"]).count() == 3


def book_card(book) -> str:
    return book._make_card()


def test_a_deleted_clock_leaves_its_event_and_a_book_the_doctor_finds_clean(book, tenant):
    from billing.services.clocks import create_test_clock, delete_test_clock

    clock = create_test_clock(tenant_id=tenant.id, livemode=False, frozen_time=datetime(2027, 1, 1, tzinfo=UTC))
    delete_test_clock(tenant_id=tenant.id, livemode=False, clock_id=clock.id)

    assert not TestClock.objects.filter(pk=clock.id).exists()
    assert [e.data["id"] for e in events("test_clock.deleted")] == [clock.id]
    # The book fixture's doctor sweep runs after this test: a *.deleted event names no live object.
