"""The delivery executor against real receivers on 127.0.0.1 and the real database (docs/reference/webhooks.md).

Time is moved by setting rows' timestamps (``fire_after``, ``claim_expires_at``,
``circuit_open_until``) to the database's ``now()``; waits are for conditions, never fixed.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from outbox import queries
from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
from outbox.signing import verify

from .conftest import Answer, assert_outbox_invariants, emit, make_endpoint, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def outbox_invariants_hold_afterwards(request, transactional_db):
    """After each test (executors stopped), the doctor's outbox checks pass."""
    yield
    if "terminal_write_failure" not in request.node.name:
        assert_outbox_invariants()


def _settled(*ids):
    rows = list(Delivery.objects.filter(id__in=ids) if ids else Delivery.objects.all())
    return rows and all(d.status in ("succeeded", "failed") for d in rows)


def test_every_event_reaches_every_subscribed_endpoint_signed(tenant_t, receiver, make_executor):
    from hardcount.models import Tenant

    everything = make_endpoint(tenant_t, receiver.url("/all"), ["*"])
    invoices = make_endpoint(tenant_t, receiver.url("/invoices"), ["invoice.*"])
    customers = make_endpoint(tenant_t, receiver.url("/customers"), ["customer.created"])
    make_endpoint(tenant_t, receiver.url("/disabled"), ["*"], enabled=False)
    make_endpoint(tenant_t, receiver.url("/live"), ["*"], livemode=True)
    make_endpoint(Tenant.objects.create(name="Other"), receiver.url("/other"), ["*"])

    events = [
        emit(tenant_t, t) for t in ("customer.created", "invoice.created", "invoice.paid", "subscription.created")
    ]
    make_executor()
    wait_until(_settled, what="all deliveries settled")

    assert Delivery.objects.filter(status="succeeded").count() == 4 + 2 + 1
    got = {(r.path, r.json["id"]) for r in receiver.received()}
    ids = [e.id for e in events]
    assert got == {("/all", i) for i in ids} | {("/invoices", ids[1]), ("/invoices", ids[2])} | {("/customers", ids[0])}
    secrets = {"/all": everything.secret, "/invoices": invoices.secret, "/customers": customers.secret}
    for r in receiver.received():
        verify(r.body, r.headers["hardcount-signature"], secrets[r.path])
        body = r.json
        event = next(e for e in events if e.id == body["id"])
        assert body["type"] == event.type
        assert body["livemode"] is False
        assert body["sequence"] == event.sequence
        assert body["data"] == {"id": "cus_test"}
        assert body["created"].endswith("Z")
        assert r.headers["hardcount-event-id"] == event.id
    for attempt in DeliveryAttempt.objects.all():
        assert (attempt.number, attempt.outcome, attempt.status_code) == (1, "succeeded", 200)
        assert attempt.response_excerpt == "ok"
        assert attempt.latency_ms is not None


@pytest.mark.parametrize("answer_headers, connections", [({}, 1), ({"Connection": "close"}, 5)])
def test_deliveries_to_an_endpoint_reuse_a_kept_alive_connection(
    tenant_t, receiver, make_executor, answer_headers, connections
):
    """One worker, five deliveries: one connection, unless the receiver closes it after each answer (the control)."""
    receiver.behave("/hook", lambda r, n: Answer(headers=answer_headers))
    make_endpoint(tenant_t, receiver.url("/hook"))
    for _ in range(5):
        emit(tenant_t)
    make_executor(workers=1)
    wait_until(_settled, what="all deliveries settled")

    assert Delivery.objects.filter(status="succeeded").count() == 5
    received = receiver.received("/hook")
    assert len(received) == 5
    assert len({r.peer for r in received}) == connections


def test_a_receivers_cookies_are_never_sent_back(tenant_t, receiver, make_executor):
    """The client is shared by every tenant's endpoints: a cookie one receiver sets goes nowhere."""
    receiver.behave("/a", lambda r, n: Answer(headers={"Set-Cookie": "sid=tenant-a; Path=/"}))
    make_endpoint(tenant_t, receiver.url("/a"))
    make_endpoint(tenant_t, receiver.url("/b"))
    emit(tenant_t)
    make_executor(workers=1)
    wait_until(_settled, what="the first deliveries settled")
    emit(tenant_t)
    wait_until(lambda: Delivery.objects.filter(status="succeeded").count() == 4, what="the second deliveries")

    assert len(receiver.received()) == 4
    assert [r.headers.get("cookie") for r in receiver.received()] == [None] * 4


