"""The scheduler runtime in-process: ticker threads, one leader per role, cadence, safe-point stops, services."""

import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction

from hardcount.scheduler import (
    Runtime,
    TickContext,
    TickFailed,
    configured_roles,
    configured_services,
    process_leadership,
)
from hardcount.scheduler import ticker as ticker_module
from leases import services as leases
from tests.leases.helpers import expire, lease_row, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ROLE = "recording"


@pytest.fixture(autouse=True)
def fast_leases(settings):
    settings.HARDCOUNT_LEASE_POLL_S = 0.05
    settings.HARDCOUNT_LEASE_HEARTBEAT_S = 0.1
    settings.HARDCOUNT_LEASE_TTL_S = 10
    settings.HARDCOUNT_LEASE_ABANDON_S = 6


class RecordingRole:
    """Records (holder, token) of every tick; optional behaviour per tick."""

    def __init__(self, name=ROLE, interval_s=0.05, behaviour=None):
        self.name = name
        self.interval_s = interval_s
        self.ticks: list[tuple[str, int]] = []
        self.behaviour = behaviour
        self.lock = threading.Lock()

    def tick(self, ctx: TickContext):
        with self.lock:
            self.ticks.append((ctx.holder, ctx.token))
        if self.behaviour is not None:
            return self.behaviour(ctx)
        return {"n": len(self.ticks)}


@pytest.fixture
def runtimes():
    started: list[Runtime] = []

    def make(*roles, services=(), holder=None):
        runtime = Runtime(list(roles), list(services), holder=holder)
        runtime.start()
        started.append(runtime)
        return runtime

    yield make
    for runtime in started:
        runtime.stop(5)


def test_a_runtime_takes_its_role_ticks_every_interval_and_stamps_each_tick(runtimes):
    role = RecordingRole()
    runtime = runtimes(role)
    assert wait_until(lambda: len(role.ticks) >= 3)
    assert {holder for holder, _ in role.ticks} == {runtime.holder}
    row = lease_row(ROLE)
    assert row["holder"] == runtime.holder
    assert row["last_tick_at"] is not None
    assert row["last_stamp_at"] is not None
    assert runtime.leadership() == {ROLE: True}
    assert process_leadership([ROLE, "other"]) == {ROLE: True, "other": False}


def test_of_three_runtimes_exactly_one_ticks_a_role(runtimes):
    role = RecordingRole()
    replicas = [runtimes(role) for _ in range(3)]
    assert wait_until(lambda: len(role.ticks) >= 10)
    assert len({holder for holder, _ in role.ticks}) == 1
    assert sum(r.leadership()[ROLE] for r in replicas) == 1


def test_stopping_the_leader_releases_the_role_and_another_runtime_takes_it_at_once(runtimes):
    role = RecordingRole()
    first = runtimes(role)
    assert wait_until(lambda: len(role.ticks) >= 1)
    second = runtimes(role)
    assert first.stop(5)
    assert wait_until(lambda: role.ticks[-1][0] == second.holder, timeout_s=2)
    tokens = [token for holder, token in role.ticks if holder == second.holder]
    assert tokens and all(token == 2 for token in tokens)


def test_a_failing_tick_is_logged_the_lease_kept_and_the_next_tick_runs(runtimes, caplog):
    def explode(ctx):
        raise ValueError("boom")

    role = RecordingRole(behaviour=explode)
    runtime = runtimes(role)
    assert wait_until(lambda: len(role.ticks) >= 3)
    assert {token for _, token in role.ticks} == {1}
    assert runtime.leadership() == {ROLE: True}
    assert lease_row(ROLE)["last_tick_at"] is None  # a failed tick is not a completed one
    assert any("event=tick_failed" in r.getMessage() and f"role={ROLE}" in r.getMessage() for r in caplog.records)


def test_a_failed_tick_is_retried_sooner_than_the_interval_and_then_keeps_the_interval(runtimes, monkeypatch):
    monkeypatch.setattr(ticker_module, "FAILED_TICK_RETRY_S", 0.1)

    def fail_first(ctx):
        if len(role.ticks) == 1:
            raise TickFailed("database blip")
        return {}

    role = RecordingRole(interval_s=3600, behaviour=fail_first)
    runtimes(role)
    assert wait_until(lambda: len(role.ticks) == 2, timeout_s=5)  # not an hour later
    assert wait_until(lambda: lease_row(ROLE)["last_tick_at"] is not None)
    assert len(role.ticks) == 2


def test_stop_ends_a_long_tick_at_its_next_safe_point_without_recording_it_as_completed(runtimes):
    entered = threading.Event()
    pages = []

    def long_drain(ctx):
        entered.set()
        while ctx.fence.alive():  # a safe point before every page
            pages.append(ctx.stamp())
            threading.Event().wait(0.01)
        return {"pages": len(pages)}

    role = RecordingRole(interval_s=3600, behaviour=long_drain)
    runtime = runtimes(role)
    assert entered.wait(5)
    assert wait_until(lambda: len(pages) >= 3)
    assert runtime.stop(3)
    row = lease_row(ROLE)
    assert row["holder"] is None  # released
    assert row["last_tick_at"] is None
    assert row["last_stamp_at"] is not None
    assert all(pages)


