"""Real ``runscheduler`` replicas against one PostgreSQL: one leader per role, SIGKILL, SIGTERM, SIGSTOP, long drains.

Each test starts its replicas with the test-only scratch roles of ``tests/system/roles.py``
(fenced rows in ``system_scratch``, one per page) and the production lease timings
(TTL 10 s, heartbeat 3 s, abandon 6 s, follower poll 0.5 s) unless it says otherwise.
Measured figures are printed (``pytest -s`` shows them).
"""

import signal
import time

import pytest
from django.conf import settings
from django.db import connection

from tests.leases.helpers import wait_until
from tests.system.harness import SchedulerProcess, lease, scratch_rows
from tests.system.roles import CREATE_TABLE

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

TTL_S = settings.HARDCOUNT_LEASE_TTL_S
POLL_S = settings.HARDCOUNT_LEASE_POLL_S


@pytest.fixture
def scratch(transactional_db):
    with connection.cursor() as cursor:
        cursor.execute(CREATE_TABLE)
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS system_scratch")


@pytest.fixture
def replicas(scratch):
    started: list[SchedulerProcess] = []

    def start(count: int, metrics: bool = False, **env: str) -> list[SchedulerProcess]:
        env = {"HARDCOUNT_ROLES": "tests.system.roles.ScratchRole", "SCRATCH_INTERVAL_S": "1", **env}
        base = len(started)
        for i in range(count):
            started.append(SchedulerProcess(f"replica-{base + i}", env, metrics=metrics))
        return started[-count:]

    yield start
    for process in started:
        process.stop()


def leader_of(processes: list[SchedulerProcess], role: str = "scratch") -> SchedulerProcess:
    assert wait_until(lambda: (row := lease(role)) is not None and row["live"], timeout_s=15)
    holder = lease(role)["holder"]
    (leader,) = [p for p in processes if p.holder == holder]
    return leader


def test_three_replicas_hold_each_role_exactly_once_at_every_sampled_instant(replicas):
    roles = ("scratch", "scratch-2")
    processes = replicas(
        3,
        metrics=True,
        HARDCOUNT_ROLES="tests.system.roles.ScratchRole,tests.system.roles.SecondScratchRole",
        SCRATCH_INTERVAL_S="0.2",
    )
    for role in roles:
        leader_of(processes, role)

    samples = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        views = [p.leadership() for p in processes]
        for role in roles:
            row = lease(role)
            assert row["live"], f"no live holder of {role} at sample {samples}"
            leaders = [p.holder for p, view in zip(processes, views, strict=True) if view.get(role) == 1]
            assert leaders == [row["holder"]], f"sample {samples}: {role} leaders {leaders}, lease {row['holder']}"
        samples += 1
        time.sleep(0.1)

    for role in roles:
        rows = scratch_rows(role)
        assert len(rows) >= 10
        assert len({(holder, token) for holder, token, _, _ in rows}) == 1  # one holder, one tenure
        assert sum(len(p.find("lease_acquired", role=role)) for p in processes) == 1
    print(f"\n3 replicas, 2 roles: {samples} samples over 5 s, exactly one leader per role in each")


def test_a_sigkilled_leader_is_replaced_within_the_ttl(replicas):
    processes = replicas(3)
    leader = leader_of(processes)
    assert wait_until(lambda: len(scratch_rows()) >= 1)

    leader.send(signal.SIGKILL)
    killed = time.monotonic()
    leader.process.wait(5)
    final = lease("scratch")  # the dead holder can no longer extend it: this expiry is final

    def successor_rows():
        return [r for r in scratch_rows() if r[1] > final["token"]]

    assert wait_until(lambda: bool(successor_rows()), timeout_s=TTL_S + 10)
    elapsed = time.monotonic() - killed
    successor = lease("scratch")
    print(
        f"\nSIGKILL of the leader → successor's first tick after {elapsed:.2f} s "
        f"(TTL {TTL_S:.0f} s; the lease had {(final['expires_at'] - final['db_now']).total_seconds():.2f} s left)"
    )
    assert successor["holder"] != leader.holder
    assert successor["acquired_at"] >= final["expires_at"]  # never before the dead leader's lease expired
    assert elapsed <= TTL_S + POLL_S * 1.2 + 1.0


def test_a_sigtermed_leader_hands_over_within_a_second(replicas):
    processes = replicas(2)
    leader = leader_of(processes)
    (follower,) = [p for p in processes if p is not leader]
    token = lease("scratch")["token"]
    # Steady state first: the follower has been polling for a while (two of the leader's ticks).
    assert wait_until(lambda: len(leader.find("tick_completed", role="scratch")) >= 2, timeout_s=10)

    leader.send(signal.SIGTERM)
    sent = time.monotonic()
    assert wait_until(lambda: lease("scratch")["holder"] == follower.holder, timeout_s=5, step_s=0.01)
    handover = time.monotonic() - sent
    assert wait_until(lambda: any(r[1] == token + 1 for r in scratch_rows()), timeout_s=5)
    ticked = time.monotonic() - sent
    print(f"\nSIGTERM of the leader → successor holds the lease after {handover:.2f} s, ticks after {ticked:.2f} s")
    assert handover < 1.0
    assert leader.process.wait(10) == 0
    assert leader.find("lease_released", role="scratch", released="True", reason="stop")


