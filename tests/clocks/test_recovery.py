"""An advance survives its process: a walker killed mid-way leaves the clock ``advancing`` with its
claim lapsed, and the billing tick (or a read of the clock) resumes the walk to the recorded target
with every period billed once (decision 0080). One walker at a time: the clock's claim (decision 0182)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest
from dateutil.relativedelta import relativedelta
from django.db.models import Count

from billing.models import Invoice, TestClock
from billing.services.clocks import resume_stalled_advances, run_advance, wait_for_advances
from tests.billing.conftest import STRIPE_KEY
from tests.claim_holder import TTL_S, OtherHolder
from tests.clocks.helpers import make_clock, subscribe
from tests.system.harness import BASE_DIR, SchedulerProcess, database_url

T0 = datetime(2027, 1, 15, 12, tzinfo=UTC)
MONTHS = 6


def _orphan(clock, target) -> None:
    """The state an advance request leaves behind when its process dies before the walk starts."""
    TestClock.objects.filter(pk=clock.pk).update(status=TestClock.ADVANCING, advance_target=target)


def _periods_billed(clock) -> dict[str, int]:
    rows = Invoice.objects.filter(subscription__test_clock=clock).values("subscription_id").annotate(n=Count("id"))
    return {row["subscription_id"]: row["n"] for row in rows}


def _wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    # Waiting on another process (no row timestamp can stand in for it): poll, bounded.
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def hold_clock_lock():
    """``hold(clock_id)``: another process takes the clock's advance claim (as a live walker does) and beats."""
    holders = []

    def hold(clock_id: str) -> OtherHolder:
        holders.append(OtherHolder(f"test_clock:{clock_id}"))
        return holders[-1]

    yield hold
    for holder in holders:
        if not holder.session.closed:
            holder.die()


def test_a_live_walker_keeps_every_other_walker_and_the_resumer_out(book, tenant, hold_clock_lock):
    clock = make_clock(tenant, T0)
    subscribe(book, clock)
    target = T0 + relativedelta(months=2)
    _orphan(clock, target)
    walker = hold_clock_lock(clock.id)

    assert run_advance(clock.id) is False
    assert resume_stalled_advances() == []
    assert _periods_billed(clock) == {}

    time.sleep(2 * TTL_S)  # a live walker's claim does not lapse: it beats
    assert resume_stalled_advances() == []
    walker.die()  # the walker's process died: its claim is no longer renewed and lapses
    resumed = []
    _wait_until(lambda: resumed.extend(resume_stalled_advances()) or resumed, what="the claim to lapse")
    assert resumed == [clock.id]
    assert wait_for_advances(timeout_s=120)
    clock.refresh_from_db()
    assert (clock.status, clock.frozen_time) == ("ready", target)
    assert list(_periods_billed(clock).values()) == [3]


def test_reading_an_orphaned_clock_through_the_api_resumes_its_advance(book, tenant):
    from hardcount.models import ApiKey
    from tests.api.conftest import Api

    clock = make_clock(tenant, T0)
    subscribe(book, clock)
    target = T0 + relativedelta(months=1)
    _orphan(clock, target)
    _, key = ApiKey.issue(tenant, livemode=False)

    status, body = Api(key).get(f"/v1/test_clocks/{clock.id}")

    assert (status, body["status"], body["advance_target"]) == (200, "advancing", "2027-02-15T12:00:00Z")
    assert wait_for_advances(timeout_s=120)
    clock.refresh_from_db()
    assert (clock.status, clock.frozen_time) == ("ready", target)
    assert list(_periods_billed(clock).values()) == [2]


WALKER = """
import django, sys
django.setup()
from billing.services.clocks import run_advance
run_advance(sys.argv[1])
"""


@pytest.mark.system
def test_a_walker_killed_mid_advance_is_resumed_by_the_billing_tick_and_bills_each_period_once(
    book, tenant, stripe_proxy
):
    clock = make_clock(tenant, T0)
    subscriptions = [subscribe(book, clock) for _ in range(3)]
    target = T0 + relativedelta(months=MONTHS - 1, days=1)
    _orphan(clock, target)
    # Slow charges, so the kill lands between instants of the walk.
    stripe_proxy.fail_next("delay", times=10_000, match="POST /v1/payment_intents", delay_s=0.15)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "hardcount.settings",
        "STRIPE_API_BASE": stripe_proxy.api_base,
        "STRIPE_API_KEY": STRIPE_KEY,
        # A charge the kill leaves in flight is re-sent (same key) once five timeouts have passed.
        "HARDCOUNT_GATEWAY_TIMEOUT_S": "1",
    }
    walker = subprocess.Popen([sys.executable, "-c", WALKER, clock.id], cwd=BASE_DIR, env=env)
    try:
        _wait_until(lambda: Invoice.objects.filter(subscription__test_clock=clock).count() >= 4, what="a few invoices")
    finally:
        walker.send_signal(signal.SIGKILL)
        walker.wait()
    clock.refresh_from_db()
    billed_when_killed = sum(_periods_billed(clock).values())
    assert clock.status == TestClock.ADVANCING and billed_when_killed < len(subscriptions) * MONTHS
    stripe_proxy.clear()

    scheduler = SchedulerProcess(
        "billing-resumer",
        {
            "HARDCOUNT_ROLES": "billing.loops.BillingRole",
            "HARDCOUNT_BILLING_INTERVAL_S": "1",
            "STRIPE_API_BASE": stripe_proxy.api_base,
            "STRIPE_API_KEY": STRIPE_KEY,
            "HARDCOUNT_GATEWAY_TIMEOUT_S": "1",
        },
    )
    try:
        _wait_until(
            lambda: TestClock.objects.get(pk=clock.pk).status == TestClock.READY, timeout_s=120, what="the resume"
        )
    finally:
        scheduler.stop()

    clock.refresh_from_db()
    assert (clock.frozen_time, clock.last_failure) == (target, "")
    assert _periods_billed(clock) == {sub.id: MONTHS for sub in subscriptions}
    starts = set(Invoice.objects.filter(subscription__test_clock=clock).values_list("period_start", flat=True))
    assert starts == {T0 + relativedelta(months=n) for n in range(MONTHS)}
    assert not Invoice.objects.filter(subscription__test_clock=clock).exclude(status=Invoice.PAID).exists()


def test_a_process_walks_at_most_four_clocks_at_once_and_the_rest_wait_their_turn(monkeypatch):
    import threading

    from billing.services import clocks

    running, peak, lock, release = [], [0], threading.Lock(), threading.Event()

    def walk(clock_id):
        with lock:
            running.append(clock_id)
            peak[0] = max(peak[0], len(running))
        release.wait(30)
        with lock:
            running.remove(clock_id)
        return True

    monkeypatch.setattr(clocks, "run_advance", walk)
    for n in range(6):
        clocks.start_advance(f"clock_{n}")
    _wait_until(lambda: len(running) == clocks.MAX_WALKS_PER_PROCESS, what="four walks")

    release.set()
    assert clocks.wait_for_advances(timeout_s=30)
    assert (peak[0], running) == (4, [])
