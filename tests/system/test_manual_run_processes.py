"""``POST /v1/billing/run`` against real gunicorn processes (docs/decisions/0127-manual-runs-in-the-background.md).

The drain takes longer than the worker's timeout, and the request still answers at once while the run finishes in
the background and bills every subscription once; with the ``sync`` worker too, the one whose timeout kills a busy
request. A worker SIGKILLed mid-drain leaves its run ``running``: once its lease expires, the next read of the run
(served by the worker gunicorn started in its place) carries it on under a new token, and every subscription is still
billed once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from billing.models import BillingAttempt, BillingRun, Invoice
from hardcount.models import ApiKey
from tests.billing.conftest import STRIPE_KEY, book  # noqa: F401 - the fixture, as pytest passes it
from tests.leases.helpers import wait_until
from tests.system.harness import BASE_DIR, database_url, free_port, lease

pytestmark = pytest.mark.system

SUBSCRIPTIONS = 20
CHARGE_DELAY_S = 0.2  # every PaymentIntent call, one at a time: the drain takes 20 × 0.2 s at least
WORKER_TIMEOUT_S = 2


class Web:
    """gunicorn with hardcount/gunicorn.conf.py, and ``args`` and ``env`` on top, on a free port; logs to a file."""

    def __init__(self, tmp_path, stripe_api_base: str, *, args: tuple[str, ...] = (), env: dict | None = None):
        self.port = free_port()
        self.log_path = tmp_path / "gunicorn.log"
        full_env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "HARDCOUNT_BIND": f"127.0.0.1:{self.port}",
            "HARDCOUNT_WEB_WORKERS": "1",
            "HARDCOUNT_RUN_SCHEDULER": "0",
            "HARDCOUNT_SERVICES": "",
            "STRIPE_API_BASE": stripe_api_base,
            "STRIPE_API_KEY": STRIPE_KEY,
            # One charge at a time, one page at a time: the delayed charges add up to a drain longer than the
            # worker's timeout, which these tests are about (with charges in flight it would end in one delay).
            "HARDCOUNT_BILLING_CONCURRENCY": "1",
            "HARDCOUNT_BILLING_CHARGES_IN_FLIGHT": "1",
            "HARDCOUNT_BILLING_PAGES_IN_FLIGHT": "1",
            "HARDCOUNT_BILLING_PAGE_SIZE": "5",
            **(env or {}),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "hardcount/gunicorn.conf.py", *args, "hardcount.wsgi"],
            cwd=BASE_DIR,
            env=full_env,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
        )
        assert wait_until(self._up, timeout_s=60), f"gunicorn did not come up:\n{self.log()}"

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health/live", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def call(self, method: str, path: str, key: str) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=b"{}" if method == "POST" else None,
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@pytest.fixture
def web(tmp_path, stripe_proxy):
    """``web(args=…, env=…)`` starts gunicorn with the charges delayed; every one started is stopped at the end."""
    started: list[Web] = []
    stripe_proxy.fail_next("delay", times=10**6, match="POST /v1/payment_intents", delay_s=CHARGE_DELAY_S)

    def start(**kwargs) -> Web:
        started.append(Web(tmp_path, stripe_proxy.api_base, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _book_of(book):  # noqa: F811 - the fixture imported above
    tenant = book.tenant()
    subscriptions = [book.subscribed(tenant) for _ in range(SUBSCRIPTIONS)]
    _, key = ApiKey.issue(tenant, livemode=False)
    return tenant, subscriptions, key


def _poll_until_finished(server: Web, run_id: str, key: str, timeout_s: float = 90) -> dict:
    # Polling the run over HTTP is the client's side of the contract (and what heals an orphaned run).
    seen: list[dict] = []

    def finished() -> bool:
        seen.append(server.call("GET", f"/v1/billing/runs/{run_id}", key)[1])
        return seen[-1]["status"] != "running"

    assert wait_until(finished, timeout_s=timeout_s, step_s=0.2), f"run still running: {seen[-1]}\n{server.log()}"
    return seen[-1]


def _billed_once(subscriptions) -> None:
    for sub in subscriptions:
        (invoice,) = Invoice.objects.filter(subscription=sub)
        assert invoice.status == Invoice.PAID, invoice.id


@pytest.mark.parametrize("worker_class", ["configured", "sync"])
def test_a_drain_longer_than_the_worker_timeout_answers_at_once_and_finishes(book, web, worker_class):  # noqa: F811
    _, subscriptions, key = _book_of(book)
    args = ("--timeout", str(WORKER_TIMEOUT_S))
    if worker_class == "sync":
        args += ("--worker-class", "sync")
    server = web(args=args)

    started = time.monotonic()
    status, run = server.call("POST", "/v1/billing/run", key)
    answered_in = time.monotonic() - started
    status_again, again = server.call("POST", "/v1/billing/run", key)

    assert (status, run["status"], status_again, again["id"]) == (200, "running", 200, run["id"])
    assert answered_in < WORKER_TIMEOUT_S
    done = _poll_until_finished(server, run["id"], key)

    assert (done["status"], done["attempted"], done["billed"], done["failed"]) == (
        "completed",
        SUBSCRIPTIONS,
        SUBSCRIPTIONS,
        0,
    )
    row = BillingRun.objects.get(pk=run["id"])
    assert (row.finished_at - row.started_at).total_seconds() > WORKER_TIMEOUT_S
    _billed_once(subscriptions)
    assert BillingAttempt.objects.filter(run=row).count() == SUBSCRIPTIONS
    assert "WORKER TIMEOUT" not in server.log()


def test_a_worker_killed_mid_drain_has_its_run_carried_on_by_the_next_read(book, web):  # noqa: F811
    tenant, subscriptions, key = _book_of(book)
    server = web(
        env={
            # A lease the dead worker stops beating expires 3.5 to 4 s after the kill; a charge it left in flight
            # is re-sent (same key) once its window (5 × 0.5 s) has passed, which is sooner.
            "HARDCOUNT_LEASE_TTL_S": "4",
            "HARDCOUNT_LEASE_HEARTBEAT_S": "0.5",
            "HARDCOUNT_LEASE_ABANDON_S": "3",
            "HARDCOUNT_GATEWAY_TIMEOUT_S": "0.5",
        }
    )
    status, run = server.call("POST", "/v1/billing/run", key)
    assert (status, run["status"]) == (200, "running")
    role = f"manual:{tenant.id}:test"
    assert wait_until(lambda: BillingRun.objects.get(pk=run["id"]).pages >= 1, timeout_s=30), server.log()
    first = lease(role)
    worker_pid = int(first["holder"].split(":")[1])
    os.kill(worker_pid, signal.SIGKILL)
    billed_when_killed = Invoice.objects.filter(status=Invoice.PAID).count()
    assert billed_when_killed < SUBSCRIPTIONS

    done = _poll_until_finished(server, run["id"], key)

    assert (done["status"], done["billed"], done["attempted"]) == ("completed", SUBSCRIPTIONS, SUBSCRIPTIONS)
    row = BillingRun.objects.get(pk=run["id"])
    assert row.lease_token == first["token"] + 1
    assert lease(role)["holder"] is None  # released by the worker that finished it
    _billed_once(subscriptions)