def test_a_leader_stopped_longer_than_the_ttl_writes_nothing_after_resuming_and_steps_down(replicas):
    processes = replicas(2, SCRATCH_FENCE="raw", SCRATCH_PAGES="100000", SCRATCH_PAGE_S="0.1")
    leader = leader_of(processes)
    (follower,) = [p for p in processes if p is not leader]
    assert wait_until(lambda: len(scratch_rows()) >= 3)

    leader.send(signal.SIGSTOP)
    stopped = time.monotonic()
    old_token = lease("scratch")["token"]
    assert wait_until(lambda: any(r[1] == old_token + 1 for r in scratch_rows()), timeout_s=TTL_S + 10)
    # Stay stopped for longer than the TTL in any case.
    while time.monotonic() - stopped < TTL_S + 1:
        time.sleep(0.1)
    old_rows = [r for r in scratch_rows() if r[1] == old_token]

    leader.send(signal.SIGCONT)
    leader.wait_for("lease_released", role="scratch", timeout_s=15)
    refused = leader.find("scratch_write_refused", token=old_token)
    # Normally the resumed loop's next write is refused by the fence check (the database
    # turning the old token away); if the stop caught it inside a transaction, the server
    # ended that transaction (idle timeout) and the write failed instead. Nothing commits either way.
    assert refused or leader.find("tick_failed", role="scratch")
    assert [r for r in scratch_rows() if r[1] == old_token] == old_rows
    assert max(r[3] for r in old_rows) < min(r[3] for r in scratch_rows() if r[1] == old_token + 1)

    # The successor keeps going; the resumed process is a follower now.
    count = len(scratch_rows())
    assert wait_until(lambda: len(scratch_rows()) > count + 5)
    assert {r[0] for r in scratch_rows()[count:]} == {follower.holder}
    assert lease("scratch")["holder"] == follower.holder
    print(
        f"\nSIGSTOP for {time.monotonic() - stopped:.1f} s: {len(old_rows)} rows under token {old_token} before, "
        f"none after; refused by the database: {bool(refused)}"
    )


def test_a_drain_longer_than_twice_the_interval_keeps_the_lease_and_a_fresh_stamp(replicas, client, settings):
    settings.HARDCOUNT_ROLES = ["tests.system.roles.ScratchRole"]
    # 24 pages of 0.5 s: a 12 s tick, longer than 2 × the 1 s interval and than the 10 s TTL.
    # DEBUG: a tick's start is logged at DEBUG (one INFO line per tick, at its end).
    processes = replicas(2, SCRATCH_PAGES="24", SCRATCH_PAGE_S="0.5", HARDCOUNT_LOG_LEVEL="DEBUG")
    leader = leader_of(processes)
    (follower,) = [p for p in processes if p is not leader]
    first = lease("scratch")
    leader.wait_for("tick_started", role="scratch")

    max_age = 0.0
    samples = 0
    while not leader.find("tick_completed", role="scratch"):
        row = lease("scratch")
        assert (row["holder"], row["token"], row["live"]) == (leader.holder, first["token"], True)
        if row["stamp_age_s"] is not None:
            max_age = max(max_age, row["stamp_age_s"])
            assert row["stamp_age_s"] < 2 * 1.0, f"stale stamp: {row['stamp_age_s']:.2f} s"
        ready = client.get("/health/ready").json()["roles"]["scratch"]
        assert ready["stale"] is False
        samples += 1
        time.sleep(0.25)
        assert samples < 200, "the long tick never completed"

    completed = leader.find("tick_completed", role="scratch")[0]
    assert completed["pages"] == "24"
    assert float(completed["duration_s"]) > TTL_S
    assert lease("scratch")["expires_at"] > first["expires_at"]  # heartbeats extended it past its first TTL
    assert not follower.find("lease_acquired")
    print(
        f"\n{float(completed['duration_s']):.1f} s tick at a 1 s interval: lease kept, "
        f"stamp never older than {max_age:.2f} s over {samples} samples"
    )


def test_sigint_stops_the_runtime_cleanly_releasing_its_leases(replicas):
    (process,) = replicas(1, HARDCOUNT_ROLES="tests.system.roles.ScratchRole,tests.system.roles.SecondScratchRole")
    leader_of([process], "scratch")
    leader_of([process], "scratch-2")
    process.send(signal.SIGINT)
    assert process.process.wait(10) == 0
    assert lease("scratch")["holder"] is None
    assert lease("scratch-2")["holder"] is None
    assert process.find("runtime_stopped", clean="True")


def test_the_default_roles_and_services_tick_in_one_replica_and_stop_cleanly(scratch):
    process = SchedulerProcess("defaults", {"HARDCOUNT_ROLES": None, "HARDCOUNT_SERVICES": None})
    try:
        started = process.find("runtime_started")[0]
        roles = started["roles"].split(",")
        assert {"billing", "dunning"} <= set(roles)
        for role in roles:
            process.wait_for("tick_completed", role=role, timeout_s=30)
        assert not process.find("tick_failed")
    finally:
        assert process.stop() == 0
    assert process.find("runtime_stopped", clean="True")
    assert all(lease(role)["holder"] is None for role in roles)
