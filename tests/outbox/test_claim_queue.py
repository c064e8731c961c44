"""The claim queue's SQL guarantees, statement by statement, on two real connections' worth of claims.

These drive ``outbox.queries`` directly (no HTTP) so each guarantee is shown by the
database refusing or accepting one write: a stale claimant's writes match no row.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from outbox import queries
from outbox.loops import purge_delivered, reap_expired_claims
from outbox.models import Delivery, DeliveryAttempt

from .conftest import emit, make_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def claim(executor: str, limit: int = 10) -> list[dict]:
    with connection.cursor() as cursor:
        cursor.execute(queries.CLAIM_DUE, {"limit": limit, "executor": executor, "lease_s": 20.0})
        names = [c.name for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def write(sql: str, **params) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def expire(delivery_id: str) -> None:
    Delivery.objects.filter(id=delivery_id).update(claim_expires_at=Now() - timedelta(seconds=1))


@pytest.fixture
def delivery(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    emit(tenant_t)
    return Delivery.objects.get()


def test_claim_takes_a_due_delivery_once_and_spends_an_attempt(delivery):
    (row,) = claim("a")
    assert row["id"] == delivery.id and row["attempts"] == 1 and row["prev_attempts"] == 0
    assert row["claimed_by"].startswith("a/")
    assert claim("b") == []  # held: nobody else gets it


def test_claim_never_takes_more_than_the_limit(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    for _ in range(5):
        emit(tenant_t)
    assert len(claim("a", limit=2)) == 2
    assert len(claim("b", limit=10)) == 3


def test_claim_skips_deliveries_not_yet_due(delivery):
    Delivery.objects.filter(id=delivery.id).update(fire_after=Now() + timedelta(seconds=30))
    assert claim("a") == []


def test_stale_claimant_cannot_record_success_after_a_reclaim(delivery):
    (a,) = claim("a")
    expire(delivery.id)
    (b,) = claim("b")
    assert b["attempts"] == 2 and b["lost_claim"] == a["claimed_by"]
    assert write(queries.RECORD_SUCCEEDED, id=delivery.id, claim=a["claimed_by"]) is False
    assert write(queries.RECORD_SUCCEEDED, id=delivery.id, claim=b["claimed_by"]) is True
    assert write(queries.RECORD_SUCCEEDED, id=delivery.id, claim=b["claimed_by"]) is False  # not twice either


def test_replica_reclaiming_its_own_expired_claim_holds_a_new_claim(delivery):
    (first,) = claim("same-replica")
    expire(delivery.id)
    (second,) = claim("same-replica")
    assert first["claimed_by"] != second["claimed_by"]
    assert write(queries.RECORD_RETRY, id=delivery.id, claim=first["claimed_by"], error="x", delay_s=1.0) is False


def test_expired_claim_refuses_every_write_even_before_anyone_reclaims(delivery):
    (a,) = claim("a")
    expire(delivery.id)
    c = a["claimed_by"]
    assert write(queries.RECORD_SUCCEEDED, id=delivery.id, claim=c) is False
    assert write(queries.RECORD_FAILED, id=delivery.id, claim=c, attempts=1, error="x") is False
    assert write(queries.RECORD_RETRY, id=delivery.id, claim=c, error="x", delay_s=1.0) is False
    assert write(queries.DEFER, id=delivery.id, claim=c, attempts=0, jitter_s=0.0) is False
    assert write(queries.RELEASE, id=delivery.id, claim=c, attempts=0) is False


def test_renewal_extends_live_claims_but_never_resurrects_an_expired_one(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    emit(tenant_t)
    emit(tenant_t)
    live, dead = claim("a")
    expire(dead["id"])
    with connection.cursor() as cursor:
        cursor.execute(queries.RENEW_CLAIMS, {"claims": [live["claimed_by"], dead["claimed_by"]], "lease_s": 20.0})
        assert [r[0] for r in cursor.fetchall()] == [live["claimed_by"]]


def test_release_and_defer_hand_the_attempt_back(delivery):
    (a,) = claim("a")
    assert write(queries.RELEASE, id=delivery.id, claim=a["claimed_by"], attempts=a["prev_attempts"]) is True
    d = Delivery.objects.get()
    assert (d.attempts, d.claimed_by, d.status) == (0, None, "pending")
    (b,) = claim("b")
    assert write(queries.DEFER, id=delivery.id, claim=b["claimed_by"], attempts=b["prev_attempts"], jitter_s=0.0)
    assert Delivery.objects.get().attempts == 0


def test_attempts_are_clamped_to_eight(delivery):
    Delivery.objects.filter(id=delivery.id).update(attempts=8, status="retrying")
    (a,) = claim("a")
    assert a["attempts"] == 8 and a["prev_attempts"] == 8


def test_reaper_requeues_expired_leases_with_evidence_of_the_lost_attempt(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    for _ in range(3):
        emit(tenant_t)
    expired, renewed, last = claim("dead-replica")
    for row in (expired, last):
        expire(row["id"])
    Delivery.objects.filter(id=last["id"]).update(attempts=8)

    assert reap_expired_claims(reaper_id="reaper-1") == 2

    d = Delivery.objects.get(id=expired["id"])
    assert (d.status, d.claimed_by, d.claim_expires_at, d.attempts) == ("retrying", None, None, 1)
    attempt = DeliveryAttempt.objects.get(delivery=d)
    assert (attempt.number, attempt.outcome, attempt.executor) == (1, "lease_lost", "reaper-1")
    assert expired["claimed_by"] in attempt.error
    assert Delivery.objects.get(id=renewed["id"]).claimed_by == renewed["claimed_by"]  # live lease untouched
    final = Delivery.objects.get(id=last["id"])
    assert final.status == "failed" and final.completed_at is not None
    assert DeliveryAttempt.objects.get(delivery=final).number == 8
    assert reap_expired_claims() == 0  # idempotent


def test_claim_of_an_expired_lease_records_the_lost_attempt(delivery):
    # The executor's own claim path, not only the reaper, leaves evidence for a vanished attempt.
    (a,) = claim("a")
    expire(delivery.id)
    from outbox.executor import lost_attempt_params

    (b,) = claim("b")
    with connection.cursor() as cursor:
        cursor.execute(
            queries.INSERT_ATTEMPT,
            lost_attempt_params(
                delivery_id=b["id"], lost_claim=b["lost_claim"], number=b["prev_attempts"], recorded_by="b"
            ),
        )
    attempt = DeliveryAttempt.objects.get()
    assert attempt.number == 1 and attempt.outcome == "lease_lost" and a["claimed_by"] in attempt.error


def test_retention_removes_old_succeeded_deliveries_and_their_attempts_only(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    for _ in range(4):
        emit(tenant_t)
    old_ok, new_ok, old_failed, pending = Delivery.objects.order_by("created_at")
    Delivery.objects.filter(id=old_ok.id).update(status="succeeded", completed_at=Now() - timedelta(days=31))
    Delivery.objects.filter(id=new_ok.id).update(status="succeeded", completed_at=Now() - timedelta(days=29))
    Delivery.objects.filter(id=old_failed.id).update(status="failed", completed_at=Now() - timedelta(days=90))
    DeliveryAttempt.objects.create(delivery=old_ok, number=1, outcome="succeeded", status_code=200)
    replay = Delivery.objects.create(event=old_ok.event, endpoint=old_ok.endpoint, replay_of=old_ok)

    assert purge_delivered(retention_days=30, batch=1) == 1

    assert set(Delivery.objects.values_list("id", flat=True)) == {new_ok.id, old_failed.id, pending.id, replay.id}
    assert DeliveryAttempt.objects.count() == 0
    assert Delivery.objects.get(id=replay.id).replay_of_id is None


def claim_recording_lost(executor: str, limit: int = 10) -> list[dict]:
    from hardcount.ids import new_id

    params = {
        "limit": limit,
        "executor": executor,
        "lease_s": 20.0,
        "attempt_ids": [new_id("wha") for _ in range(limit)],
    }
    with connection.cursor() as cursor:
        cursor.execute(queries.CLAIM_DUE_RECORDING_LOST, params)
        names = [c.name for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def test_the_executors_claim_records_the_lost_attempt_in_the_same_statement(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    emit(tenant_t)
    emit(tenant_t)
    first = {r["id"]: r for r in claim_recording_lost("a")}
    assert DeliveryAttempt.objects.count() == 0  # a first claim loses nothing
    expired_id = sorted(first)[0]
    expire(expired_id)
    (again,) = claim_recording_lost("b")
    assert (
        again["id"] == expired_id and again["attempts"] == 2 and again["lost_claim"] == first[expired_id]["claimed_by"]
    )
    attempt = DeliveryAttempt.objects.get()
    assert (attempt.delivery_id, attempt.number, attempt.outcome, attempt.executor) == (
        expired_id,
        1,
        "lease_lost",
        "b",
    )
    assert first[expired_id]["claimed_by"] in attempt.error and attempt.id.startswith("wha_")


def record(rows: list[dict], *, threshold: int = 3) -> dict:
    """RECORD_OUTCOMES for ``rows`` (each a claim row from ``claim`` plus what to write)."""
    from hardcount.ids import new_id

    columns = {
        "ids": [r["id"] for r in rows],
        "claims": [r["claimed_by"] for r in rows],
        "statuses": [r["status"] for r in rows],
        "attempts": [r.get("set_attempts") for r in rows],
        "errors": [r.get("error", "") for r in rows],
        "delays_s": [r.get("delay_s", 0.0) for r in rows],
        "attempt_ids": [new_id("wha") if r.get("outcome") else None for r in rows],
        "numbers": [r["attempts"] if r.get("outcome") else None for r in rows],
        "outcomes": [r.get("outcome") for r in rows],
        "status_codes": [r.get("status_code") for r in rows],
        "latencies_ms": [5 if r.get("outcome") else None for r in rows],
        "attempt_errors": [r.get("error", "") if r.get("outcome") else None for r in rows],
        "excerpts": ["ok" if r.get("outcome") else None for r in rows],
        "endpoint_ids": [r["endpoint_id"] for r in rows],
        "effects": [r.get("effect") for r in rows],
    }
    params = {**columns, "executor": "a", "threshold": threshold, "base_s": 60.0, "max_s": 3600.0}
    with connection.cursor() as cursor:
        cursor.execute(queries.RECORD_OUTCOMES, params)
        recorded, closed = cursor.fetchone()
    return {"recorded": set(recorded), "closed": set(closed)}


def test_a_batch_writes_the_claims_still_held_and_nothing_of_a_lost_one(tenant_t):
    from outbox.models import WebhookEndpoint

    endpoint = make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    for _ in range(4):
        emit(tenant_t)
    ok, retry, failed, lost = claim("a")
    expire(lost["id"])  # its lease ran out: the batch must not write it, its attempt or its failure
    written = record(
        [
            {**ok, "status": "succeeded", "outcome": "succeeded", "status_code": 200, "effect": "reset"},
            {**retry, "status": "retrying", "outcome": "retryable", "status_code": 500, "error": "HTTP 500",
             "delay_s": 60.0, "effect": "fail"},
            {**failed, "status": "failed", "set_attempts": 0, "error": "endpoint disabled"},
            {**lost, "status": "retrying", "outcome": "retryable", "status_code": 503, "error": "HTTP 503",
             "delay_s": 60.0, "effect": "fail"},
        ]
    )  # fmt: skip
    assert written["recorded"] == {ok["id"], retry["id"], failed["id"]}
    rows = {d.id: d for d in Delivery.objects.all()}
    assert (rows[ok["id"]].status, rows[ok["id"]].claimed_by, rows[ok["id"]].last_error) == ("succeeded", None, "")
    assert rows[ok["id"]].completed_at is not None
    assert (rows[retry["id"]].status, rows[retry["id"]].attempts, rows[retry["id"]].completed_at) == (
        "retrying",
        1,
        None,
    )
    assert (rows[failed["id"]].status, rows[failed["id"]].attempts) == ("failed", 0)  # no request: attempt handed back
    assert (rows[lost["id"]].status, rows[lost["id"]].claimed_by) == ("pending", lost["claimed_by"])  # untouched
    assert sorted((a.delivery_id, a.outcome) for a in DeliveryAttempt.objects.all()) == sorted(
        [(ok["id"], "succeeded"), (retry["id"], "retryable")]
    )
    # One failure counted after the success: the lost claim's failure is not.
    assert WebhookEndpoint.objects.get(id=endpoint.id).consecutive_failures == 1
    assert record([{**ok, "status": "succeeded"}])["recorded"] == set()  # not twice either


def test_a_batch_adds_up_endpoint_effects_as_one_by_one_writes_would(tenant_t):

    flaky = make_endpoint(tenant_t, "http://127.0.0.1:9/flaky", consecutive_failures=2)
    gone = make_endpoint(tenant_t, "http://127.0.0.1:9/gone")
    emit(tenant_t)
    emit(tenant_t)
    emit(tenant_t)
    rows = claim("a")
    by_endpoint = {}
    for r in rows:
        by_endpoint.setdefault(r["endpoint_id"], []).append(r)
    f1, f2, f3 = by_endpoint[flaky.id]
    (g,) = by_endpoint[gone.id][:1]
    failure = {"status": "retrying", "outcome": "retryable", "status_code": 500, "delay_s": 60.0, "effect": "fail"}
    written = record(
        [
            {**f1, "status": "succeeded", "outcome": "succeeded", "status_code": 200, "effect": "reset"},
            {**f2, **failure},
            {**f3, **failure},
            {**g, "status": "failed", "outcome": "failed", "status_code": 410, "error": "HTTP 410", "effect": "gone"},
        ],
        threshold=2,
    )
    assert len(written["recorded"]) == 4 and written["closed"] == set()
    flaky.refresh_from_db()
    gone.refresh_from_db()
    # Reset by the success, then two failures: at the threshold of 2 the circuit opens.
    assert flaky.consecutive_failures == 2 and flaky.circuit_open_until is not None
    assert (gone.enabled, gone.disabled_reason) == (False, f"receiver answered 410 Gone to delivery {g['id']}")
    assert gone.consecutive_failures == 0

    # A success on an endpoint with failures closes its circuit, and says so; a healthy one is not written.
    for r in by_endpoint[gone.id][1:]:
        Delivery.objects.filter(id=r["id"]).update(claimed_by=None, claim_expires_at=None)
    Delivery.objects.filter(id=f2["id"]).update(status="pending", fire_after=Now())
    (again,) = [r for r in claim("b") if r["id"] == f2["id"]]
    written = record([{**again, "status": "succeeded", "outcome": "succeeded", "status_code": 200, "effect": "reset"}])
    assert written["closed"] == {flaky.id}
    flaky.refresh_from_db()
    assert flaky.consecutive_failures == 0 and flaky.circuit_open_until is None
