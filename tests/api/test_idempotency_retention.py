"""Idempotency records past their retention are pruned in batches; keys still owed to a client never are.

Rows are moved in time through SQL on the database's clock (``now() - interval``), as the
pruning decides by PostgreSQL's ``now()``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, connections

from billing.models import Customer
from hardcount import idempotency
from hardcount.errors import Conflict
from hardcount.fencing import LeaseLost
from hardcount.models import IdempotencyRecord, Tenant
from tests.api.conftest import Api, make_keys
from tests.leases.helpers import Worker, wait_event_type, wait_until

FINGERPRINT = "f" * 64


@pytest.fixture
def tenant(db) -> Tenant:
    return Tenant.objects.create(name="Retention")


def record(tenant: Tenant, key: str, *, age: str, in_flight: bool = False) -> int:
    """Insert a record created ``age`` (a PostgreSQL interval) before the database's now(); returns its id."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO hardcount_idempotencyrecord"
            " (tenant_id, livemode, key, request_fingerprint, response_status, response_body, created_at, completed_at)"
            " VALUES (%(tenant)s, false, %(key)s, %(fp)s,"
            "  CASE WHEN %(in_flight)s THEN NULL ELSE 201 END,"
            "  CASE WHEN %(in_flight)s THEN NULL ELSE '\"{}\"'::jsonb END,"
            "  now() - %(age)s::interval, CASE WHEN %(in_flight)s THEN NULL ELSE now() - %(age)s::interval END)"
            " RETURNING id",
            {"tenant": tenant.pk, "key": key, "fp": FINGERPRINT, "in_flight": in_flight, "age": age},
        )
        return cursor.fetchone()[0]


def keys_left() -> set[str]:
    return set(IdempotencyRecord.objects.values_list("key", flat=True))


def test_default_retention_is_stripes_24_hours():
    assert idempotency.key_retention() == timedelta(hours=24)


def test_prune_removes_exactly_the_records_past_the_retention(tenant):
    record(tenant, "expired-completed", age="24 hours 1 second")
    record(tenant, "expired-long-ago", age="30 days")
    record(tenant, "expired-in-flight", age="25 hours", in_flight=True)
    record(tenant, "just-inside", age="23 hours 59 minutes")
    record(tenant, "an-hour-old", age="1 hour")
    record(tenant, "fresh", age="0 seconds")
    record(tenant, "stale-in-flight", age="6 minutes", in_flight=True)

    assert idempotency.prune_expired() == 3

    assert keys_left() == {"just-inside", "an-hour-old", "fresh", "stale-in-flight"}
    assert idempotency.prune_expired() == 0


def test_retention_setting_moves_the_boundary(tenant, settings):
    settings.HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS = 48
    record(tenant, "a-day-and-a-half", age="36 hours")
    record(tenant, "two-days-and-a-minute", age="48 hours 1 minute")

    assert idempotency.prune_expired() == 1

    assert keys_left() == {"a-day-and-a-half"}


def test_prune_works_through_more_than_one_batch(tenant):
    for n in range(25):
        record(tenant, f"old-{n}", age=f"{25 + n} hours")
    for n in range(3):
        record(tenant, f"kept-{n}", age="1 hour")
    batches: list[int] = []

    assert idempotency.prune_expired(batch_size=10, on_batch=batches.append) == 25

    assert batches == [10, 10, 5]
    assert keys_left() == {"kept-0", "kept-1", "kept-2"}


def test_an_exactly_full_last_batch_is_followed_by_an_empty_one(tenant):
    for n in range(20):
        record(tenant, f"old-{n}", age="2 days")
    batches: list[int] = []

    assert idempotency.prune_expired(batch_size=10, on_batch=batches.append) == 20

    assert batches == [10, 10, 0]
    assert keys_left() == set()


def test_an_in_flight_record_inside_the_crash_window_is_kept_whatever_the_retention(tenant):
    """Even with a retention shorter than the 5-minute window, a running request keeps its claim."""
    record(tenant, "completed-a-minute-ago", age="1 minute")
    record(tenant, "in-flight-a-minute-ago", age="1 minute", in_flight=True)
    record(tenant, "in-flight-4-minutes-ago", age="4 minutes 50 seconds", in_flight=True)
    record(tenant, "in-flight-6-minutes-ago", age="6 minutes", in_flight=True)

    assert idempotency.prune_expired(retention=timedelta(0)) == 2

    assert keys_left() == {"in-flight-a-minute-ago", "in-flight-4-minutes-ago"}


def test_negative_control_without_the_in_flight_guard_the_running_request_loses_its_claim(tenant):
    record(tenant, "in-flight-a-minute-ago", age="1 minute", in_flight=True)
    unguarded = idempotency._PRUNE_BATCH_SQL
    for guard in (
        "(completed_at IS NOT NULL OR created_at < now() - %(stale)s)",
        "(r.completed_at IS NOT NULL OR r.created_at < now() - %(stale)s)",
    ):
        assert guard in unguarded
        unguarded = unguarded.replace(guard, "true")
    with connection.cursor() as cursor:
        cursor.execute(unguarded, {"retention": timedelta(0), "stale": idempotency.IN_FLIGHT_STALE, "limit": 10})
        assert cursor.rowcount == 1


