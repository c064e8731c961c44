"""LeaseFence: the held lease as a Fence — abandon on the monotonic clock, heartbeat thread, release."""

import pytest
from django.db import transaction

from hardcount.fencing import LeaseLost
from leases import services as leases
from tests.leases.helpers import ROLE, expire, lease_row, scratch_rows, wait_until, write_scratch

pytestmark = pytest.mark.django_db(transaction=True)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


def held(clock, **kwargs) -> leases.LeaseFence:
    fence = leases.try_acquire(ROLE, "a", clock=clock)
    assert fence is not None
    if kwargs:
        fence = leases.LeaseFence(ROLE, "a", fence.token, clock=clock, **kwargs)
    return fence


def test_alive_turns_false_once_the_last_good_heartbeat_is_abandon_s_old(clock, settings):
    settings.HARDCOUNT_LEASE_ABANDON_S = 6
    fence = held(clock)
    clock.now += 5.9
    assert fence.alive()
    clock.now += 0.1
    assert not fence.alive()
    assert fence.lost


def test_an_abandoned_lease_refuses_writes_even_while_the_database_would_still_accept_them(clock, scratch_table):
    fence = held(clock, abandon_s=6)
    clock.now += 6
    assert lease_row()["live"]  # the database's TTL (10 s) has not run out
    with pytest.raises(LeaseLost):
        with transaction.atomic():
            fence.check()
            write_scratch(fence.token, "after abandon")
    assert scratch_rows() == []


def test_a_successful_heartbeat_restarts_the_abandon_clock(clock):
    fence = held(clock, abandon_s=6)
    clock.now += 5
    assert fence.heartbeat_once()
    clock.now += 5
    assert fence.alive()
    assert fence.heartbeat_age_s() == 5


def test_a_refused_heartbeat_marks_the_lease_lost(clock):
    fence = held(clock)
    expire()
    leases.acquire(ROLE, "b", ttl_s=10)
    assert not fence.heartbeat_once()
    assert fence.lost
    assert not fence.alive()
    with pytest.raises(LeaseLost), transaction.atomic():
        fence.check()


def test_a_stop_request_ends_alive_but_still_lets_in_flight_work_commit(clock, scratch_table):
    fence = held(clock)
    fence.request_stop()
    assert not fence.alive()
    with transaction.atomic():
        fence.check()
        write_scratch(fence.token, "recorded after the stop request")
    assert scratch_rows() == [(1, "recorded after the stop request")]


def test_the_stamp_of_a_lost_lease_writes_nothing(clock):
    fence = held(clock)
    assert fence.stamp("ignored page argument")
    stamped = lease_row()["last_stamp_at"]
    fence.mark_lost()
    assert not fence.stamp()
    assert lease_row()["last_stamp_at"] == stamped


def test_the_heartbeat_thread_keeps_extending_the_lease(settings):
    settings.HARDCOUNT_LEASE_HEARTBEAT_S = 0.05
    fence = leases.try_acquire(ROLE, "a")
    first = lease_row()["expires_at"]
    fence.start_heartbeat()
    try:
        assert wait_until(lambda: lease_row()["expires_at"] > first, timeout_s=5)
        assert fence.alive()
    finally:
        assert fence.close()
    assert lease_row()["holder"] is None


def test_closing_a_lease_already_taken_over_releases_nothing(clock):
    fence = held(clock)
    expire()
    leases.acquire(ROLE, "b", ttl_s=10)
    assert not fence.close()
    assert lease_row()["holder"] == "b"
