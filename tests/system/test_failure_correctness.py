"""Correctness under failure (docs/reference/guarantees.md): kill it anywhere, race it, nothing lost or billed twice.

Every experiment runs real processes against one PostgreSQL and the real ``stripe`` library
talking to localstripe through the fault-injecting, idempotency-keeping proxy
(devstack/strict_stripe.py); after each, the money-invariant sweep (``manage.py doctor``'s checks)
must find nothing. Each prints a line of the report table (``make correctness`` collects them
into docs/benchmarks/failure-correctness.md's table).

1. Kill sweep: a book of N = 40 due subscriptions (paying, declining and gateway-failing
   cards); a ``runscheduler`` leader SIGKILLed at every kill point k = 1 … N-1, chosen by
   watching the database (odd k: the k-th invoice committed; even k: the k-th close
   recorded), a successor finishing the drain; a fresh book per kill point.
2. Kill points inside one close (``tests/system/faults.py``): after the invoice commit, after
   the gateway answered but before it is recorded, inside the record transaction; for each
   card kind.
3. Four drain processes racing on one due set with page size 1; at least two must bill.
4. The negative control: the same race with the unique index ``invoice_one_per_period``
   dropped must bill periods twice (and the doctor must see it); the index is restored.
5. Webhook executors (``runscheduler`` replicas running the delivery executor) SIGKILLed
   mid-delivery while receivers hang, fail and dawdle: every event reaches every subscribed
   endpoint, none is recorded succeeded twice, none takes more than 8 attempts.

A dead leader's lease, a dead executor's claims and a dead close's in-flight payment window
are expired by updating their rows, not waited out (the TTL takeover itself is measured in
tests/system/test_scheduler_processes.py).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now

from billing.models import Invoice, PaymentAttempt
from tests.billing.conftest import STRIPE_KEY, Book
from tests.system.correctness import (
    DECLINING,
    FAILING,
    PAYING,
    Audit,
    Replicas,
    ReportRow,
    age_unknown_attempts,
    assert_clean,
    assert_gateway_agrees,
    audit_book,
    billing_env,
    closes_recorded,
    doctor_violations,
    gateway_requests,
    invoices_of,
    record_row,
    seed_book,
    wait_until,
)
from tests.system.faults import arm
from tests.system.harness import BASE_DIR, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    # The stripe library hands httpx bytes as data= (tests/billing/conftest.py ignores it there too).
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

SWEEP_SIZE = 40
# Each book of the sweep holds one page (4) more than its kill points reach: the page close records a page's
# successes and declines in one transaction, so a kill point inside the book's last page would otherwise be
# reached only as the drain ends.
SWEEP_BOOK = SWEEP_SIZE + 4


def take_over(pool: Replicas, dead, standby_future):
    """The dead leader's lease is expired; the standby takes it and completes a billing tick. Returns it."""
    pool.hand_over("billing", dead.holder)
    successor = standby_future.result(timeout=60)
    successor.wait_for("lease_acquired", role="billing", timeout_s=30)
    successor.wait_for("tick_completed", role="billing", timeout_s=60)
    return successor


# --- 1. the kill sweep ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_scheduler_killed_at_every_point_of_a_drain_bills_every_period_exactly_once(
    transactional_db, stripe_proxy, gateway, make_card, replicas
):
    kill_sweep(stripe_proxy, gateway, make_card, replicas, kill_points=range(1, SWEEP_SIZE))


