"""``make run``'s stack survives the database dropping every one of its sessions.

``manage.py serve`` runs as in tests/system/test_serve_process.py (against the test database,
its own ``var/`` and port). Once its supervisor has read the progress line (so it holds a
session), the test terminates every other session of the database with ``pg_terminate_backend``
from its own connection: serve's, gunicorn's workers' (web, scheduler, outbox executor). The
stack must keep serving: ``/health/ready`` answers 200 again within seconds, ``serve`` is still
running (it said once that its query failed, then that the database is back), and gunicorn
answers an API request with the demo's test key (docs/decisions/0131-dev-stack-resilience-and-first-run.md).
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from django.db import connection

from tests.system.harness import ServeProcess

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

FAILED_LINE = "database: the supervisor's query failed"
BACK_LINE = "database: back after"


def _ready_status(serve: ServeProcess) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/health/ready", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _terminate_every_other_session() -> int:
    """``pg_terminate_backend`` every session of this database but the test's own; how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_terminating_every_database_session_leaves_the_stack_serving(tmp_path):
    serve = ServeProcess(tmp_path / "var")
    try:
        serve.wait_ready()
        test_key = serve.banner_value("test key")
        # The first progress line: the supervisor has a session of its own now.
        assert serve.wait_for_line("billing  due ", timeout_s=30), "\n".join(serve.lines)
        assert _ready_status(serve) == 200

        terminated = _terminate_every_other_session()

        assert terminated >= 2, terminated  # serve's and at least one of gunicorn's
        # The next progress read fails on its dead session: said once, then retried.
        assert serve.wait_for_line(FAILED_LINE, timeout_s=20), "\n".join(serve.lines[-40:])
        deadline = time.monotonic() + 10
        while _ready_status(serve) != 200:
            assert time.monotonic() < deadline, "/health/ready did not answer 200 again:\n" + "\n".join(
                serve.lines[-40:]
            )
            time.sleep(0.2)
        assert serve.process.poll() is None, "\n".join(serve.lines[-40:])
        status, page = serve.api("GET", "/v1/customers?limit=1", test_key)
        assert status == 200, page
        assert serve.wait_for_line(BACK_LINE, timeout_s=30), "\n".join(serve.lines[-40:])

        time.sleep(6)  # another progress tick on the new session
        assert serve.process.poll() is None
        assert sum(FAILED_LINE in line for line in serve.lines) == 1
    finally:
        if serve.process.poll() is None:
            serve.process.send_signal(signal.SIGTERM)
            try:
                serve.process.wait(60)
            except subprocess.TimeoutExpired:
                serve.process.kill()