def test_a_new_leader_keeps_the_cadence_of_the_last_completed_tick(runtimes):
    leases.acquire(ROLE, "previous-holder", ttl_s=10)
    leases.complete_tick(ROLE, "previous-holder", 1)
    leases.release(ROLE, "previous-holder", 1)
    role = RecordingRole(interval_s=3600)
    runtime = runtimes(role)
    assert wait_until(lambda: runtime.leadership()[ROLE])
    assert lease_row(ROLE)["token"] == 2
    assert role.ticks == []  # the last tick completed moments ago: not due for an hour

    runtime.stop(5)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE leases_leaderlease SET last_tick_at = now() - interval '2 hours' WHERE role = %s", [ROLE]
        )
    runtimes(role)
    assert wait_until(lambda: len(role.ticks) == 1)


def test_a_lease_taken_over_mid_tick_stops_the_tick_and_its_writes_are_refused(runtimes, settings, scratch_table):
    settings.HARDCOUNT_LEASE_HEARTBEAT_S = 0.05
    taken_over = threading.Event()
    outcome = {}

    def drain(ctx):
        assert taken_over.wait(5)
        assert wait_until(lambda: not ctx.fence.alive(), timeout_s=5)  # the heartbeat noticed
        try:
            with transaction.atomic():
                ctx.fence.check()
                with connection.cursor() as cursor:
                    cursor.execute("INSERT INTO lease_scratch (token, note) VALUES (%s, 'late')", [ctx.token])
        except Exception as exc:
            outcome["error"] = type(exc).__name__
            raise
        return {}

    role = RecordingRole(interval_s=3600, behaviour=drain)
    runtime = runtimes(role)
    assert wait_until(lambda: len(role.ticks) == 1)
    expire(ROLE)
    assert leases.acquire(ROLE, "usurper", ttl_s=10) == 2
    taken_over.set()
    assert wait_until(lambda: "error" in outcome)
    assert outcome == {"error": "LeaseLost"}
    assert not runtime.leadership()[ROLE]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM lease_scratch")
        assert cursor.fetchone()[0] == 0
    assert lease_row(ROLE)["holder"] == "usurper"


def test_services_start_with_the_runtime_and_stop_with_it(runtimes):
    calls = []

    class Service:
        name = "recorder"

        def start(self):
            calls.append("start")

        def stop(self):
            calls.append("stop")

    runtime = runtimes(RecordingRole(), services=[Service()])
    assert calls == ["start"]
    runtime.stop(5)
    assert calls == ["start", "stop"]


def test_roles_and_services_come_from_settings(settings):
    settings.HARDCOUNT_ROLES = ["billing.loops.DunningRole"]
    settings.HARDCOUNT_SERVICES = []
    assert [r.name for r in configured_roles()] == ["dunning"]
    assert configured_roles(["dunning"])[0].interval_s == settings.HARDCOUNT_DUNNING_INTERVAL_S
    assert configured_services() == []
    with pytest.raises(ImproperlyConfigured, match="unknown scheduler role"):
        configured_roles(["nope"])
    settings.HARDCOUNT_ROLES = ["no.such.Role"]
    with pytest.raises(ImproperlyConfigured, match="cannot import"):
        configured_roles()


def test_stopped_runtime_threads_end_and_close_their_connections(runtimes):
    role = RecordingRole()
    runtime = runtimes(role)
    assert wait_until(lambda: len(role.ticks) >= 1)
    assert runtime.stop(5)
    names = {t.name for t in threading.enumerate()}
    assert not any(n.startswith(("scheduler-", "lease-heartbeat-")) for n in names)


def family_roles(family, count):
    """``count`` roles ``<family>:<i>``, of that family (``family`` None: roles ``solo:<i>`` of no family)."""
    roles = [RecordingRole(f"{family or 'solo'}:{i}") for i in range(count)]
    for role in roles:
        if family:
            role.family = family
    return roles


def leaders(names):
    return {name: lease_row(name)["holder"] for name in names}


def test_roles_of_one_family_spread_over_runtimes_and_a_lone_runtime_takes_the_rest_after_the_spread(
    runtimes, settings
):
    settings.HARDCOUNT_LEASE_SPREAD_S = 1.5
    names = ["shard:0", "shard:1"]
    first = runtimes(*family_roles("shard", 2))
    assert wait_until(lambda: sum(first.leadership().values()) == 1, timeout_s=5)
    second = runtimes(*family_roles("shard", 2))  # within the first one's spread
    assert wait_until(lambda: sum(second.leadership().values()) == 1, timeout_s=5)
    assert set(leaders(names).values()) == {first.holder, second.holder}  # one each

    second.stop(5)  # released: the first takes the other one, after seeing it free for its spread
    assert wait_until(lambda: all(first.leadership().values()), timeout_s=10)
    assert set(leaders(names).values()) == {first.holder}


def test_roles_without_a_family_are_all_taken_by_the_first_runtime(runtimes, settings):
    """The control: without a family nothing defers, and the runtime started first leads every role."""
    settings.HARDCOUNT_LEASE_SPREAD_S = 1.5
    first = runtimes(*family_roles(None, 2))
    assert wait_until(lambda: all(first.leadership().values()), timeout_s=5)
    second = runtimes(*family_roles(None, 2))
    assert not wait_until(lambda: any(second.leadership().values()), timeout_s=3)
