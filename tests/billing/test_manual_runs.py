"""``POST /v1/billing/run`` in the background (docs/decisions/0127-manual-runs-in-the-background.md): the request
answers the run ``running`` at once, the drain goes on under the run's own lease, a second request answers the run in
progress, a read shows the counts page by page, and a run whose drainer is gone is carried on by the next holder."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from billing.events import subscription_event
from billing.models import BillingAttempt, BillingRun, Invoice, Subscription
from billing.services import manual_runs
from billing.services.manual_runs import lease_role, resume_stalled_manual_runs, start_manual_run
from hardcount.scheduler.leadership import lease_store
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import wait_for_manual_runs
from tests.clocks.helpers import make_clock, subscribe

CHARGE = "POST /v1/payment_intents"


@pytest.fixture
def acme(book):
    return make_keys("Acme")


@pytest.fixture
def slow_pages(settings, stripe_proxy):
    """One subscription per page, closed one at a time, each charge held 0.4 s at the gateway."""
    settings.HARDCOUNT_BILLING_PAGE_SIZE = 1
    settings.HARDCOUNT_BILLING_CONCURRENCY = 1
    stripe_proxy.fail_next("delay", times=10_000, match=CHARGE, delay_s=0.4)
    return stripe_proxy


def _wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    # Waiting on the background drain (no row a test could wait on instead): poll, bounded.
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_request_answers_before_the_drain_a_second_one_gets_the_same_run_and_reads_show_progress(
    book, acme, slow_pages
):
    subs = [book.subscribed(acme.tenant) for _ in range(4)]
    api = Api(acme.test)

    started = time.monotonic()
    status, run = api.post("/v1/billing/run", {})
    answered_in = time.monotonic() - started

    assert status == 200
    assert (run["status"], run["trigger"], run["scope"], run["finished_at"]) == ("running", "manual", "tenant", None)
    assert answered_in < 4 * 0.4  # the four charges alone take longer than that
    status, again = api.post("/v1/billing/run", {})
    assert (status, again["id"]) == (200, run["id"])

    # Counts are saved page by page: a read while it drains shows some pages done, not all.
    seen = []

    def progressed():
        body = api.get(f"/v1/billing/runs/{run['id']}")[1]
        seen.append((body["status"], body["pages"], body["attempted"], body["billed"]))
        return body["status"] == "running" and 1 <= body["attempted"] < 4

    _wait_until(progressed, what="a page of the run to be counted")
    wait_for_manual_runs()

    status, done = api.get(f"/v1/billing/runs/{run['id']}")
    assert status == 200
    assert (done["status"], done["pages"], done["attempted"], done["billed"], done["failed"]) == (
        "completed",
        4,
        4,
        4,
        0,
    )
    assert done["finished_at"] is not None and done["error"] is None
    assert [s for s, *_ in seen].count("completed") == 0
    assert {i.subscription_id for i in Invoice.objects.filter(status=Invoice.PAID)} == {s.id for s in subs}
    assert BillingRun.objects.filter(trigger="manual").count() == 1

    # Finished: the next request starts a new run.
    status, next_run = api.post("/v1/billing/run", {})
    assert status == 200 and next_run["id"] != run["id"]
    wait_for_manual_runs()
    assert api.get(f"/v1/billing/runs/{next_run['id']}")[1]["attempted"] == 0


def test_the_manual_run_skips_waiting_parked_and_test_clock_subscriptions(book, acme, stripe_proxy):
    due = book.subscribed(acme.tenant)
    waiting = book.subscribed(acme.tenant)
    parked = book.subscribed(acme.tenant)
    Subscription.objects.filter(pk=waiting.pk).update(
        billing_failure_count=2, next_billing_attempt_at=database_now() + timedelta(hours=1)
    )
    Subscription.objects.filter(pk=parked.pk).update(billing_failure_count=8, billing_parked_at=database_now())
    Subscription.objects.filter(pk__in=[waiting.pk, parked.pk]).update(last_billing_error="gateway 503")
    with transaction.atomic():
        parked.refresh_from_db()
        subscription_event(parked, "subscription.billing_parked")
    clock = make_clock(acme.tenant, database_now() - timedelta(days=1))
    on_clock = subscribe(book, clock)

    status, run = Api(acme.test).post("/v1/billing/run", {})
    wait_for_manual_runs()

    assert status == 200
    assert list(BillingAttempt.objects.filter(run_id=run["id"]).values_list("subscription_id", flat=True)) == [due.id]
    assert not Invoice.objects.filter(subscription__in=[waiting, parked, on_clock]).exists()


def test_an_idempotency_key_replays_the_first_answer(book, acme, slow_pages):
    book.subscribed(acme.tenant)
    api = Api(acme.test)
    key = {"Idempotency-Key": "run-once"}

    first = api.response("post", "/v1/billing/run", data="{}", content_type="application/json", headers=key)
    wait_for_manual_runs()
    replay = api.response("post", "/v1/billing/run", data="{}", content_type="application/json", headers=key)

    assert (first.status_code, first.json()["status"]) == (200, "running")
    assert (replay.status_code, replay.json(), replay["Idempotent-Replayed"]) == (200, first.json(), "true")
    assert BillingRun.objects.filter(trigger="manual").count() == 1


def test_two_requests_at_once_start_one_run(book, acme, slow_pages):
    book.subscribed(acme.tenant)
    barrier, answers = threading.Barrier(2), []

    def request():
        barrier.wait()
        try:
            answers.append(start_manual_run(tenant_id=acme.tenant.id, livemode=False))
        finally:
            connection.close()

    threads = [threading.Thread(target=request) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wait_for_manual_runs()

    assert sorted(created for _, created in answers) == [False, True]
    assert len({run.id for run, _ in answers}) == 1
    assert BillingRun.objects.get(trigger="manual").status == BillingRun.Status.COMPLETED


def _orphan(tenant) -> BillingRun:
    """A manual run as a request leaves it when its process dies before the drain took the lease."""
    now = database_now()
    return BillingRun.objects.create(
        trigger=BillingRun.Trigger.MANUAL,
        tenant=tenant,
        livemode=False,
        as_of=now,
        started_at=now,
        lease_role=lease_role(tenant.id, False),
    )


def test_reading_a_run_nobody_drains_carries_it_on(book, acme, stripe_proxy):
    sub = book.subscribed(acme.tenant)
    run = _orphan(acme.tenant)

    status, body = Api(acme.test).get(f"/v1/billing/runs/{run.id}")
    assert (status, body["status"]) == (200, "running")
    wait_for_manual_runs()

    run.refresh_from_db()
    assert (run.status, run.attempted, run.billed, run.lease_token) == (BillingRun.Status.COMPLETED, 1, 1, 1)
    assert Invoice.objects.get(subscription=sub).status == Invoice.PAID


def test_a_run_whose_lease_is_held_is_left_to_its_holder_and_taken_over_once_the_lease_expires(
    book, acme, stripe_proxy, settings
):
    settings.HARDCOUNT_LEASE_TTL_S = 2.0
    settings.HARDCOUNT_LEASE_HEARTBEAT_S = 0.3
    settings.HARDCOUNT_LEASE_ABANDON_S = 1.5
    subs = [book.subscribed(acme.tenant) for _ in range(2)]
    run = _orphan(acme.tenant)
    # Another process drains it (alive: its lease is held), has billed the first subscription, then stops beating.
    store = lease_store()
    other = store.try_acquire(run.lease_role, "elsewhere:1:dead", clock=time.monotonic)
    assert other is not None
    from billing.services.close import close_subscription_period

    BillingRun.objects.filter(pk=run.pk).update(lease_token=other.token, pages=1)
    close_subscription_period(subs[0].id, periods_billed=0, run=run, fence=other)

    assert resume_stalled_manual_runs() == []  # its holder's lease is live
    assert Api(acme.test).get(f"/v1/billing/runs/{run.id}")[1]["status"] == "running"
    assert manual_runs.wait_for_manual_runs(timeout_s=5)

    _wait_until(lambda: resume_stalled_manual_runs() == [run.id], what="the lease to expire")
    wait_for_manual_runs()

    run.refresh_from_db()
    assert run.status == BillingRun.Status.COMPLETED
    assert run.lease_token == other.token + 1
    # Recounted from its billing attempts: the first subscription was not attempted again.
    assert (run.attempted, run.billed) == (2, 2)
    assert sorted(BillingAttempt.objects.filter(run=run).values_list("subscription_id", flat=True)) == sorted(
        s.id for s in subs
    )
    # The deposed holder writes nothing more.
    from hardcount.fencing import LeaseLost

    with pytest.raises(LeaseLost):
        with transaction.atomic():
            other.check()


def test_the_billing_tick_carries_on_a_stalled_manual_run(book, acme, stripe_proxy):
    from billing.loops import BillingRole
    from hardcount.fencing import NO_FENCE
    from hardcount.scheduler import TickContext

    sub = book.subscribed(acme.tenant)
    run = _orphan(acme.tenant)
    counts = BillingRole().tick(
        TickContext(role="billing", holder="test", token=1, fence=NO_FENCE, stamp=lambda *_: True)
    )
    wait_for_manual_runs()

    assert counts["manual_runs_resumed"] == 1
    run.refresh_from_db()
    assert run.status == BillingRun.Status.COMPLETED
    # The tick's own drain and the carried-on run bill the subscription once between them.
    assert counts["test_billed"] + run.billed == 1
    assert Invoice.objects.filter(subscription=sub).count() == 1


def test_a_drain_stopped_by_an_error_ends_its_run_failed(book, acme, monkeypatch):
    book.subscribed(acme.tenant)

    def broken(**kwargs):
        raise RuntimeError("a bug in the drain")

    monkeypatch.setattr(manual_runs, "drain_due", broken)
    Api(acme.test).post("/v1/billing/run", {})
    wait_for_manual_runs()

    run = BillingRun.objects.get(trigger="manual")
    assert (run.status, run.error) == (BillingRun.Status.FAILED, "RuntimeError: a bug in the drain")
    assert run.finished_at is not None
    # Its lease was given back: the next request starts a new run and drains it.
    monkeypatch.undo()
    _, body = Api(acme.test).post("/v1/billing/run", {})
    wait_for_manual_runs()
    assert BillingRun.objects.get(pk=body["id"]).status == BillingRun.Status.COMPLETED
