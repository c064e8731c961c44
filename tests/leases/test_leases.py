"""Lease statements against PostgreSQL: acquire, heartbeat, release, stamp, and the race for a free role."""

import threading

import pytest
from django.db import connection, connections

from leases import services as leases
from tests.leases.helpers import ROLE, expire, lease_row

pytestmark = pytest.mark.django_db(transaction=True)


def test_first_acquire_creates_the_row_with_token_1_and_a_ttl_from_now():
    assert leases.acquire(ROLE, "a", ttl_s=10) == 1
    row = lease_row()
    assert row["holder"] == "a"
    assert row["live"]
    assert (row["expires_at"] - row["heartbeat_at"]).total_seconds() == pytest.approx(10)


def test_a_live_lease_is_refused_to_another_holder():
    leases.acquire(ROLE, "a", ttl_s=10)
    assert leases.acquire(ROLE, "b", ttl_s=10) is None
    assert lease_row()["holder"] == "a"


def test_an_expired_lease_goes_to_a_new_holder_with_a_higher_token():
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    assert leases.acquire(ROLE, "b", ttl_s=10) == 2
    row = lease_row()
    assert (row["holder"], row["token"], row["live"]) == ("b", 2, True)


def test_reacquiring_our_live_lease_keeps_the_token_and_extends_it():
    leases.acquire(ROLE, "a", ttl_s=1)
    first = lease_row()
    assert leases.acquire(ROLE, "a", ttl_s=60) == 1
    row = lease_row()
    assert row["acquired_at"] == first["acquired_at"]
    assert row["expires_at"] > first["expires_at"]


def test_reacquiring_our_own_expired_lease_starts_a_new_tenure():
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    assert leases.acquire(ROLE, "a", ttl_s=10) == 2


def test_a_released_lease_is_taken_at_once_with_a_higher_token():
    leases.acquire(ROLE, "a", ttl_s=10)
    assert leases.release(ROLE, "a", 1)
    assert lease_row()["holder"] is None
    assert leases.acquire(ROLE, "b", ttl_s=10) == 2


def test_release_by_a_deposed_holder_changes_nothing():
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    leases.acquire(ROLE, "b", ttl_s=10)
    assert not leases.release(ROLE, "a", 1)
    assert (lease_row()["holder"], lease_row()["token"]) == ("b", 2)


def test_heartbeat_extends_our_live_lease():
    leases.acquire(ROLE, "a", ttl_s=1)
    before = lease_row()["expires_at"]
    assert leases.heartbeat(ROLE, "a", 1, ttl_s=30)
    assert (lease_row()["expires_at"] - before).total_seconds() > 25


def test_heartbeat_with_a_stale_token_or_holder_is_refused():
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    leases.acquire(ROLE, "b", ttl_s=10)
    expires_at = lease_row()["expires_at"]
    assert not leases.heartbeat(ROLE, "a", 1, ttl_s=30)
    assert not leases.heartbeat(ROLE, "b", 1, ttl_s=30)
    assert lease_row()["expires_at"] == expires_at


def test_an_expired_lease_is_never_revived_by_its_holders_heartbeat():
    leases.acquire(ROLE, "a", ttl_s=10)
    expire()
    assert not leases.heartbeat(ROLE, "a", 1, ttl_s=30)
    assert not lease_row()["live"]


def test_stamp_and_completed_tick_are_written_only_under_our_live_lease():
    leases.acquire(ROLE, "a", ttl_s=10)
    assert leases.stamp(ROLE, "a", 1)
    assert lease_row()["last_stamp_at"] is not None
    assert lease_row()["last_tick_at"] is None
    assert leases.complete_tick(ROLE, "a", 1)
    assert lease_row()["last_tick_at"] is not None

    expire()
    leases.acquire(ROLE, "b", ttl_s=10)
    stamped = lease_row()["last_stamp_at"]
    assert not leases.stamp(ROLE, "a", 1)
    assert not leases.complete_tick(ROLE, "a", 1)
    assert lease_row()["last_stamp_at"] == stamped


def test_seconds_until_due_counts_from_the_last_completed_tick_on_the_database_clock():
    assert leases.seconds_until_due(ROLE, 60) == 0  # never held
    leases.acquire(ROLE, "a", ttl_s=10)
    assert leases.seconds_until_due(ROLE, 60) == 0  # never ticked
    with connection.cursor() as cursor:
        cursor.execute("UPDATE leases_leaderlease SET last_tick_at = now() - interval '20 seconds'")
    assert leases.seconds_until_due(ROLE, 60) == pytest.approx(40, abs=1)
    assert leases.seconds_until_due(ROLE, 10) == 0


def test_try_acquire_peeks_without_locking_and_gives_a_held_fence():
    assert leases.try_acquire(ROLE, "a").token == 1
    assert leases.try_acquire(ROLE, "b") is None
    assert leases.peek(ROLE) == leases.Peek(holder="a", token=1, free=False)


def test_holder_ids_name_host_process_and_a_random_part():
    import os
    import socket

    first, second = leases.new_holder_id(), leases.new_holder_id()
    host, pid, random_part = first.split(":")
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())
    assert len(random_part) == 8
    assert first != second


def test_replicas_racing_for_a_free_role_produce_exactly_one_winner_per_round():
    holders = [f"replica-{i}" for i in range(6)]
    for round_number in range(1, 6):
        barrier = threading.Barrier(len(holders))
        results: dict[str, int | None] = {}

        def race(holder, barrier=barrier, results=results):
            try:
                barrier.wait()
                results[holder] = leases.acquire(ROLE, holder, ttl_s=10)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=race, args=(h,)) for h in holders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        winners = {h: token for h, token in results.items() if token is not None}
        assert len(results) == len(holders)
        assert len(winners) == 1, winners
        ((winner, token),) = winners.items()
        assert token == round_number
        assert lease_row()["holder"] == winner
        expire()
