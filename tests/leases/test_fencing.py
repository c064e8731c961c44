"""The fence's lock-mode reasoning, shown with two connections (leases/fencing.py, leases/queries.py).

A fenced transaction holds the lease row FOR KEY SHARE; a takeover locks it FOR UPDATE and
so waits for it; the holder's heartbeat (FOR NO KEY UPDATE) does not. A negative control
shows that the upsert alone would not wait.
"""

import threading

import pytest
from django.db import DatabaseError, connection, transaction

from hardcount.fencing import LeaseLost
from leases import services as leases
from tests.leases.helpers import (
    ROLE,
    Worker,
    expire,
    lease_row,
    scratch_rows,
    wait_for_lock_wait,
    wait_until,
    write_scratch,
)


def fenced_write(token: int, note: str, checked: threading.Event, proceed: threading.Event, holder: str = "a"):
    """Write a scratch row under the fence, pausing after the check until ``proceed`` is set."""

    def run():
        with transaction.atomic():
            leases.check_fence(ROLE, holder, token)
            checked.set()
            assert proceed.wait(10)
            write_scratch(token, note)
        return "committed"

    return run


def test_a_takeover_waits_for_the_old_holders_in_flight_fenced_transaction(scratch_table):
    leases.acquire(ROLE, "a", ttl_s=10)
    checked, proceed = threading.Event(), threading.Event()
    old = Worker(fenced_write(1, "late write of the old holder", checked, proceed))
    assert checked.wait(10)

    expire()
    takeover = Worker(lambda: leases.acquire(ROLE, "b", ttl_s=10))
    wait_for_lock_wait(takeover)

    proceed.set()
    assert old.join().error is None
    assert takeover.join().result == 2
    # The old holder's write committed before the new tenure began; none can follow it.
    assert scratch_rows() == [(1, "late write of the old holder")]
    assert lease_row()["holder"] == "b"


def test_negative_control_a_plain_upsert_does_not_wait_for_fenced_transactions(scratch_table):
    """Why ACQUIRE locks FOR UPDATE first: the upsert alone takes FOR NO KEY UPDATE, compatible with KEY SHARE."""
    plain_upsert = """
        INSERT INTO leases_leaderlease AS lease (role, holder, token, acquired_at, heartbeat_at, expires_at,
                                                 last_stamp_holder)
        VALUES (%(role)s, %(holder)s, 1, now(), now(), now() + interval '10 seconds', '')
        ON CONFLICT (role) DO UPDATE SET holder = EXCLUDED.holder, token = lease.token + 1,
                                         expires_at = EXCLUDED.expires_at
        WHERE lease.holder IS NULL OR lease.expires_at <= now()
        RETURNING token
    """
    leases.acquire(ROLE, "a", ttl_s=10)
    checked, proceed = threading.Event(), threading.Event()
    old = Worker(fenced_write(1, "write the successor did not wait for", checked, proceed))
    assert checked.wait(10)
    expire()

    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '2s'")  # would fail the test rather than hang if it did wait
        cursor.execute(plain_upsert, {"role": ROLE, "holder": "b"})
        assert cursor.fetchone() == (2,)
        cursor.execute("RESET lock_timeout")
    # The successor holds the role while the deposed holder's transaction is still open:
    proceed.set()
    assert old.join().error is None
    assert scratch_rows() == [(1, "write the successor did not wait for")]
    assert lease_row()["token"] == 2


def test_a_fenced_write_after_a_takeover_is_refused_and_rolled_back(scratch_table):
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    leases.acquire(ROLE, "b", ttl_s=10)

    with pytest.raises(LeaseLost):
        with transaction.atomic():
            write_scratch(1, "deposed write before its check")
            leases.check_fence(ROLE, "a", 1)
    assert scratch_rows() == []


def test_a_check_queued_behind_a_takeover_fails_once_the_takeover_commits(scratch_table):
    leases.acquire(ROLE, "a", ttl_s=10)
    in_tenure, taken, commit_takeover = threading.Event(), threading.Event(), threading.Event()

    def old_holder():
        with transaction.atomic():
            # Start the transaction while the lease is live: its now() is before the expiry.
            with connection.cursor() as cursor:
                cursor.execute("SELECT now()")
            in_tenure.set()
            assert taken.wait(10)
            leases.check_fence(ROLE, "a", 1)
            write_scratch(1, "must not commit")

    def new_holder():
        with transaction.atomic():
            assert leases.acquire(ROLE, "b", ttl_s=10) == 2  # holds FOR UPDATE until commit
            taken.set()
            assert commit_takeover.wait(10)
        return "committed"

    old = Worker(old_holder)
    assert in_tenure.wait(10)
    with connection.cursor() as cursor:
        # Expire the lease after the old transaction began, so its snapshot still sees it live.
        cursor.execute("UPDATE leases_leaderlease SET expires_at = clock_timestamp() WHERE role = %s", [ROLE])
    new = Worker(new_holder)
    assert taken.wait(10)
    wait_for_lock_wait(old)  # the old holder's check is queued behind the uncommitted takeover
    commit_takeover.set()
    assert new.join().error is None
    assert isinstance(old.join().error, LeaseLost)
    assert scratch_rows() == []


def test_the_holders_heartbeat_is_not_blocked_by_its_own_fenced_transactions(scratch_table):
    leases.acquire(ROLE, "a", ttl_s=10)
    checked, proceed = threading.Event(), threading.Event()
    fenced = Worker(fenced_write(1, "in flight", checked, proceed))
    assert checked.wait(10)
    try:
        # heartbeat() runs under a 2 s statement timeout: it would raise if it queued behind the lock.
        assert leases.heartbeat(ROLE, "a", 1, ttl_s=10)
        assert leases.stamp(ROLE, "a", 1)
    finally:
        proceed.set()
    assert fenced.join().error is None


def test_a_fence_check_outside_a_transaction_is_refused():
    with pytest.raises(RuntimeError, match=r"transaction\.atomic"):
        leases.check_fence(ROLE, "a", 1)


def test_a_fenced_transaction_left_idle_is_ended_by_the_server_and_the_takeover_proceeds(scratch_table):
    """A SIGSTOPped holder inside a fenced transaction cannot hold a successor back for long."""
    leases.acquire(ROLE, "a", ttl_s=10)
    checked, never = threading.Event(), threading.Event()

    def stalled_holder():
        with transaction.atomic():
            leases.check_fence(ROLE, "a", 1, idle_timeout_s=0.3)
            checked.set()
            never.wait(10)  # idle in transaction, like a stopped process
            write_scratch(1, "after the stall")

    stalled = Worker(stalled_holder)
    assert checked.wait(10)
    expire()
    takeover = Worker(lambda: leases.acquire(ROLE, "b", ttl_s=10))
    assert takeover.join(timeout_s=5).result == 2
    assert not stalled.done()  # the session was ended server-side while the client still slept
    never.set()
    error = stalled.join().error
    assert isinstance(error, DatabaseError)
    assert "idle-in-transaction timeout" in str(error)
    assert scratch_rows() == []
    assert wait_until(lambda: lease_row()["holder"] == "b")
