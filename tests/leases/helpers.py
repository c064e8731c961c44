"""Helpers for lease and scheduler tests: rows read and moved in time through SQL (the database's clock)."""

import threading
from collections.abc import Callable

import pytest
from django.db import connection, connections

ROLE = "test-role"


def lease_row(role: str = ROLE) -> dict | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT holder, token, acquired_at, heartbeat_at, expires_at, last_stamp_at, last_tick_at,"
            " expires_at > now() AS live FROM leases_leaderlease WHERE role = %s",
            [role],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    keys = ("holder", "token", "acquired_at", "heartbeat_at", "expires_at", "last_stamp_at", "last_tick_at", "live")
    return dict(zip(keys, row, strict=True))


def expire(role: str = ROLE) -> None:
    """Move the lease's expiry into the past, as if its TTL had run out."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE leases_leaderlease SET expires_at = now() - interval '1 second' WHERE role = %s", [role])


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def wait_event_type(pid: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return None if row is None else row[0]


class Worker:
    """A thread with its own database connection, running ``fn`` and keeping its result or exception."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.pid: int | None = None
        self.pid_known = threading.Event()
        self._fn = fn
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.pid = backend_pid()
            self.pid_known.set()
            self.result = self._fn()
        except BaseException as exc:  # kept for the test to assert on
            self.error = exc
        finally:
            self.pid_known.set()
            connections.close_all()

    def join(self, timeout_s: float = 10.0) -> "Worker":
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "worker thread did not finish"
        return self

    def done(self) -> bool:
        return not self.thread.is_alive()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.02) -> bool:
    """Poll ``condition`` until true (returns True) or ``timeout_s`` passes (returns False)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step_s)
    return condition()


def wait_for_lock_wait(worker: Worker, timeout_s: float = 10.0) -> None:
    """Block until ``worker``'s backend is waiting on a lock (it is queued behind another transaction)."""
    assert worker.pid_known.wait(timeout_s)
    assert wait_until(lambda: wait_event_type(worker.pid) == "Lock" or worker.done(), timeout_s)
    assert not worker.done(), (
        f"expected the worker to wait on a lock, but it finished: {worker.result!r} {worker.error!r}"
    )


def scratch_rows() -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT token, note FROM lease_scratch ORDER BY id")
        return cursor.fetchall()


def write_scratch(token: int, note: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO lease_scratch (token, note) VALUES (%s, %s)", [token, note])


@pytest.fixture
def scratch_table(transactional_db):
    """A table a fenced transaction writes to, dropped afterwards."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS lease_scratch (id serial PRIMARY KEY, token bigint, note text)")
    yield "lease_scratch"
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS lease_scratch")
