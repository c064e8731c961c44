"""Real executor processes (``manage.py runoutbox``) killed and stopped mid-delivery (docs/reference/guarantees.md).

The child processes use the test database through ``DATABASE_URL``. Lease expiry is moved
by setting ``claim_expires_at`` in the database, not by waiting for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection
from django.db.models.functions import Now

from outbox.models import Delivery, DeliveryAttempt
from outbox.signing import verify

from .conftest import Answer, assert_outbox_invariants, emit, make_endpoint, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.system]


@pytest.fixture(autouse=True)
def outbox_invariants_hold_afterwards(request, transactional_db):
    """After each test (executors stopped), the doctor's outbox checks pass."""
    yield
    assert_outbox_invariants()


ROOT = Path(__file__).resolve().parents[2]


def database_url() -> str:
    db = connection.settings_dict
    user, port = quote(db["USER"] or "postgres"), db["PORT"] or 5432
    return f"postgresql://{user}@localhost:{port}/{db['NAME']}?host={quote(db['HOST'])}"


def start_runoutbox(**env) -> subprocess.Popen:
    child_env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "HARDCOUNT_OUTBOX_POLL_S": "0.05",
        "HARDCOUNT_LOG_LEVEL": "WARNING",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "manage.py", "runoutbox", "--workers", "2"],
        cwd=ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_executor_killed_mid_delivery_loses_nothing(tenant_t, receiver, processes):
    release = threading.Event()
    receiver.behave("/hook", lambda r, n: Answer(hang=release) if n == 1 else Answer())
    endpoint = make_endpoint(tenant_t, receiver.url("/hook"))
    emit(tenant_t, "invoice.paid")
    delivery = Delivery.objects.get()
    try:
        doomed = start_runoutbox(HARDCOUNT_DELIVERY_TIMEOUT_S="30")
        processes.append(doomed)
        receiver.wait_for(1, "/hook", timeout_s=30)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        held = Delivery.objects.get(id=delivery.id)
        assert held.status == "pending" and held.claimed_by.split(":")[1] == str(doomed.pid)

        # Its lease runs out (moved in the database rather than waited for), and a new
        # executor process hands the work on.
        Delivery.objects.filter(id=delivery.id).update(claim_expires_at=Now() - timedelta(seconds=1))
        processes.append(start_runoutbox())
        wait_until(lambda: Delivery.objects.get(id=delivery.id).status == "succeeded", timeout_s=30, what="handover")
    finally:
        release.set()
    rows = list(DeliveryAttempt.objects.filter(delivery=delivery).order_by("number"))
    assert [(a.number, a.outcome) for a in rows] == [(1, "lease_lost"), (2, "succeeded")]
    assert held.claimed_by in rows[0].error
    received = receiver.received("/hook")
    assert [r.json["id"] for r in received] == [delivery.event_id] * 2
    for r in received:
        verify(r.body, r.headers["hardcount-signature"], endpoint.secret, tolerance_s=5, now=r.wall)


def test_sigterm_mid_delivery_records_a_canceled_attempt_and_retries_at_once(tenant_t, receiver, processes):
    release = threading.Event()
    receiver.behave("/hook", lambda r, n: Answer(hang=release) if n == 1 else Answer())
    make_endpoint(tenant_t, receiver.url("/hook"))
    emit(tenant_t)
    delivery = Delivery.objects.get()
    try:
        stopping = start_runoutbox(HARDCOUNT_DELIVERY_TIMEOUT_S="30", HARDCOUNT_OUTBOX_SHUTDOWN_GRACE_S="0.5")
        processes.append(stopping)
        receiver.wait_for(1, "/hook", timeout_s=30)
        stopping.send_signal(signal.SIGTERM)
        output, _ = stopping.communicate(timeout=20)
        assert stopping.returncode == 0, output
        d = Delivery.objects.get(id=delivery.id)
        assert (d.status, d.claimed_by, d.attempts) == ("retrying", None, 1)
        attempt = DeliveryAttempt.objects.get(delivery=d)
        assert attempt.outcome == "canceled" and "shut down" in attempt.error

        processes.append(start_runoutbox())
        wait_until(lambda: Delivery.objects.get(id=delivery.id).status == "succeeded", timeout_s=30, what="retry")
    finally:
        release.set()
    assert Delivery.objects.get(id=delivery.id).attempts == 2