def test_two_executors_racing_never_deliver_or_record_one_delivery_twice(tenant_t, receiver, make_executor):
    for i in range(3):
        make_endpoint(tenant_t, receiver.url(f"/r{i}"), ["*"])
    for _ in range(30):
        emit(tenant_t)
    first, second = make_executor(workers=4), make_executor(workers=4)
    wait_until(_settled, timeout_s=30, what="90 deliveries settled")

    assert Delivery.objects.filter(status="succeeded").count() == 90
    per_delivery = [r.headers["hardcount-delivery-id"] for r in receiver.received()]
    assert len(per_delivery) == 90 and len(set(per_delivery)) == 90
    assert DeliveryAttempt.objects.count() == 90
    assert first.stats["succeeded"] + second.stats["succeeded"] == 90
    assert first.stats["claimed"] > 0 and second.stats["claimed"] > 0


def test_failing_receiver_gets_at_most_eight_attempts_then_the_delivery_fails(tenant_t, receiver, make_executor):
    receiver.behave("/fail", lambda r, n: Answer(500, b"boom"))
    endpoint = make_endpoint(tenant_t, receiver.url("/fail"))
    emit(tenant_t)
    delivery = Delivery.objects.get()
    make_executor(breaker_threshold=100)

    delays = []
    for attempt in range(1, 9):
        wait_until(
            lambda a=attempt: (
                Delivery.objects.filter(id=delivery.id, attempts=a, claimed_by__isnull=True)
                .exclude(status="pending")
                .first()
            ),
            what=f"attempt {attempt} recorded",
        )
        d = Delivery.objects.get(id=delivery.id)
        if attempt < 8:
            assert d.status == "retrying"
            row = DeliveryAttempt.objects.get(delivery=d, number=attempt)
            delays.append((d.fire_after - row.created_at).total_seconds())
            Delivery.objects.filter(id=d.id).update(fire_after=Now())  # move time to the retry
    d = Delivery.objects.get(id=delivery.id)
    assert d.status == "failed" and d.attempts == 8
    assert "gave up after 8 attempts" in d.last_error
    rows = list(DeliveryAttempt.objects.filter(delivery=d).order_by("number"))
    assert [(a.number, a.outcome, a.status_code, a.response_excerpt) for a in rows] == [
        (n, "retryable", 500, "boom") for n in range(1, 9)
    ]
    assert len(receiver.received("/fail")) == 8
    assert [r.headers["hardcount-attempt"] for r in receiver.received("/fail")] == [str(n) for n in range(1, 9)]
    # Each attempt is signed when it is sent, so a receiver with a tight tolerance accepts
    # every retry however late it comes, and the event id never changes.
    for r in receiver.received("/fail"):
        verify(r.body, r.headers["hardcount-signature"], endpoint.secret, tolerance_s=5, now=r.wall)
    assert {r.json["id"] for r in receiver.received("/fail")} == {d.event_id}
    # Backoff with jitter: each wait within ±20 % of the schedule (and growing).
    from outbox.executor import RETRY_SCHEDULE_S

    for got, base in zip(delays, RETRY_SCHEDULE_S, strict=True):
        assert base * 0.8 - 1 <= got <= base * 1.2 + 1
    endpoint.refresh_from_db()
    assert endpoint.consecutive_failures == 8

    # A failed delivery is out of the queue: however far time moves, nothing claims it.
    Delivery.objects.filter(id=d.id).update(fire_after=Now() - timedelta(days=1))
    with connection.cursor() as cursor:
        cursor.execute(queries.CLAIM_DUE, {"limit": 10, "executor": "probe", "lease_s": 10.0})
        assert cursor.fetchall() == []


def test_permanent_4xx_fails_after_one_attempt(tenant_t, receiver, make_executor):
    receiver.behave("/bad", lambda r, n: Answer(400, b"unknown event"))
    make_endpoint(tenant_t, receiver.url("/bad"))
    emit(tenant_t)
    make_executor()
    wait_until(_settled, what="delivery failed")
    d = Delivery.objects.get()
    assert (d.status, d.attempts, d.last_error) == ("failed", 1, "HTTP 400")
    assert DeliveryAttempt.objects.get().outcome == "failed"


