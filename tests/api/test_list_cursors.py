"""Every list pages to its end with ``starting_after`` (docs/decisions/0005-list-pagination.md).

A cursor is the last id of the previous page, whatever the list: nested lists whose rows have
no tenant column (a subscription's billing attempts) and lists that include rows shared by
every tenant (the scheduler's billing runs) included. Once those answered 500 and 404.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from billing.models import BillingAttempt, BillingRun, PaymentAttempt, Subscription, TestClock
from hardcount.models import ApiKey, Tenant
from tests.api.conftest import Api
from tests.doctor.world import Book, build_world


@pytest.fixture
def world(db):
    """The doctor's clean book, plus what makes every one of Acme's test-mode lists at least two long."""
    w = build_world()
    now = timezone.now()
    acme = Tenant.objects.get(pk=w.acme)
    sub = Subscription.objects.get(pk=w.sub)
    with transaction.atomic():
        TestClock.objects.create(tenant=acme, livemode=False, frozen_time=now)
        # Runs of the scheduler (no tenant: shared by every tenant they touched) and one of Acme's own.
        for hours in (5, 4, 3):
            shared = BillingRun.objects.create(
                trigger=BillingRun.SCHEDULER,
                livemode=False,
                status=BillingRun.COMPLETED,
                as_of=now - timedelta(hours=hours),
                started_at=now - timedelta(hours=hours),
                finished_at=now - timedelta(hours=hours),
                attempted=1,
                billed=1,
            )
            BillingAttempt.objects.create(run=shared, subscription=sub, outcome=BillingAttempt.BILLED, created_at=now)
        own = BillingRun.objects.create(
            trigger=BillingRun.MANUAL,
            tenant=acme,
            livemode=False,
            status=BillingRun.COMPLETED,
            as_of=now,
            started_at=now,
            finished_at=now,
        )
        BillingAttempt.objects.create(run=own, subscription=sub, outcome=BillingAttempt.SKIPPED, created_at=now)
        # A second dunning run: another declined invoice.
        book = Book(acme, False, "ACME")
        waiting = Subscription.objects.get(pk=w.waiting)
        book.attempt(book.invoice(waiting, 0), PaymentAttempt.DECLINED, decline_code="insufficient_funds")
    _, key = ApiKey.issue(acme, livemode=False)
    w.api = Api(key)
    return w


def _lists(w) -> list[str]:
    return [
        "/v1/customers",
        "/v1/prices",
        "/v1/subscriptions",
        "/v1/invoices",
        "/v1/test_clocks",
        "/v1/billing/runs",
        f"/v1/subscriptions/{w.sub}/billing_attempts",
        f"/v1/invoices/{w.declined}/payment_attempts",
        f"/v1/customers/{w.alice}/credits",
        "/v1/dunning_runs",
        "/v1/webhook_endpoints",
        "/v1/events",
        "/v1/webhook_deliveries",
    ]


def _walk(api: Api, path: str, limit: int) -> list[str]:
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": limit, **({"starting_after": cursor} if cursor else {})}
        status, body = api.get(path, params)
        assert status == 200, (path, cursor, body)
        seen += [row["id"] for row in body["data"]]
        if not body["has_more"]:
            return seen
        assert body["data"], (path, cursor)
        cursor = body["data"][-1]["id"]


@pytest.mark.parametrize("limit", [1, 2])
def test_every_list_pages_to_its_end_seeing_each_object_once(world, limit):
    for path in _lists(world):
        status, everything = world.api.get(path, {"limit": 100})
        assert status == 200 and everything["has_more"] is False, (path, everything)
        ids = [row["id"] for row in everything["data"]]
        assert len(ids) >= 2, path
        assert ids == sorted(ids, reverse=True), path
        assert _walk(world.api, path, limit) == ids, path


def test_a_shared_scheduler_run_is_a_cursor_of_the_runs_list(world):
    _, page = world.api.get("/v1/billing/runs", {"limit": 100})
    shared = [r["id"] for r in page["data"] if r["scope"] == "all_tenants"]
    assert len(shared) >= 3
    status, body = world.api.get("/v1/billing/runs", {"starting_after": shared[0]})
    assert status == 200
    assert shared[1] in [r["id"] for r in body["data"]]


def test_a_billing_attempt_is_a_cursor_of_its_subscriptions_attempts(world):
    path = f"/v1/subscriptions/{world.sub}/billing_attempts"
    _, page = world.api.get(path, {"limit": 1})
    status, body = world.api.get(path, {"starting_after": page["data"][0]["id"], "limit": 100})
    assert status == 200 and body["data"] and page["data"][0]["id"] not in [r["id"] for r in body["data"]]


def test_cursors_outside_the_callers_list_are_still_404(world):
    api = world.api
    other_sub = world.yen_sub  # Acme's too, but its attempts are another list
    BillingAttempt.objects.create(
        run=BillingRun.objects.filter(tenant__isnull=True).first(),
        subscription_id=other_sub,
        outcome=BillingAttempt.BILLED,
        created_at=timezone.now(),
    )
    foreign_attempt = BillingAttempt.objects.filter(subscription_id=other_sub).first().id
    status, body = api.get(f"/v1/subscriptions/{world.sub}/billing_attempts", {"starting_after": foreign_attempt})
    assert (status, body["error"]["param"]) == (404, "starting_after")
    # A scheduler run that touched none of the caller's subscriptions is not in its list.
    untouched = world.live_run
    status, body = api.get("/v1/billing/runs", {"starting_after": untouched})
    assert (status, body["error"]["param"]) == (404, "starting_after")
    # Another tenant's key sees none of Acme's cursors.
    _, globex_key = ApiKey.issue(Tenant.objects.get(pk=world.globex), livemode=False)
    _, runs = api.get("/v1/billing/runs", {"limit": 1})
    status, body = Api(globex_key).get("/v1/billing/runs", {"starting_after": runs["data"][0]["id"]})
    assert (status, body["error"]["param"]) == (404, "starting_after")
    status, body = Api(globex_key).get(
        f"/v1/subscriptions/{world.sub}/billing_attempts", {"starting_after": foreign_attempt}
    )
    assert status == 404