def kill_sweep(
    stripe_proxy, gateway, make_card, replicas, *, kill_points, label="runscheduler SIGKILLed mid-drain"
) -> None:
    """The kill sweep at ``kill_points`` (of 1 … N-1), the replicas made by ``replicas(env)``; records its row."""
    started = time.monotonic()
    book = Book(make_card)
    pool = replicas(billing_env(stripe_proxy))
    leader = pool.start().result(timeout=60)
    leader.wait_for("lease_acquired", role="billing", timeout_s=30)
    standby = pool.start()
    total, observed = Audit(), []
    for k in kill_points:
        seeded = seed_book(book, gateway, SWEEP_BOOK, name=f"Sweep {k}")
        tenant_id = seeded.tenant.id
        # Odd points: right after the k-th invoice commits (step 1); even: after the k-th recorded close (step 3).
        watch = invoices_of if k % 2 else closes_recorded
        wait_until(lambda: watch(tenant_id) >= k, timeout_s=60, what=f"kill point {k}")
        leader.process.kill()
        pool.kill(leader)
        at_kill = (invoices_of(tenant_id), closes_recorded(tenant_id))
        observed.append(at_kill)
        assert at_kill[1] < SWEEP_BOOK, f"kill point {k}: the drain had finished ({at_kill}); slow it down"

        age_unknown_attempts(tenant_id)
        leader = take_over(pool, leader, standby)
        standby = pool.start()
        audit = audit_book(seeded, stripe_proxy)
        assert_clean(audit, f"kill point {k} (invoices, closes at the kill: {at_kill})", stripe_proxy)
        total.add(audit)

    compared = assert_gateway_agrees()
    exact = sum(1 for k, (inv, closes) in zip(kill_points, observed, strict=True) if (inv if k % 2 else closes) == k)
    record_row(
        ReportRow(
            f"kill sweep: {label}, successor finishes",
            runs=len(kill_points),
            kill_points=(
                f"1..{SWEEP_SIZE - 1} (every; {exact} exact)"
                if list(kill_points) == list(range(1, SWEEP_SIZE))
                else f"{', '.join(map(str, kill_points))} ({exact} exact)"
            ),
            invoices=total.invoices,
            duplicates=total.duplicates,
            lost=total.lost_periods,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"N={SWEEP_BOOK} per book (5/7 paying, 1/7 declining, 1/7 gateway 500), page 4, concurrency 2; "
            f"gateway: {compared}",
        )
    )


# --- 2. kill points inside one close --------------------------------------------------------------------------------

CLOSE_BOOK = [PAYING, DECLINING, FAILING, PAYING]
# What the gateway answers each kind's PaymentIntent call: the proxy action and HTTP status.
GATEWAY_ANSWER = {PAYING: ("forwarded", 200), DECLINING: ("forwarded", 402), FAILING: ("500", 500)}


def test_a_scheduler_killed_inside_a_close_leaves_nothing_the_successor_cannot_finish_once(
    transactional_db, stripe_proxy, gateway, make_card, replicas, tmp_path
):
    """Each kill point × each card kind: the state at the kill is exactly what the point implies, and
    the successor re-sends the same request under the same key (a replay, never a second charge)."""
    started = time.monotonic()
    fault_file = str(tmp_path / "fault.json")
    arm(fault_file, None)
    book = Book(make_card)
    pool = replicas(
        billing_env(
            stripe_proxy,
            HARDCOUNT_SERVICES="tests.system.faults.FaultPoints",
            HARDCOUNT_FAULT_FILE=fault_file,
        )
    )
    leader = pool.start().result(timeout=60)
    leader.wait_for("lease_acquired", role="billing", timeout_s=30)
    standby = pool.start()
    total, scenarios = Audit(), 0
    for point in ("after_prepare", "after_charge", "during_record"):
        for kind in (PAYING, DECLINING, FAILING):
            where = f"{point} of a {kind} close"
            with transaction.atomic():  # armed before the book becomes due
                seeded = seed_book(book, gateway, len(CLOSE_BOOK), kinds=CLOSE_BOOK, name=where)
                target = seeded.of_kind(kind)[0]
                arm(fault_file, point, target.id)
            assert leader.process.wait(timeout=60) == -signal.SIGKILL, f"{where}: the replica did not die"
            assert leader.find("fault_point_reached", point=point, subscription=target.id), leader.log()
            pool.kill(leader)
            arm(fault_file, None)

            # The state the kill left: step 1 committed; nothing of step 3.
            invoice = Invoice.objects.get(subscription=target)
            attempts = list(PaymentAttempt.objects.filter(invoice=invoice))
            target.refresh_from_db()
            assert (invoice.status, [a.outcome for a in attempts], target.periods_billed) == (
                "open",
                ["unknown"],
                0,
            ), where
            sent = [(e.action, e.status) for e in gateway_requests(stripe_proxy, invoice.id)]
            expected_sent = [] if point == "after_prepare" else [GATEWAY_ANSWER[kind]]
            assert sent == expected_sent, f"{where}: the gateway saw {sent}"

            age_unknown_attempts(seeded.tenant.id)
            leader = take_over(pool, leader, standby)
            standby = pool.start()
            audit = audit_book(seeded, stripe_proxy)
            assert_clean(audit, where, stripe_proxy)
            total.add(audit)

            # One attempt row, one key; the successor's call was the same request under the same key.
            attempts = list(PaymentAttempt.objects.filter(invoice=invoice))
            assert len(attempts) == 1 and attempts[0].idempotency_key, where
            calls = gateway_requests(stripe_proxy, invoice.id)
            assert {e.request.idempotency_key for e in calls} == {attempts[0].idempotency_key}, where
            actions = [e.action for e in calls]
            if kind == FAILING:
                # An injected 500 is not stored: the same-key re-send reaches the gateway's front again.
                assert actions == ["500"] * (1 if point == "after_prepare" else 2), where
            elif point == "after_prepare":
                assert actions == ["forwarded"], where
            else:
                assert actions == ["forwarded", "replayed"], where
            scenarios += 1
    compared = assert_gateway_agrees()
    record_row(
        ReportRow(
            "kill points inside a close (after invoice commit / after gateway answer / in record tx)",
            runs=scenarios,
            kill_points="3 points x paying, declining, failing",
            invoices=total.invoices,
            duplicates=total.duplicates,
            lost=total.lost_periods,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"the successor re-sent the same request under the same key (a replay, never a second charge); "
            f"gateway: {compared}",
        )
    )