def test_410_disables_the_endpoint_and_later_deliveries_fail_without_a_request(tenant_t, receiver, make_executor):
    receiver.behave("/gone", lambda r, n: Answer(410, b"gone"))
    endpoint = make_endpoint(tenant_t, receiver.url("/gone"))
    emit(tenant_t)
    make_executor(workers=1)
    wait_until(_settled, what="first delivery failed")
    endpoint.refresh_from_db()
    assert endpoint.enabled is False and "410" in endpoint.disabled_reason

    # A delivery created before the endpoint was disabled (queued behind the first).
    later = Delivery.objects.create(event=emit(tenant_t), endpoint=endpoint)
    wait_until(lambda: _settled(later.id), what="queued delivery failed")
    later.refresh_from_db()
    assert later.status == "failed" and later.attempts == 0 and "disabled" in later.last_error
    assert len(receiver.received("/gone")) == 1


def test_429_with_retry_after_waits_at_least_that_long(tenant_t, receiver, make_executor):
    receiver.behave("/busy", lambda r, n: Answer(429, b"slow down", {"Retry-After": "3600"}))
    make_endpoint(tenant_t, receiver.url("/busy"))
    emit(tenant_t)
    make_executor()
    d = wait_until(lambda: Delivery.objects.filter(status="retrying").first(), what="retry scheduled")
    attempt = DeliveryAttempt.objects.get(delivery=d)
    assert 3599 <= (d.fire_after - attempt.created_at).total_seconds() <= 3601


def test_hanging_receiver_times_out_and_is_retried(tenant_t, receiver, make_executor):
    release = __import__("threading").Event()
    receiver.behave("/hang", lambda r, n: Answer(hang=release) if n == 1 else Answer())
    make_endpoint(tenant_t, receiver.url("/hang"))
    emit(tenant_t)
    try:
        make_executor(timeout_s=1.0, renew_interval_s=0.1)
        d = wait_until(lambda: Delivery.objects.filter(status="retrying").first(), what="timeout recorded")
        attempt = DeliveryAttempt.objects.get(delivery=d)
        assert attempt.outcome == "retryable" and attempt.status_code is None
        assert "timed out after 1 s" in attempt.error
        assert attempt.latency_ms >= 950
        Delivery.objects.filter(id=d.id).update(fire_after=Now())
        wait_until(lambda: _settled(d.id), what="second attempt succeeded")
        assert Delivery.objects.get(id=d.id).status == "succeeded"
    finally:
        release.set()


def test_lease_lost_mid_request_cancels_it_and_discards_the_result(tenant_t, receiver, make_executor):
    import threading

    release = threading.Event()
    receiver.behave("/hang", lambda r, n: Answer(hang=release) if n == 1 else Answer())
    make_endpoint(tenant_t, receiver.url("/hang"))
    emit(tenant_t)
    d = Delivery.objects.get()
    try:
        executor = make_executor(timeout_s=5.0, renew_interval_s=0.05)
        receiver.wait_for(1, "/hang")
        first_claim = Delivery.objects.get(id=d.id).claimed_by
        assert first_claim.startswith("test-0/")
        # Another replica's clock says the lease is over: expire it in the database.
        Delivery.objects.filter(id=d.id).update(claim_expires_at=Now() - timedelta(seconds=1))
        wait_until(lambda: executor.stats["lease_lost"] >= 1, what="executor noticed the lost lease")
        wait_until(lambda: _settled(d.id), what="re-delivered under a new claim")
    finally:
        release.set()  # the first request now answers 200, to a cancelled client
    d.refresh_from_db()
    assert d.status == "succeeded" and d.attempts == 2
    rows = list(DeliveryAttempt.objects.filter(delivery=d).order_by("number"))
    assert [(a.number, a.outcome) for a in rows] == [(1, "lease_lost"), (2, "succeeded")]
    assert first_claim in rows[0].error
    assert [r.json["id"] for r in receiver.received("/hang")] == [d.event_id, d.event_id]  # same event id


