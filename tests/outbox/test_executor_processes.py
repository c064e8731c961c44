"""Real executor processes (``manage.py runoutbox``) killed and stopped mid-delivery (SPEC §9).

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
