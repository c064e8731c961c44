"""Ten replicas, simulated: a kill-and-restart storm through PgBouncer during a billing drain and a webhook storm.

Ten replicas of the single deployable (gunicorn with the scheduler runtime in its one worker, small
pools: 2 request threads, 2 closes, 4 executor workers) reach the test database through a PgBouncer in
transaction mode with a pool of 6 (tests/system/pgbouncer.py). Every default role runs, billing in two
shards (``HARDCOUNT_BILLING_SHARDS=2``), and every replica runs the webhook executor. Two tenants, one
per shard, each with a webhook endpoint on a local receiver, get a seeded book (paying, declining and
gateway-failing cards: tests/system/correctness.py); while it drains, a client creates customers
through the replicas' API (each a ``customer.created`` event, retried on another replica under the
same ``Idempotency-Key`` when its replica dies under it). Meanwhile replicas are SIGKILLed (arbiter and
worker together) and replaced, six rounds at set points of the drain: each shard's leader, both at
once, the other roles' leaders, and replicas with deliveries in flight.

Throughout, a sampler reads the lease table every 50 ms: at every sample at most one live holder per
role (each shard its own role), a role's fencing token never goes back, and one token never has two
holders. PostgreSQL's own sessions are sampled too. At the end:

- every due period billed exactly once: the unique index ``invoice_one_per_period`` in place and
  valid, one invoice per seeded subscription, and the failure-correctness audit (no duplicate, no
  lost period, each card's end state, at most one succeeded PaymentIntent per invoice at the gateway);
- every event delivered: one delivery per event and endpoint, each ``succeeded`` (terminal) with
  1 to 8 attempts and exactly one succeeded attempt row, and the receiver got each at least once, whole
  and signed for its endpoint; each customer the API confirmed exists once;
- ``manage.py doctor`` exits 0; PostgreSQL never saw more sessions than the pool.

Leases are short (TTL 4 s) so a SIGKILLed leader's role moves on within seconds; nothing is moved by
hand (no lease, claim or payment attempt is expired through its row).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict

import pytest
from django.db import connections, transaction
from django.db.models import Count

from billing.models import Customer, Invoice
from billing.shards import shard_of
from hardcount.models import ApiKey
from outbox.models import Delivery, DeliveryAttempt, Event
from outbox.services import emit_events
from outbox.signing import verify
from tests.billing.conftest import STRIPE_KEY, Book
from tests.outbox.conftest import Answer, Receiver, make_endpoint
from tests.system.correctness import arm_gateway, audit_book, closes_recorded, seed_book, wait_until
from tests.system.harness import BASE_DIR, SchedulerProcess, database_url
from tests.system.pgbouncer import DIRECT, assert_within_pool

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPLICAS = 10
SHARDS = 2
PER_SHARD = 48  # due subscriptions of each shard's tenant
# On every PaymentIntent call, with one charge in flight per shard leader: about 2 closes/s per shard, so the
# drain outlasts the storm's rounds even on a quiet machine, where a round can wait seconds for a replacement
# replica to boot (with 4 charges at 0.25 s, a quiet run once billed the last 45 % during one such wait).
GATEWAY_DELAY_S = 0.5
ROLES = {"billing:0", "billing:1", "dunning", "outbox_maintenance", "idempotency_maintenance"}
# (share of the book's closes recorded before the round, what it kills).
ROUNDS = (
    (0.10, ("billing:0",)),
    (0.25, ("billing:1",)),
    (0.40, ("billing:0", "billing:1")),
    (0.55, ("dunning", "outbox_maintenance", "in-flight")),
    (0.70, ("idempotency_maintenance", "billing:0")),
    (0.85, ("in-flight", "in-flight")),
)

STORM_ENV = {
    "HARDCOUNT_ROLES": None,  # every default role
    "HARDCOUNT_SERVICES": "outbox.scheduling.ExecutorService",
    "HARDCOUNT_BILLING_SHARDS": str(SHARDS),
    "HARDCOUNT_BILLING_INTERVAL_S": "0.5",
    "HARDCOUNT_BILLING_PAGE_SIZE": "4",
    "HARDCOUNT_BILLING_CONCURRENCY": "2",
    "HARDCOUNT_BILLING_PAGES_IN_FLIGHT": "1",
    "HARDCOUNT_BILLING_CHARGES_IN_FLIGHT": "1",
    # The in-flight window is five of these: a dead leader's charges are re-sent (same key) 10 s on.
    "HARDCOUNT_GATEWAY_TIMEOUT_S": "2",
    "HARDCOUNT_DUNNING_INTERVAL_S": "2",
    "HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S": "2",
    "HARDCOUNT_LEASE_TTL_S": "4",
    "HARDCOUNT_LEASE_HEARTBEAT_S": "1",
    "HARDCOUNT_LEASE_ABANDON_S": "2.5",
    "HARDCOUNT_LEASE_POLL_S": "0.2",
    "HARDCOUNT_LEASE_SPREAD_S": "1",
    "HARDCOUNT_OUTBOX_WORKERS": "4",
    "HARDCOUNT_DELIVERY_TIMEOUT_S": "2",
    "HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S": "1",
    "HARDCOUNT_OUTBOX_POLL_S": "0.2",
    "HARDCOUNT_LOG_LEVEL": "INFO",
}


class LeaseSampler:
    """On a thread: the lease table every 50 ms. Records every (role, token, holder) tenure seen and every
    sample that breaks a rule: two live holders of a role, a token that went back, a token with two holders."""

    def __init__(self):
        self.samples = 0
        self.violations: list[str] = []
        self.tenures: dict[str, dict[int, str]] = defaultdict(dict)
        self.live_seen: set[str] = set()
        self._top: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.05):
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "SELECT role, count(DISTINCT holder) FILTER (WHERE expires_at > now() AND holder IS NOT NULL),"
                        " array_agg(holder), array_agg(token) FROM leases_leaderlease GROUP BY role"
                    )
                    rows = cursor.fetchall()
                self.samples += 1
                for role, live, holders, tokens in rows:
                    self._check(role, live, holders, tokens)
        finally:
            connections.close_all()

    def _check(self, role: str, live: int, holders: list, tokens: list) -> None:
        if live > 1:
            self.violations.append(f"sample {self.samples}: {role} has {live} live holders {holders}")
        if live:
            self.live_seen.add(role)
        for holder, token in zip(holders, tokens, strict=True):
            if token < self._top.get(role, 0):
                self.violations.append(f"sample {self.samples}: {role}'s token went back to {token}")
            self._top[role] = max(self._top.get(role, 0), token)
            if holder is None:
                continue  # released: the token stays, the holder is gone
            first = self.tenures[role].setdefault(token, holder)
            if first != holder:
                self.violations.append(f"sample {self.samples}: {role} token {token} held by {first} and {holder}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def tenants_one_per_shard(book: Book) -> list:
    """A tenant in each shard, shard 0 first (a tenant's shard is a hash of its id: made until both are had)."""
    found: dict[int, object] = {}
    for n in itertools.count():
        tenant = book.tenant(f"Storm {n}")
        found.setdefault(shard_of(tenant.id, SHARDS), tenant)
        if len(found) == SHARDS:
            return [found[i] for i in range(SHARDS)]


def live_holders() -> dict[str, str]:
    """Role → holder of each live lease."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT role, holder FROM leases_leaderlease WHERE expires_at > now() AND holder IS NOT NULL")
        return dict(cursor.fetchall())


def claims_in_flight() -> Counter:
    """Worker pid → deliveries claimed now (an executor's id, hence each claim, carries its worker's pid)."""
    claims = Delivery.objects.filter(status__in=("pending", "retrying"), claimed_by__isnull=False).values_list(
        "claimed_by", flat=True
    )
    return Counter(claim.split(":")[1] for claim in claims)


def in_flight_victim(live: list, chosen: list, holders: dict[str, str], tenant) -> SchedulerProcess:
    """A live replica not chosen yet with deliveries claimed now, the busiest, a follower if one is busy. When none
    is, a burst of events is queued for ``tenant`` first (its deliveries are then checked like every other)."""

    def busiest() -> SchedulerProcess | None:
        in_flight = claims_in_flight()
        busy = [r for r in live if r not in chosen and in_flight[pid_of(r)]]
        followers = [r for r in busy if r.holder not in holders.values()]
        return max(followers or busy, key=lambda r: in_flight[pid_of(r)], default=None)

    found = busiest()
    if found is None:
        # Of the tenant's own customers: the doctor's sweep at the end holds every event to an object that exists.
        customers = list(Customer.objects.filter(tenant=tenant, livemode=False).values_list("id", flat=True)[:40])
        with transaction.atomic():
            emit_events(
                [
                    ("customer.updated", {"id": customers[n % len(customers)], "object": "customer"}, None)
                    for n in range(40)
                ],
                tenant_id=tenant.id,
                livemode=False,
            )
        found = wait_until(busiest, timeout_s=15, what="a delivery in flight", step_s=0.01)
    return found


def pid_of(replica: SchedulerProcess) -> str:
    """The worker's pid, from its holder id ``host:pid:hex``."""
    return replica.holder.split(":")[1]


class CustomerClient:
    """On a thread: creates customers through whichever replicas are up, about 5 a second, each under an
    ``Idempotency-Key``; a request whose replica died is sent again, same key, to another."""

    def __init__(self, key: str, live: list[SchedulerProcess]):
        self.key = key
        self.live = live
        self.confirmed: dict[str, str] = {}  # idempotency key → customer id answered
        self.in_doubt: set[str] = set()  # keys whose replica died mid-request and that were not confirmed
        self.retried = 0
        self.errors: list[str] = []  # answers other than created or in use: the client stops at the first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _post(self, replica: SchedulerProcess, key: str) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{replica.port}/v1/customers",
            data=json.dumps({"email": f"{key}@example.com"}).encode(),
            method="POST",
            headers={
                "Authorization": f"Bearer {self.key}",
                "Content-Type": "application/json",
                "Idempotency-Key": key,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def _run(self) -> None:
        turn = itertools.count()
        for n in itertools.count():
            if self._stop.wait(0.2):
                return
            key = f"storm-{n}"
            for _ in range(20):
                replica = list(self.live)[next(turn) % len(self.live)]
                try:
                    status, body = self._post(replica, key)
                except (OSError, ValueError):  # refused, reset, or cut off: that replica died
                    self.retried += 1
                    continue
                if status in (200, 201):
                    self.confirmed[key] = body["id"]
                    break
                if status == 409:
                    # The first try's record is in flight on a dead replica; it goes stale in minutes, not here.
                    self.in_doubt.add(key)
                    break
                self.errors.append(f"POST /v1/customers {key}: {status} {body}")
                return
            else:
                self.in_doubt.add(key)  # twenty replicas in a row died under it

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_ten_replicas_through_the_pooler_survive_a_kill_and_restart_storm_mid_drain_and_mid_delivery(
    transactional_db, stripe_proxy, make_card, pooled, sampler, settings
):
    settings.HARDCOUNT_BILLING_SHARDS = SHARDS  # the audit's reads and the replicas agree on shards
    started = time.monotonic()
    failing = arm_gateway(stripe_proxy, GATEWAY_DELAY_S)
    receiver = Receiver()
    for shard in range(SHARDS):
        receiver.behave(f"/shard-{shard}", lambda _request, _nth: Answer(delay_s=0.3))
    book = Book(make_card)
    tenants = tenants_one_per_shard(book)
    endpoints = [make_endpoint(t, receiver.url(f"/shard-{i}")) for i, t in enumerate(tenants)]
    _, api_key = ApiKey.issue(tenants[0], livemode=False)

    pool = pooled({**STORM_ENV, "STRIPE_API_BASE": stripe_proxy.api_base, "STRIPE_API_KEY": STRIPE_KEY}, web=True)
    leases = LeaseSampler()
    client = None
    try:
        booting = [pool.start() for _ in range(REPLICAS)]
        live = [future.result(timeout=180) for future in booting]
        wait_until(lambda: ROLES <= set(live_holders()), timeout_s=60, what=f"a leader of each of {sorted(ROLES)}")
        booted_s = time.monotonic() - started

        seeded = [seed_book(book, failing, PER_SHARD, tenant=t) for t in tenants]
        total = SHARDS * PER_SHARD
        client = CustomerClient(api_key, live)

        def closes() -> int:
            return sum(closes_recorded(t.id) for t in tenants)

        kills: list[str] = []
        mid_drain = sigkills = 0
        restarting = []
        for share, victims in ROUNDS:
            wait_until(lambda share=share: closes() >= share * total, timeout_s=90, what=f"{share:.0%} of the closes")
            chosen: list[SchedulerProcess] = []
            for victim in victims:
                if victim == "in-flight":
                    candidate = in_flight_victim(live, chosen, live_holders(), tenants[0])
                    what = f"in-flight ({claims_in_flight()[pid_of(candidate)]} claims)"
                else:

                    def leader(victim=victim) -> SchedulerProcess | None:
                        # Replacements join as they come up (one may lead already); the storm does not wait for them.
                        live.extend(f.result() for f in restarting if f.done())
                        restarting[:] = [f for f in restarting if not f.done()]
                        holder = live_holders().get(victim)
                        return next((r for r in live if r.holder == holder), None)

                    # A role whose leader was just killed is led again within the TTL.
                    candidate = wait_until(leader, timeout_s=30, what=f"a live {victim} leader", step_s=0.05)
                    what = f"{victim} leader"
                kills.append(f"{what} at {closes()}/{total}" + (" (the same replica)" if candidate in chosen else ""))
                if candidate not in chosen:
                    chosen.append(candidate)
            mid_drain += closes() < total
            sigkills += len(chosen)
            for replica in chosen:
                pool.kill(replica)
                live.remove(replica)
            restarting += [pool.start() for _ in chosen]
        live.extend(f.result(timeout=180) for f in restarting)
        assert mid_drain >= len(ROUNDS) - 1, f"the drain finished before the storm: {kills}"
        client.stop()

        wait_until(lambda: closes() >= total, timeout_s=120, what="every close recorded")

        def settled() -> bool:
            return all(not audit_book(s, stripe_proxy).problems for s in seeded)

        wait_until(settled, timeout_s=90, what="every charge left in flight resolved", step_s=0.5)
        event_count = Event.objects.filter(tenant__in=tenants).count()

        def delivered() -> bool:
            return Delivery.objects.filter(event__tenant__in=tenants, status="succeeded").count() >= event_count

        wait_until(delivered, timeout_s=120, what="every delivery succeeded", step_s=0.2)
    finally:
        if client is not None:
            client.stop()
        leases.stop()
        receiver.close()
    storm_s = time.monotonic() - started

    # Leases: one live holder per role at every sample; every role and shard led, the shards by several in turn.
    assert leases.samples > 100, leases.samples
    assert leases.violations == [], leases.violations[:10]
    assert ROLES <= leases.live_seen, leases.live_seen
    known = {p.holder for p in pool.started if hasattr(p, "holder")}
    every_holder = {h for tenures in leases.tenures.values() for h in tenures.values()}
    assert every_holder <= known, every_holder - known
    for shard in ("billing:0", "billing:1"):
        assert len(leases.tenures[shard]) >= 3, (shard, leases.tenures[shard])

    # Billing: every due period billed exactly once.
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT i.indisunique AND i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = 'invoice_one_per_period'"
        )
        assert cursor.fetchone() == (True,), "the unique index invoice_one_per_period is missing or invalid"
    for s in seeded:
        invoices = Invoice.objects.filter(tenant_id=s.tenant.id).exclude(status=Invoice.VOID)
        per_period = Counter(invoices.values_list("subscription_id", "period_start"))
        assert len(per_period) == len(s.subscriptions) == PER_SHARD
        assert set(per_period.values()) == {1}, per_period.most_common(3)
        audit = audit_book(s, stripe_proxy)
        assert audit.problems == [], audit.problems

    # Webhooks: every event delivered to its endpoint, terminal once, within 8 attempts, and received.
    whole = [r for r in receiver.received() if len(r.body) == int(r.headers.get("content-length") or 0)]
    seen = Counter((r.path, r.json["id"]) for r in whole)
    secrets = {f"/shard-{i}": e.secret for i, e in enumerate(endpoints)}
    for r in whole:
        verify(r.body, r.headers["hardcount-signature"], secrets[r.path], tolerance_s=600, now=r.wall)
    problems = []
    events = list(Event.objects.filter(tenant__in=tenants))
    for i, (tenant, endpoint) in enumerate(zip(tenants, endpoints, strict=True)):
        for event in (e for e in events if e.tenant_id == tenant.id):
            deliveries = list(Delivery.objects.filter(event=event, endpoint=endpoint))
            states = [(d.status, d.attempts) for d in deliveries]
            if len(deliveries) != 1 or deliveries[0].status != "succeeded" or not 1 <= deliveries[0].attempts <= 8:
                problems.append((event.type, event.id, states))
            elif not seen[(f"/shard-{i}", event.id)]:
                problems.append((event.type, event.id, states, "never reached the receiver whole"))
    assert problems == [], problems[:10]
    assert Delivery.objects.filter(event__tenant__in=tenants).count() == len(events)
    succeeded_twice = (
        DeliveryAttempt.objects.filter(delivery__event__tenant__in=tenants, outcome="succeeded")
        .values("delivery_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    assert list(succeeded_twice) == []
    lost = DeliveryAttempt.objects.filter(delivery__event__tenant__in=tenants, outcome="lease_lost").count()
    assert lost >= 1, "no delivery was in flight at any kill: the in-flight kills missed"

    # The API: every customer it confirmed exists once; one whose request died with its replica at most once.
    emails = Counter(
        Customer.objects.filter(tenant=tenants[0], email__startswith="storm-").values_list("email", flat=True)
    )
    assert client.errors == []
    assert client.confirmed, "no customer was created through the replicas"
    assert all(emails[f"{k}@example.com"] == 1 for k in client.confirmed), emails.most_common(3)
    assert max(emails.values()) == 1

    # The money-invariant sweep, as an operator runs it.
    doctor = subprocess.run(
        [sys.executable, "manage.py", "doctor"],
        cwd=BASE_DIR,
        # Direct, and named so: the session sampler leaves it out of the server's count.
        env={
            **os.environ,
            "DATABASE_URL": f"{database_url()}&application_name={DIRECT}",
            "HARDCOUNT_BILLING_SHARDS": str(SHARDS),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    failed_checks = [line for line in doctor.stdout.splitlines() if " FAIL " in line or " ERROR " in line]
    assert doctor.returncode == 0, "\n".join(failed_checks) + "\n" + doctor.stdout + doctor.stderr
    assert_within_pool(sampler, more_clients=True)
    print(
        f"\n{REPLICAS} gunicorn replicas through PgBouncer (pool {sampler.bouncer.pool}), {sigkills} SIGKILLs in "
        f"{len(ROUNDS)} rounds, each replaced: {kills}; booted in {booted_s:.0f} s, storm and settle "
        f"{storm_s:.0f} s; {total} periods billed once; {len(events)} events delivered "
        f"({len(receiver.received())} requests, {lost} attempts lost with their replica); "
        f"{len(client.confirmed)} customers through the API ({client.retried} requests re-sent, "
        f"{len(client.in_doubt)} in doubt); tenures per role "
        f"{ {role: len(t) for role, t in sorted(leases.tenures.items())} }; {leases.samples} lease samples"
    )