def test_every_event_reaches_every_endpoint_through_chaos(tenant_t, receiver, processes):
    """Slow, failing, hanging and connection-closing receivers; executor processes racing, one SIGKILLed."""
    release = threading.Event()
    tries: dict[tuple[str, str], int] = {}
    lock = threading.Lock()

    def per_delivery(answer_for_try):
        def behave(r, n):
            key = (r.path, r.headers["hardcount-delivery-id"])
            with lock:
                tries[key] = tries.get(key, 0) + 1
                attempt = tries[key]
            return answer_for_try(attempt)

        return behave

    receiver.behave("/slow", per_delivery(lambda n: Answer(delay_s=0.2)))
    receiver.behave("/flaky", per_delivery(lambda n: Answer(500, b"try later") if n <= 2 else Answer()))
    receiver.behave("/hang", per_delivery(lambda n: Answer(hang=release) if n == 1 else Answer()))
    receiver.behave("/close", per_delivery(lambda n: Answer(close=True) if n == 1 else Answer()))
    endpoints = {path: make_endpoint(tenant_t, receiver.url(path)) for path in ("/slow", "/flaky", "/hang", "/close")}
    events = [emit(tenant_t, "invoice.paid", data={"id": f"in_{i}"}) for i in range(15)]

    stop_mover = threading.Event()

    def move_time():
        # Retries and circuit cool-downs come due at once: time moved through the rows.
        from django.db import connections

        while not stop_mover.wait(0.1):
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    "UPDATE outbox_delivery SET fire_after = now() "
                    "WHERE status IN ('pending', 'retrying') AND fire_after > now()"
                )
                cursor.execute(
                    "UPDATE outbox_webhookendpoint SET circuit_open_until = now() WHERE circuit_open_until > now()"
                )
        connections["default"].close()

    mover = threading.Thread(target=move_time, daemon=True)
    env = {"HARDCOUNT_DELIVERY_TIMEOUT_S": "1", "HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S": "1"}
    try:
        victim = start_runoutbox(**env)
        processes.append(victim)
        processes.append(start_runoutbox(**env))
        mover.start()
        receiver.wait_for(20, timeout_s=30)
        # Kill it while it waits on a hanging receiver (a request that lasts its whole 1 s timeout).
        held_by_victim = Delivery.objects.filter(
            claimed_by__contains=f":{victim.pid}:", endpoint=endpoints["/hang"], attempts=1
        )
        wait_until(held_by_victim.exists, timeout_s=30, what="the victim mid-request")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        # The victim's leases run out now rather than in 2 s; a third process joins.
        Delivery.objects.filter(claimed_by__contains=f":{victim.pid}:").update(
            claim_expires_at=Now() - timedelta(seconds=1)
        )
        processes.append(start_runoutbox(**env))
        wait_until(
            lambda: Delivery.objects.filter(status="succeeded").count() == 60,
            timeout_s=90,
            what="all 60 deliveries succeeded",
        )
    finally:
        stop_mover.set()
        release.set()
        if mover.is_alive():
            mover.join(5)

    assert Delivery.objects.count() == 60
    for event in events:
        for endpoint in endpoints.values():
            d = Delivery.objects.get(event=event, endpoint=endpoint)
            assert d.status == "succeeded" and 1 <= d.attempts <= 8
    assert DeliveryAttempt.objects.filter(outcome="succeeded").count() == 60
    assert DeliveryAttempt.objects.filter(outcome="lease_lost").exists()  # the victim's work was handed on
    flaky = Delivery.objects.filter(endpoint=endpoints["/flaky"])
    assert all(d.attempts >= 3 for d in flaky)
    answered = {(r.path, r.json["id"]) for r in receiver.received()}
    assert answered == {(path, e.id) for path in endpoints for e in events}