class StoppingFence:
    """A fence that passes its checks and turns not-alive after ``alive_for`` safe points."""

    token = 1

    def __init__(self, alive_for: int) -> None:
        self.alive_for = alive_for
        self.checks = 0

    def check(self) -> None:
        assert connection.in_atomic_block
        self.checks += 1

    def alive(self) -> bool:
        self.alive_for -= 1
        return self.alive_for >= 0


class LostFence:
    token = 1

    def check(self) -> None:
        raise LeaseLost("taken over")

    def alive(self) -> bool:
        return True


def test_each_batch_is_fenced_and_a_stop_ends_the_prune_between_batches(tenant):
    for n in range(25):
        record(tenant, f"old-{n}", age="2 days")
    fence = StoppingFence(alive_for=2)

    assert idempotency.prune_expired(fence=fence, batch_size=10) == 20

    assert fence.checks == 2
    assert len(keys_left()) == 5


def test_a_lost_lease_rolls_the_batch_back(tenant):
    record(tenant, "old", age="2 days")

    with pytest.raises(LeaseLost):
        idempotency.prune_expired(fence=LostFence())

    assert keys_left() == {"old"}


def test_batch_size_below_one_is_refused(tenant):
    with pytest.raises(ValueError):
        idempotency.prune_expired(batch_size=0)


def test_a_key_used_again_after_its_record_was_pruned_is_a_new_request(db):
    api = Api(make_keys("Pruned").test)
    key = {"Idempotency-Key": "order-7"}
    status, first = api.post("/v1/customers", {"email": "a@example.com"}, headers=key)
    assert status == 201
    with connection.cursor() as cursor:
        cursor.execute("UPDATE hardcount_idempotencyrecord SET created_at = now() - interval '25 hours'")
    assert idempotency.prune_expired() == 1

    status, second = api.post("/v1/customers", {"email": "a@example.com"}, headers=key)

    assert status == 201
    assert second["id"] != first["id"]
    assert Customer.objects.count() == 2
    status, replay = api.post("/v1/customers", {"email": "a@example.com"}, headers=key)
    assert (status, replay) == (201, second)


def test_a_request_taken_over_after_the_crash_window_cannot_drop_or_fill_its_successors_claim(tenant):
    """A slow request outlives its 5 minutes; a retry takes the key over; the slow one then ends."""
    claim = {"tenant_id": tenant.pk, "livemode": False, "key": "slow", "request_fingerprint": FINGERPRINT}
    slow = idempotency.begin(**claim)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE hardcount_idempotencyrecord SET created_at = now() - interval '6 minutes'")
    retry = idempotency.begin(**claim)
    assert isinstance(retry, idempotency.Claim)
    assert retry.record_id != slow.record_id

    idempotency.abandon(slow)  # e.g. the slow request ended in a validation error
    with pytest.raises(Conflict):
        idempotency.begin(**claim)  # the retry is still running: its duplicates get 409

    idempotency.complete(slow, status=201, content=b'{"from": "slow"}')
    with pytest.raises(Conflict):
        idempotency.begin(**claim)

    idempotency.complete(retry, status=201, content=b'{"from": "retry"}')
    replay = idempotency.begin(**claim)
    assert replay == idempotency.Replay(status=201, content=b'{"from": "retry"}')


@pytest.mark.django_db(transaction=True)
def test_a_record_being_taken_over_right_now_is_skipped_not_waited_on_and_survives(tenant):
    """A claim re-taking an expired key holds its row; the prune skips it instead of deleting the new claim."""
    record(tenant, "retaken", age="2 days")
    record(tenant, "other-old", age="2 days")
    claimer = connections.create_connection("default")
    claimer.set_autocommit(False)
    try:
        with claimer.cursor() as cursor:
            cursor.execute(
                idempotency._CLAIM_SQL,
                {
                    "tenant": tenant.pk,
                    "livemode": False,
                    "key": "retaken",
                    "fingerprint": FINGERPRINT,
                    "retention": idempotency.key_retention(),
                    "stale": idempotency.IN_FLIGHT_STALE,
                },
            )
            assert cursor.fetchone() is not None  # the expired record is taken over, not yet committed
        pruner = Worker(idempotency.prune_expired)
        assert wait_until(pruner.done, timeout_s=5), (
            f"the prune waited on the claim's row lock ({wait_event_type(pruner.pid)})"
        )
        pruner.join()
        assert pruner.error is None
        assert pruner.result == 1
        claimer.commit()
    finally:
        claimer.rollback()
        claimer.close()
    assert keys_left() == {"retaken"}
    assert idempotency.prune_expired() == 0
    assert IdempotencyRecord.objects.get(key="retaken").completed_at is None
