"""Fixtures for the outbox tests: real HTTP receivers on 127.0.0.1 and real executors.

Receivers are ``ThreadingHTTPServer``s in the test process. A behaviour per path decides
each answer (fast 200, 500, slow, hanging until released, 410, ...). Each receiver is on the
outbound allowlist while it runs (:func:`allow_outbound`): the executor reaches no local
address that the allowlist does not name (hardcount.outbound). Executors run against
the real test database, so the tests that use them need ``transactional_db``: the
executor's own connections must see the rows the test commits.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

_allow_lock = threading.Lock()


def allow_outbound(entry: str, *, allowed: bool = True) -> None:
    """Add ``entry`` (``host:port``) to the outbound allowlist, or remove it with ``allowed=False``.

    Both the running settings (executors in this process) and ``HARDCOUNT_OUTBOUND_ALLOW`` in
    the environment (processes the test starts afterwards) change.
    """
    from django.conf import settings

    with _allow_lock:
        current = [e for e in settings.HARDCOUNT_OUTBOUND_ALLOW if e != entry]
        settings.HARDCOUNT_OUTBOUND_ALLOW = [*current, entry] if allowed else current
        os.environ["HARDCOUNT_OUTBOUND_ALLOW"] = ",".join(settings.HARDCOUNT_OUTBOUND_ALLOW)


class _ReceiverServer(ThreadingHTTPServer):
    # A real server's listen backlog, not socketserver's 5: with eight workers connecting at once on a
    # loaded machine, a backlog of 5 drops SYNs, and the kernel's 1 s SYN retransmit outlasts the
    # tests' 1 s connect timeout, turning a receiver that is up into a "timeout".
    request_queue_size = 128


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # monotonic
    wall: float  # unix time of arrival (what a receiver checks a signature's timestamp against)
    peer: tuple[str, int] = ("", 0)  # the client's address and port: one per connection

    @property
    def json(self):
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    hang: threading.Event | None = None  # block until set (or 30 s) before answering
    delay_s: float = 0.0  # answer after this long (a slow receiver)
    close: bool = False  # close the connection without answering


class Receiver:
    """A local webhook receiver. ``behave(path, fn)`` sets how ``path`` answers; default 200."""

    def __init__(self):
        self.requests: list[Received] = []
        self.lock = threading.Lock()
        self.behaviours: dict[str, Callable[[Received, int], Answer]] = {}
        self.arrived = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                return None

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                path = self.path.split("?")[0]
                req = Received(
                    path,
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                    time.monotonic(),
                    time.time(),
                    self.client_address[:2],
                )
                with receiver.lock:
                    receiver.requests.append(req)
                    nth = sum(1 for r in receiver.requests if r.path == path)
                    receiver.arrived.notify_all()
                behaviour = receiver.behaviours.get(path, lambda r, n: Answer())
                answer = behaviour(req, nth)
                if answer.hang is not None:
                    answer.hang.wait(30)
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                if answer.close:
                    self.close_connection = True
                    return
                try:
                    self.send_response(answer.status)
                    for k, v in answer.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)
                except OSError:
                    pass  # the executor gave up on us (cancelled or timed out)

        self.server = _ReceiverServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.allow_entry = f"127.0.0.1:{self.server.server_address[1]}"
        allow_outbound(self.allow_entry)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def behave(self, path: str, fn: Callable[[Received, int], Answer]) -> None:
        self.behaviours[path] = fn

    def received(self, path: str | None = None) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if path is None or r.path == path]

    def wait_for(self, count: int, path: str | None = None, timeout_s: float = 20) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while sum(1 for r in self.requests if path is None or r.path == path) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver got fewer than {count} requests on {path}")
                self.arrived.wait(left)
            return [r for r in self.requests if path is None or r.path == path]

    def close(self):
        allow_outbound(self.allow_entry, allowed=False)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def wait_until(predicate: Callable[[], object], timeout_s: float = 20, what: str = "condition"):
    """Poll ``predicate`` (every 20 ms) until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def make_executor(transactional_db):
    """Start executors with test-sized timings; all are stopped at teardown."""
    from outbox.executor import Executor, ExecutorConfig

    started: list[Executor] = []

    def make(**overrides) -> Executor:
        executor_id = overrides.pop("executor_id", None) or f"test-{len(started)}"
        config = ExecutorConfig(
            **{
                "workers": 4,
                "timeout_s": 2.0,
                "connect_timeout_s": 1.0,
                "poll_interval_s": 0.05,
                "renew_interval_s": 0.1,
                "reap_interval_s": 0.2,
                "shutdown_grace_s": 0.5,
                **overrides,
            }
        )
        executor = Executor(config, executor_id=executor_id)
        started.append(executor.start())
        return executor

    yield make
    for executor in started:
        executor.stop()


@pytest.fixture
def tenant_t(transactional_db):
    from hardcount.models import Tenant

    return Tenant.objects.create(name="Acme")


def make_endpoint(tenant, url: str, events=("*",), *, livemode: bool = False, **fields):
    from outbox.models import WebhookEndpoint
    from outbox.signing import generate_secret

    return WebhookEndpoint.objects.create(
        tenant=tenant, livemode=livemode, url=url, enabled_events=list(events), secret=generate_secret(), **fields
    )


def emit(tenant, type_: str = "customer.created", *, livemode: bool = False, data=None):
    from django.db import transaction

    from outbox.services import emit_event

    with transaction.atomic():
        return emit_event(tenant_id=tenant.id, livemode=livemode, type=type_, data=data or {"id": "cus_test"})


OUTBOX_CHECKS = [
    "event_has_its_deliveries",
    "delivery_at_most_eight_attempts",
    "delivery_attempt_numbers_contiguous",
    "delivery_succeeded_by_one_executor",
    "delivery_status_matches_attempts",
    "delivery_claim_not_stale",
]


def assert_outbox_invariants() -> None:
    """``manage.py doctor``'s outbox checks find nothing wrong."""
    from ops.doctor import run_checks

    results = run_checks(names=OUTBOX_CHECKS)
    failing = {r.name: (r.status, r.examples, r.note) for r in results if r.status != "ok"}
    assert failing == {}