# --- 3 and 4. racing drains, and the negative control ---------------------------------------------------------------

RACERS = 4


def race_drains(seeded, stripe_proxy, tmp_path, *, racers: int = RACERS) -> list[dict]:
    """``racers`` drain processes (tests/system/drain_once.py) on the tenant's due set, page size 1,
    released together once every one has booted; returns each one's run counts."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "STRIPE_API_BASE": stripe_proxy.api_base,
        "STRIPE_API_KEY": STRIPE_KEY,
        "HARDCOUNT_GATEWAY_TIMEOUT_S": "2",
        "HARDCOUNT_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "tests.system.drain_once", "--tenant", seeded.tenant.id, "--page-size", "1"]
    logs = [open(tmp_path / f"drain-{i}.log", "w+") for i in range(racers)]
    processes = [
        subprocess.Popen(
            command, cwd=BASE_DIR, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        for log in logs
    ]
    try:
        for process, log in zip(processes, logs, strict=True):
            line = process.stdout.readline().strip()
            assert line == "ready", f"a drain did not start: {line!r}\n{log.seek(0) or log.read()}"
        for process in processes:  # the start signal, as close together as four writes get
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for process, log in zip(processes, logs, strict=True):
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0, f"a drain failed:\n{log.seek(0) or log.read()}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        for log in logs:
            log.close()


def raced(results: list[dict]) -> tuple[int, int]:
    """(drains that billed something, attempts that found their period being closed by another drain)."""
    working = sum(1 for r in results if r["billed"] > 0)
    return working, sum(r["skipped"] for r in results)


def test_four_drain_processes_racing_on_one_due_set_bill_every_period_exactly_once(
    transactional_db, stripe_proxy, gateway, make_card, tmp_path
):
    started = time.monotonic()
    seeded = seed_book(Book(make_card), gateway, SWEEP_SIZE, name="Race")

    results = race_drains(seeded, stripe_proxy, tmp_path)

    working, collisions = raced(results)
    assert working >= 2, f"the race did not happen: only {working} of {RACERS} drains billed anything: {results}"
    assert sum(r["billed"] for r in results) == sum(1 for k in seeded.kinds.values() if k != FAILING)
    audit = audit_book(seeded, stripe_proxy)
    assert_clean(audit, "racing drains", stripe_proxy)
    compared = assert_gateway_agrees()
    record_row(
        ReportRow(
            f"{RACERS} drain processes racing, page size 1",
            runs=RACERS,
            kill_points="-",
            invoices=audit.invoices,
            duplicates=audit.duplicates,
            lost=audit.lost_periods,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"{working} drains billed ({', '.join(str(r['billed']) for r in results)}); "
            f"{collisions} collisions on a period in flight, skipped; gateway: {compared}",
        )
    )


def test_negative_control_without_the_unique_index_racing_drains_bill_periods_twice(
    transactional_db, stripe_proxy, gateway, make_card, tmp_path
):
    """The same race with ``invoice_one_per_period`` dropped must bill periods twice; if it does not,
    the experiment cannot tell the index from luck and fails. The index is restored afterwards."""
    started = time.monotonic()
    seeded = seed_book(Book(make_card), gateway, SWEEP_SIZE, name="Race without the index")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_indexdef('invoice_one_per_period'::regclass)")
        index_sql = cursor.fetchone()[0]
        cursor.execute("DROP INDEX invoice_one_per_period")
    try:
        results = race_drains(seeded, stripe_proxy, tmp_path)
        working, collisions = raced(results)
        assert working >= 2, f"the race did not happen: only {working} of {RACERS} drains billed anything: {results}"
        audit = audit_book(seeded, stripe_proxy, expect_final_states=False)
        violations = doctor_violations()
        assert audit.duplicates > 0, "without the index the racing drains must invoice some period twice"
        assert audit.double_charges > 0, "and charge some customer twice for one period"
        assert "invoice_one_per_period" in violations, f"the doctor must see the duplicates: {violations}"
        record_row(
            ReportRow(
                "negative control: the same race, unique index dropped",
                runs=RACERS,
                kill_points="-",
                invoices=audit.invoices,
                duplicates=audit.duplicates,
                lost=audit.lost_periods,
                doctor_violations=sum(count for count, _ in violations.values()),
                wall_s=time.monotonic() - started,
                note=f"{working} drains billed; {audit.double_charges} extra charges for periods already charged; "
                f"{collisions} collisions still skipped; doctor failed {len(violations)} check(s) (as it must)",
            )
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE billing_invoice, billing_invoicelineitem, billing_paymentattempt, billing_billingattempt,"
                " billing_ledgerentry, dunning_dunningrun CASCADE"
            )
            cursor.execute(index_sql)


# --- 5. webhook executors killed mid-delivery -----------------------------------------------------------------------

EXECUTOR_KILLS = 5
# Receivers: path → (subscribed event types, behaviour by the delivery's try number at that receiver).
RECEIVERS = {
    "/all": (["*"], "slow"),
    "/invoices": (["invoice.*"], "hangs on the first try"),
    "/subscriptions": (["subscription.*"], "500 on the first two tries"),
    "/customers": (["customer.created"], "drops the connection on the first try"),
    "/clocks": (["test_clock.advanced"], "never subscribed to anything sent"),
}


def subscribed(enabled_events: list[str], event_type: str) -> bool:
    """docs/reference/webhooks.md matching: ``*``, an exact type, or a ``prefix.*`` wildcard."""
    return any(
        pattern == "*" or pattern == event_type or (pattern.endswith(".*") and event_type.startswith(pattern[:-1]))
        for pattern in enabled_events
    )


def test_executors_killed_mid_delivery_deliver_every_event_to_every_subscribed_endpoint_once_recorded(
    transactional_db, stripe_proxy, gateway, make_card, replicas
):
    executors_killed_mid_delivery(stripe_proxy, gateway, make_card, replicas)


def executors_killed_mid_delivery(
    stripe_proxy, gateway, make_card, replicas, *, label="webhook executors SIGKILLed mid-delivery", after_kill=None
) -> None:
    """The executor-kill experiment, the replicas made by ``replicas(env)``; records its row.

    ``after_kill(n)``, if given, runs after the n-th kill (1-based) once its replacement is up.
    """
    from outbox.models import Delivery, DeliveryAttempt, Event
    from outbox.signing import verify
    from tests.outbox.conftest import Answer, Receiver, make_endpoint

    started = time.monotonic()
    receiver = Receiver()
    release = threading.Event()
    tries: Counter = Counter()
    tries_lock = threading.Lock()

    def behaviour(path: str):
        def answer(request, _nth):
            with tries_lock:
                tries[(path, request.headers["hardcount-delivery-id"])] += 1
                n = tries[(path, request.headers["hardcount-delivery-id"])]
            if path == "/all":
                return Answer(delay_s=0.2)
            if path == "/invoices" and n == 1:
                return Answer(hang=release)
            if path == "/subscriptions" and n <= 2:
                return Answer(500, b"try later")
            if path == "/customers" and n == 1:
                return Answer(close=True)
            return Answer()

        return answer

    for path in RECEIVERS:
        receiver.behave(path, behaviour(path))
    book = Book(make_card)
    tenant = book.tenant("Webhooks")
    endpoints = {path: make_endpoint(tenant, receiver.url(path), events) for path, (events, _) in RECEIVERS.items()}

    stop_mover = threading.Event()

    def move_time():
        # Retries and circuit cool-downs come due at once: time moved through the rows.
        from django.db import OperationalError, connections

        while not stop_mover.wait(0.1):
            try:
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "UPDATE outbox_delivery SET fire_after = now()"
                        " WHERE status IN ('pending', 'retrying') AND fire_after > now()"
                    )
                    cursor.execute(
                        "UPDATE outbox_webhookendpoint SET circuit_open_until = now() WHERE circuit_open_until > now()"
                    )
            except OperationalError:
                # This many-row UPDATE and an executor's batch write lock rows in different orders; when
                # PostgreSQL breaks such a deadlock by aborting the mover, the next tick moves the rows.
                continue
        connections["default"].close()

    billing_errors: list[BaseException] = []

    def bill():
        from django.db import connections

        from billing.services.drain import drain_due

        try:
            seeded = seed_book(book, gateway, 12, tenant=tenant)
            drain_due(livemode=False, trigger="manual", tenant_id=seeded.tenant.id, page_size=4, concurrency=2)
        except BaseException as exc:
            billing_errors.append(exc)
            raise
        finally:
            connections.close_all()

    pool = replicas(
        {
            "HARDCOUNT_ROLES": "",
            "HARDCOUNT_SERVICES": "outbox.scheduling.ExecutorService",
            "HARDCOUNT_OUTBOX_WORKERS": "4",
            "HARDCOUNT_DELIVERY_TIMEOUT_S": "1",
            "HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S": "1",
            "HARDCOUNT_OUTBOX_POLL_S": "0.05",
        }
    )
    mover = threading.Thread(target=move_time, daemon=True)
    billing = threading.Thread(target=bill, daemon=True)

    def queue_customers(count: int) -> None:
        from django.db import transaction

        from billing.models import Customer
        from outbox.services import emit_for

        for n in range(count):
            with transaction.atomic():
                customer = Customer.objects.create(
                    tenant=tenant, livemode=False, email=f"more-{next(topped_up)}-{n}@example.com"
                )
                emit_for(customer, "customer.created", {"id": customer.id, "object": "customer"})

    killed = 0
    topped_up = itertools.count()
    try:
        live = [pool.start().result(timeout=60), pool.start().result(timeout=60)]
        mover.start()
        billing.start()
        # Each kill: a replica with a delivery claimed and its request at the receiver (mid-delivery).
        for i in range(EXECUTOR_KILLS):
            victim = live[i % 2]
            pid = victim.process.pid

            def in_flight(pid=pid):
                # The executors may have delivered everything the drain wrote so far: then more events
                # are queued, so each kill still lands mid-delivery (the checks below cover them too).
                if not Delivery.objects.filter(event__tenant=tenant, status__in=("pending", "retrying")).exists():
                    queue_customers(4)
                claimed = set(
                    Delivery.objects.filter(
                        claimed_by__contains=f":{pid}:", status__in=("pending", "retrying")
                    ).values_list("id", flat=True)
                )
                return claimed & {r.headers.get("hardcount-delivery-id") for r in receiver.received()}

            wait_until(in_flight, timeout_s=60, what=f"replica {victim.name} mid-delivery", step_s=0.01)
            pool.kill(victim)
            killed += 1
            # Its claims run out now rather than in 2 s (lease = 2 × timeout); a replacement joins.
            Delivery.objects.filter(claimed_by__contains=f":{pid}:").update(
                claim_expires_at=Now() - timedelta(seconds=1)
            )
            live[i % 2] = pool.start().result(timeout=60)
            if after_kill is not None:
                after_kill(killed)
        billing.join(120)
        assert not billing.is_alive() and billing_errors == [], f"the billing drain did not finish: {billing_errors}"

        def expected_pairs():
            events = list(Event.objects.filter(tenant=tenant))
            return events, [
                (e, ep) for e in events for ep in endpoints.values() if subscribed(ep.enabled_events, e.type)
            ]

        def all_delivered():
            _, pairs = expected_pairs()
            return Delivery.objects.filter(event__tenant=tenant, status="succeeded").count() >= len(pairs)

        wait_until(all_delivered, timeout_s=120, what="every delivery succeeded", step_s=0.1)
    finally:
        stop_mover.set()
        release.set()
        if mover.is_alive():
            mover.join(5)
        pool.stop_all()
        receiver.close()

    # A request cut off by its executor's death (headers sent, body not) reaches the receiver short;
    # a receiver verifying the signature rejects it. Only whole requests count as delivered.
    whole = [r for r in receiver.received() if len(r.body) == int(r.headers.get("content-length") or 0)]
    cut_off = len(receiver.received()) - len(whole)
    secrets = {f"/{ep.url.split('/', 3)[3]}": ep.secret for ep in endpoints.values()}
    for r in whole:  # every whole request is signed for its endpoint, whichever executor sent it
        verify(r.body, r.headers["hardcount-signature"], secrets[r.path], tolerance_s=300, now=r.wall)
    events, pairs = expected_pairs()
    assert len(events) > 40 and {e.type.split(".")[0] for e in events} >= {"customer", "subscription", "invoice"}
    undelivered, twice = [], []
    for event, endpoint in pairs:
        deliveries = list(Delivery.objects.filter(event=event, endpoint=endpoint, replay_of__isnull=True))
        ok = len(deliveries) == 1 and deliveries[0].status == "succeeded" and 1 <= deliveries[0].attempts <= 8
        path = f"/{endpoint.url.split('/', 3)[3]}"
        seen = [r for r in whole if r.path == path and r.json["id"] == event.id]
        if not ok or not seen:
            undelivered.append((event.type, endpoint.url, [(d.status, d.attempts) for d in deliveries], len(seen)))
        for d in deliveries:
            if DeliveryAttempt.objects.filter(delivery=d, outcome="succeeded").count() > 1:
                twice.append(d.id)
    assert undelivered == [], undelivered
    assert twice == [], f"deliveries recorded succeeded twice: {twice}"
    assert Delivery.objects.filter(event__tenant=tenant).count() == len(pairs)  # nothing sent unsubscribed
    assert not Delivery.objects.filter(endpoint=endpoints["/clocks"]).exists()
    assert max(Delivery.objects.filter(event__tenant=tenant).values_list("attempts", flat=True)) <= 8
    lost_attempts = DeliveryAttempt.objects.filter(delivery__event__tenant=tenant, outcome="lease_lost").count()
    assert lost_attempts >= 1, "no delivery was in flight when an executor died: the kills missed"
    violations = doctor_violations()
    assert violations == {}, f"doctor found {violations}"
    redelivered = sum(n - 1 for n in Counter((r.path, r.json["id"]) for r in whole).values())
    record_row(
        ReportRow(
            f"{label} (receivers slow / hanging / 500 / dropping)",
            runs=killed + 2,
            kill_points=f"{killed} kills, each with a request in flight",
            invoices=f"{len(events)} events, {len(pairs)} deliveries",
            duplicates=len(twice),
            lost=len(undelivered),
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"{lost_attempts} attempts lost with their executor; {redelivered} requests repeated "
            f"(planned receiver failures and kills: at least once, same event id), {cut_off} cut off mid-body; "
            f"max attempts "
            f"{max(Delivery.objects.filter(event__tenant=tenant).values_list('attempts', flat=True))}",
        )
    )