def test_terminal_write_failure_drives_the_delivery_to_failed(tenant_t, receiver, make_executor):
    make_endpoint(tenant_t, receiver.url("/ok"))
    emit(tenant_t)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION test_refuse_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'attempt table unavailable'; END $$;
            CREATE TRIGGER test_refuse_attempts BEFORE INSERT ON outbox_deliveryattempt
                FOR EACH ROW EXECUTE FUNCTION test_refuse_attempts();
            """
        )
    try:
        executor = make_executor()
        # The executor counts the forced write after it committed: wait for the count too, or a
        # loaded machine reads the row before the counter moves.
        wait_until(
            lambda: _settled() and executor.stats["forced_failed"] == 1, what="delivery driven to failed, and counted"
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER test_refuse_attempts ON outbox_deliveryattempt;")
            cursor.execute("DROP FUNCTION test_refuse_attempts();")
    d = Delivery.objects.get()
    assert d.status == "failed" and d.claimed_by is None
    assert d.last_error.startswith("terminal write failed") and "attempt table unavailable" in d.last_error
    assert executor.stats["forced_failed"] == 1
    assert DeliveryAttempt.objects.count() == 0
    assert len(receiver.received("/ok")) == 1


def test_open_circuit_defers_deliveries_without_spending_attempts(tenant_t, receiver, make_executor):
    endpoint = make_endpoint(tenant_t, receiver.url("/ok"), consecutive_failures=5)
    WebhookEndpoint.objects.filter(id=endpoint.id).update(circuit_open_until=Now() + timedelta(hours=1))
    for _ in range(3):
        emit(tenant_t)
    executor = make_executor()
    wait_until(lambda: executor.stats["deferred"] >= 3, what="three deferrals")
    endpoint.refresh_from_db()
    for d in Delivery.objects.all():
        assert d.status == "pending" and d.attempts == 0 and d.claimed_by is None
        assert d.fire_after >= endpoint.circuit_open_until
    assert receiver.received() == []
    assert DeliveryAttempt.objects.count() == 0

    # The cool-down ends (half-open): one probe goes out; its success closes the circuit and
    # pulls the deferred deliveries in.
    WebhookEndpoint.objects.filter(id=endpoint.id).update(circuit_open_until=Now() - timedelta(seconds=1))
    Delivery.objects.filter(id=Delivery.objects.order_by("created_at").first().id).update(fire_after=Now())
    wait_until(lambda: Delivery.objects.filter(status="succeeded").count() == 3, what="all delivered after probe")
    endpoint.refresh_from_db()
    assert endpoint.consecutive_failures == 0 and endpoint.circuit_open_until is None
    assert sorted(a.number for a in DeliveryAttempt.objects.all()) == [1, 1, 1]
    assert len(receiver.received("/ok")) == 3


def test_consecutive_failures_open_the_circuit(tenant_t, receiver, make_executor):
    receiver.behave("/fail", lambda r, n: Answer(503))
    endpoint = make_endpoint(tenant_t, receiver.url("/fail"))
    for _ in range(5):
        emit(tenant_t)
    executor = make_executor(workers=1, breaker_threshold=3, breaker_cooldown_s=600)
    wait_until(lambda: executor.stats["deferred"] >= 2, what="remaining deliveries deferred")
    endpoint.refresh_from_db()
    assert endpoint.consecutive_failures == 3
    assert endpoint.circuit_open_until is not None
    assert len(receiver.received("/fail")) == 3
    assert sorted(d.attempts for d in Delivery.objects.all()) == [0, 0, 1, 1, 1]


def test_failed_probe_reopens_the_circuit_for_longer(tenant_t, receiver, make_executor):
    receiver.behave("/fail", lambda r, n: Answer(500))
    endpoint = make_endpoint(tenant_t, receiver.url("/fail"), consecutive_failures=3)
    WebhookEndpoint.objects.filter(id=endpoint.id).update(circuit_open_until=Now() - timedelta(seconds=1))
    emit(tenant_t)
    emit(tenant_t)
    executor = make_executor(workers=2, breaker_threshold=3, breaker_cooldown_s=60)
    wait_until(lambda: DeliveryAttempt.objects.count() == 1 and executor.stats["deferred"] >= 1, what="probe")
    endpoint.refresh_from_db()
    assert endpoint.consecutive_failures == 4
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM circuit_open_until - now()) FROM outbox_webhookendpoint")
        remaining = float(cursor.fetchone()[0])
    assert 110 <= remaining <= 120  # 60 s doubled once
    assert len(receiver.received("/fail")) == 1


def test_executor_never_claims_more_than_its_idle_workers(tenant_t, receiver, make_executor):
    import threading

    release = threading.Event()
    receiver.behave("/hang", lambda r, n: Answer(hang=release))
    make_endpoint(tenant_t, receiver.url("/hang"))
    for _ in range(5):
        emit(tenant_t)
    try:
        executor = make_executor(workers=2, timeout_s=10.0)
        receiver.wait_for(2, "/hang")
        # Both workers are busy: for ten poll intervals nothing more is claimed or sent.
        for _ in range(10):
            assert Delivery.objects.filter(claimed_by__isnull=False).count() == 2
            assert len(receiver.received("/hang")) == 2
            time.sleep(0.05)  # observing that nothing happens for one poll interval
        assert executor.stats["claimed"] == 2
    finally:
        release.set()
    wait_until(lambda: Delivery.objects.filter(status="succeeded").count() == 5, what="all five delivered")


def test_inserted_deliveries_wake_an_idle_executor_without_waiting_for_the_poll(tenant_t, receiver, make_executor):
    make_endpoint(tenant_t, receiver.url("/ok"))
    make_executor(poll_interval_s=60.0)
    emit(tenant_t)  # commits a delivery: the insert trigger NOTIFYs outbox_delivery
    # Generous bounds for a loaded machine, still far below the 60 s poll.
    receiver.wait_for(1, "/ok", timeout_s=20)
    wait_until(_settled, timeout_s=20, what="delivered long before the 60 s poll")


def test_answer_arriving_after_the_claim_was_taken_over_is_discarded(tenant_t, receiver, make_executor):
    from django.db import connections

    def taken_over_while_answering(r, n):
        # Another executor reclaims the row while this request is in flight; then we answer 200.
        Delivery.objects.filter(id=r.headers["hardcount-delivery-id"]).update(
            claimed_by="other-replica/claim", claim_expires_at=Now() + timedelta(minutes=5), attempts=2
        )
        connections.close_all()
        return Answer(200, b"ok")

    receiver.behave("/hook", taken_over_while_answering)
    make_endpoint(tenant_t, receiver.url("/hook"))
    emit(tenant_t)
    executor = make_executor(renew_interval_s=30.0)  # the renewer does not get a say: the write is refused
    wait_until(lambda: executor.stats["lease_lost"] == 1, what="the finishing write refused")
    d = Delivery.objects.get()
    assert (d.status, d.claimed_by, d.attempts) == ("pending", "other-replica/claim", 2)
    assert DeliveryAttempt.objects.count() == 0
    assert executor.stats["succeeded"] == 0
    # The imaginary other replica hands the row back (after ours has stopped), so the doctor's
    # checks at the end see a consistent queue.
    executor.stop()
    Delivery.objects.filter(id=d.id).update(claimed_by=None, claim_expires_at=None, attempts=0)


@pytest.mark.parametrize(("configured", "expected"), [(None, "off"), (False, "off"), (True, "on")])
def test_the_executors_sessions_commit_without_waiting_for_the_flush_unless_configured(
    transactional_db, settings, configured, expected
):
    import asyncio
    import functools

    import psycopg

    from outbox import executor as executor_module

    if configured is not None:
        settings.HARDCOUNT_DELIVERY_SYNCHRONOUS_COMMIT = configured
    else:
        del settings.HARDCOUNT_DELIVERY_SYNCHRONOUS_COMMIT  # the default
    config = executor_module.ExecutorConfig.from_settings()

    async def session_setting() -> str:
        async with await psycopg.AsyncConnection.connect(
            executor_module.conninfo_from_django(), autocommit=True
        ) as conn:
            configure = functools.partial(
                executor_module._configure_connection, synchronous_commit=config.synchronous_commit
            )
            await configure(conn)
            return (await (await conn.execute("SHOW synchronous_commit")).fetchone())[0]

    assert asyncio.run(session_setting()) == expected
