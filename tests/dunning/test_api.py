"""Dunning over HTTP: /v1/dunning_settings, /v1/dunning_runs, POST /v1/customers/{id}, the admin, and the role."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from billing.models import Customer
from billing.services.dunning_pass import process_due
from dunning import api as dunning_api
from dunning.models import DunningRun, DunningSettings
from dunning.representations import dunning_run_data, dunning_settings_data
from dunning.services import get_settings
from hardcount.models import ApiKey
from tests.api.conftest import Api, make_keys
from tests.dunning.conftest import DECLINING_CARD, decline, events


@pytest.fixture
def keys(db):
    return make_keys("Acme")


# --- settings ---------------------------------------------------------------------------------------------------------


def test_settings_default_to_1_3_5_7_days_then_unpaid_and_change_per_mode(keys):
    api, live = Api(keys.test), Api(keys.live)

    assert api.get("/v1/dunning_settings") == (
        200,
        {
            "object": "dunning_settings",
            "livemode": False,
            "retry_days": [1, 3, 5, 7],
            "final_action": "unpaid",
            "updated_at": None,
        },
    )
    status, body = api.post("/v1/dunning_settings", {"retry_days": [10, 2, 5], "final_action": "canceled"})

    assert status == 200 and (body["retry_days"], body["final_action"]) == ([2, 5, 10], "canceled")
    assert api.get("/v1/dunning_settings")[1]["retry_days"] == [2, 5, 10]
    assert api.post("/v1/dunning_settings", {"final_action": "unpaid"})[1]["retry_days"] == [2, 5, 10]
    assert live.get("/v1/dunning_settings")[1]["retry_days"] == [1, 3, 5, 7]  # the other mode is untouched
    assert Api(make_keys("Globex").test).get("/v1/dunning_settings")[1]["final_action"] == "unpaid"


@pytest.mark.parametrize(
    "body",
    [
        {"retry_days": []},
        {"retry_days": [0]},
        {"retry_days": [61]},
        {"retry_days": [1, 1]},
        {"retry_days": list(range(1, 10))},
        {"retry_days": [1.0]},
        {"retry_days": ["1"]},
        {"retry_days": [True]},
        {"retry_days": "1,3"},
        {"retry_days": None},
        {"final_action": "void"},
        {"final_action": None},
        {"grace_days": 3},
    ],
)
def test_bad_settings_are_a_422_and_change_nothing(keys, body):
    status, error = Api(keys.test).post("/v1/dunning_settings", body)

    assert status == 422 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] is not None
    assert not DunningSettings.objects.exists()


def test_settings_refuse_a_body_that_is_not_json(keys):
    status, _ = Api(keys.test).post("/v1/dunning_settings", raw="retry_days=1", content_type="text/plain")
    assert status == 415
    assert not DunningSettings.objects.exists()


def test_output_schemas_match_the_representations(keys):
    policy = get_settings(tenant_id=keys.tenant.id, livemode=False)
    assert set(dunning_api.DunningSettingsOut().fields) == set(dunning_settings_data(policy))
    run = DunningRun(
        tenant=keys.tenant,
        livemode=False,
        invoice_id="in_x",
        first_declined_at=policy_time(),
        schedule_anchor_at=policy_time(),
    )
    assert set(dunning_api.DunningRunOut().fields) == set(dunning_run_data(run))


def policy_time():
    from datetime import UTC, datetime

    return datetime(2030, 1, 1, tzinfo=UTC)


# --- runs and the customer update -------------------------------------------------------------------------------------


def _keys_for(tenant):
    _, test = ApiKey.issue(tenant, livemode=False)
    _, live = ApiKey.issue(tenant, livemode=True)
    return Api(test), Api(live)


def test_runs_are_listed_and_shown_to_their_tenant_and_mode_only(book, tenant):
    declined = decline(book, tenant)
    api, live = _keys_for(tenant)

    status, page = api.get("/v1/dunning_runs", {"status": "active"})
    assert status == 200 and [r["id"] for r in page["data"]] == [declined.run.id]
    status, run = api.get(f"/v1/dunning_runs/{declined.run.id}")
    assert status == 200
    assert (run["invoice"], run["retries_left"], run["next_attempt_at"]) == (
        declined.invoice.id,
        4,
        page["data"][0]["next_attempt_at"],
    )
    assert api.get("/v1/dunning_runs", {"invoice": declined.invoice.id})[1]["data"][0]["id"] == declined.run.id
    assert api.get("/v1/dunning_runs", {"status": "recovered"})[1]["data"] == []
    assert live.get(f"/v1/dunning_runs/{declined.run.id}")[0] == 404
    assert live.get("/v1/dunning_runs")[1]["data"] == []
    other, _ = _keys_for(book.tenant("Globex"))
    assert other.get(f"/v1/dunning_runs/{declined.run.id}")[0] == 404
    assert api.get("/v1/dunning_runs", {"status": "sleeping"})[0] == 422


def test_a_new_payment_method_through_the_api_retries_the_invoice_at_once(book, tenant, make_card):
    declined = decline(book, tenant)
    api, _ = _keys_for(tenant)
    customer_id = declined.subscription.customer_id
    card = make_card()

    status, customer = api.post(f"/v1/customers/{customer_id}", {"default_payment_method": card, "name": "Ada"})

    assert status == 200 and (customer["default_payment_method"], customer["name"]) == (card, "Ada")
    assert [e.data["default_payment_method"] for e in events("customer.updated")] == [card]
    status, run = api.get(f"/v1/dunning_runs/{declined.run.id}")
    assert run["next_attempt_at"] is not None and run["next_attempt_at"] < _iso(declined.at + _day())
    assert events("dunning.retry_scheduled")[-1].data["next_attempt_at"] == run["next_attempt_at"]
    assert process_due(livemode=False) == 1
    assert api.get(f"/v1/dunning_runs/{declined.run.id}")[1]["status"] == "recovered"
    # The same change again changes nothing and says nothing.
    assert api.post(f"/v1/customers/{customer_id}", {"default_payment_method": card})[0] == 200
    assert len(events("customer.updated")) == 1


@pytest.mark.parametrize(
    "body",
    [{"default_payment_method": "card_123"}, {"default_payment_method": 5}, {"email": "nope"}, {"test_clock": None}],
)
def test_a_bad_customer_update_is_a_422_and_changes_nothing(book, tenant, body):
    customer = book.customer(tenant, card=DECLINING_CARD)
    api, _ = _keys_for(tenant)
    before = Customer.objects.filter(pk=customer.pk).values().get()

    status, error = api.post(f"/v1/customers/{customer.id}", body)

    assert status == 422 and error["error"]["param"] is not None
    assert Customer.objects.filter(pk=customer.pk).values().get() == before
    assert events("customer.updated") == []


def test_another_tenants_or_modes_customer_cannot_be_updated(book, tenant):
    customer = book.customer(tenant, card=DECLINING_CARD)
    _, live = _keys_for(tenant)
    other, _ = _keys_for(book.tenant("Globex"))

    assert live.post(f"/v1/customers/{customer.id}", {"name": "x"})[0] == 404
    assert other.post(f"/v1/customers/{customer.id}", {"name": "x"})[0] == 404
    assert other.post("/v1/customers/not-an-id", {"name": "x"})[0] == 404
    assert Customer.objects.get(pk=customer.pk).name == ""


# --- admin and role ---------------------------------------------------------------------------------------------------


def test_the_admin_lists_runs_by_state_and_shows_their_attempts(book, tenant):
    declined = decline(book, tenant)
    user = User.objects.create_superuser("operator-dunning", "op@example.com", "pw-for-tests-only")
    client = Client()
    client.force_login(user)

    listing = client.get(reverse("admin:dunning_dunningrun_changelist"), {"status__exact": "active"})
    page = client.get(reverse("admin:dunning_dunningrun_change", args=[declined.run.pk]))

    assert listing.status_code == 200 and declined.run.id.encode() in listing.content
    assert page.status_code == 200
    assert f"hc:{declined.invoice.id}:create".encode() in page.content and b"generic_decline" in page.content
    assert client.get(reverse("admin:dunning_dunningrun_changelist"), {"status__exact": "recovered"}).status_code == 200


def test_the_dunning_role_retries_due_runs_of_both_modes_and_stamps_each(book, tenant, stripe_proxy):
    from billing.loops import DunningRole
    from hardcount.fencing import NO_FENCE
    from hardcount.scheduler import TickContext

    declined = decline(book, tenant)
    DunningRun.objects.filter(pk=declined.run.pk).update(
        first_declined_at=declined.at - _day(), schedule_anchor_at=declined.at - _day(), next_attempt_at=declined.at
    )
    stamps = []

    counts = DunningRole().tick(
        TickContext(role="dunning", holder="test", token=1, fence=NO_FENCE, stamp=lambda *a: stamps.append(a) or True)
    )

    assert counts == {"live_runs": 0, "test_runs": 1}
    assert len(stamps) == 3  # live: after the pass; test: after its page and after the pass
    assert DunningRun.objects.get(pk=declined.run.pk).retries_done == 1


def _day():
    from tests.dunning.conftest import DAY

    return DAY


def _iso(value):
    from hardcount.times import iso

    return iso(value)
