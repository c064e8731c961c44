"""Helpers of the failure-correctness suite (tests/system/test_failure_correctness.py).

- :class:`Replicas`: real ``runscheduler`` replicas, each with its own ``application_name`` so the
  test can see when a SIGKILLed replica's database sessions are gone, with a standby booting in
  the background while the leader works (so a successor's start is off the critical path);
- :func:`seed_book`: a tenant's due subscriptions, a deterministic mix of paying, declining and
  gateway-failing cards (failures injected by the Stripe proxy, matched on the payment method);
- :func:`gateway_charges`: what reached the gateway, from the proxy's log (every request to
  localstripe passes through it): succeeded PaymentIntents per invoice;
- :func:`audit_book`: one invoice per (subscription, period), at most one charge per invoice and
  per period at the gateway, no lost period, and the final state each card's kind must reach;
- :func:`doctor_violations`: the money-invariant sweep (``manage.py doctor``'s checks);
  :func:`assert_clean` and :func:`assert_gateway_agrees`: an experiment's audit and the doctor's
  sweeps (the books, then the gateway itself) must find nothing;
- :func:`billing_env`: the environment of a billing-only ``runscheduler`` replica talking to the
  proxy (the ``replicas`` and ``gateway`` fixtures are in tests/system/conftest.py);
- :class:`ReportRow` / :func:`record_row`: one line of the report table, printed, and appended
  as JSON to ``$HARDCOUNT_CORRECTNESS_REPORT`` when set (``make correctness``).

Time is moved through rows, never slept through: a dead leader's lease and a dead executor's
claims are expired with an UPDATE, and payment attempts left ``unknown`` by a killed close are
aged past the in-flight window (:func:`billing.services.payments.in_flight_window`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from django.db import connection, transaction

from billing.models import Invoice, PaymentAttempt, Subscription
from tests.billing.conftest import DECLINING_CARD, STRIPE_KEY, VISA, Book
from tests.system.harness import SchedulerProcess, database_url

PAYING, DECLINING, FAILING = "paying", "declining", "failing"
# Extra latency on every PaymentIntent call, so a drain of 40 lasts about a second and the
# database watcher (polling every few ms) stops it close to the chosen point.
GATEWAY_DELAY_S = 0.02


def kind_of(index: int) -> str:
    """The deterministic mix of a seeded book: 5 of 7 paying, 1 of 7 declining, 1 of 7 gateway-failing."""
    return {3: DECLINING, 5: FAILING}.get(index % 7, PAYING)


# --- processes ------------------------------------------------------------------------------------------------------


def backends(application_name: str) -> int:
    """How many PostgreSQL sessions carry ``application_name`` right now."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [application_name])
        return cursor.fetchone()[0]


def wait_until(predicate: Callable[[], object], *, timeout_s: float, what: str, step_s: float = 0.005):
    """Poll ``predicate`` until it returns a truthy value (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(step_s)


class Replicas:
    """``runscheduler`` replicas sharing ``env``, one leader and one standby at a time (``web``: gunicorn
    replicas running the runtime in their worker, :class:`~tests.system.harness.SchedulerProcess`).

    :meth:`start` boots a replica in the background (a :class:`SchedulerProcess` once it logged
    ``runtime_started``); :meth:`kill` SIGKILLs one and waits until its process and its database
    sessions are gone; :meth:`hand_over` expires a dead holder's lease in the row (instead of
    waiting out the TTL, which tests/system/test_scheduler_processes.py measures) so the standby
    takes over at its next poll.
    """

    def __init__(self, env: dict[str, str], *, web: bool = False):
        self.env = env
        self.web = web
        self.started: list[SchedulerProcess] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-boot")
        self._count = 0
        self._url = database_url()

    def start(self) -> Future:
        """A future of a new replica (its name ``replica-N``; its sessions' application_name ``hc-replica-N``)."""
        self._count += 1
        name = f"replica-{self._count}"
        env = {**self.env, "DATABASE_URL": f"{self._url}&application_name=hc-{name}"}

        def boot() -> SchedulerProcess:
            # Listed before it boots, so a replica that fails to log its start is still stopped at the end.
            process = SchedulerProcess.__new__(SchedulerProcess)
            self.started.append(process)
            process.__init__(name, env, web=self.web)
            return process

        return self._pool.submit(boot)

    def kill(self, process: SchedulerProcess, *, timeout_s: float = 15) -> None:
        """SIGKILL ``process`` (if still alive), reap it and wait until PostgreSQL has ended its sessions."""
        process.kill()
        process.process.wait(timeout_s)
        wait_until(lambda: backends(f"hc-{process.name}") == 0, timeout_s=timeout_s, what=f"{process.name}'s sessions")

    @staticmethod
    def hand_over(role: str, dead_holder: str) -> None:
        """Expire ``role``'s lease if ``dead_holder`` still holds it (a dead process never releases it)."""
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE leases_leaderlease SET expires_at = now() - interval '1 second'"
                " WHERE role = %s AND holder = %s",
                [role, dead_holder],
            )

    def stop_all(self) -> None:
        """Stop every replica (a standby still booting is waited for first, then stopped too)."""
        self._pool.shutdown(wait=True)

        def stop(process: SchedulerProcess) -> None:
            if hasattr(process, "_reader"):
                process.stop()
            elif hasattr(process, "process"):
                process.kill()
                process.process.wait(10)

        # Side by side: each graceful stop may wait for its in-flight work.
        with ThreadPoolExecutor(max_workers=max(1, len(self.started))) as stopping:
            list(stopping.map(stop, self.started))


def billing_env(stripe_proxy, **extra: str) -> dict[str, str]:
    """The environment of a billing-only replica talking to ``stripe_proxy``: 0.2 s ticks, page 4,
    concurrency 2, a 2 s gateway timeout; ``extra`` overrides or adds variables."""
    return {
        "HARDCOUNT_ROLES": "billing.loops.BillingRole",
        "HARDCOUNT_SERVICES": "",
        "STRIPE_API_BASE": stripe_proxy.api_base,
        "STRIPE_API_KEY": STRIPE_KEY,
        "HARDCOUNT_GATEWAY_TIMEOUT_S": "2",
        "HARDCOUNT_BILLING_INTERVAL_S": "0.2",
        "HARDCOUNT_BILLING_PAGE_SIZE": "4",
        "HARDCOUNT_BILLING_CONCURRENCY": "2",
        "HARDCOUNT_LEASE_POLL_S": "0.05",
        "HARDCOUNT_LOG_LEVEL": "INFO",
        **extra,
    }


def arm_gateway(stripe_proxy, delay_s: float = GATEWAY_DELAY_S) -> set[str]:
    """Arm ``stripe_proxy``'s failure-correctness faults: 500 on PaymentIntent calls of the payment methods in the
    returned set (seeding adds gateway-failing cards to it), and ``delay_s`` seconds on every other one."""
    failing: set[str] = set()
    stripe_proxy.fail_next(
        "500",
        times=10**9,
        match=lambda r: r.line.startswith("POST /v1/payment_intents") and r.params.get("payment_method") in failing,
    )
    stripe_proxy.fail_next("delay", times=10**9, match="POST /v1/payment_intents", delay_s=delay_s)
    return failing


def age_unknown_attempts(tenant_id: str) -> int:
    """Move the tenant's ``unknown`` payment attempts past the in-flight window: their sender is dead."""
    from billing.services.payments import in_flight_window

    return PaymentAttempt.objects.filter(tenant_id=tenant_id, outcome=PaymentAttempt.UNKNOWN).update(
        started_at=models_now() - in_flight_window() - timedelta(seconds=1)
    )


def models_now():
    from hardcount.times import database_now

    return database_now()


# --- books ----------------------------------------------------------------------------------------------------------


@dataclass
class SeededBook:
    """A seeded tenant: its subscriptions in due order, each with its card's kind."""

    tenant: object
    subscriptions: list[Subscription]
    kinds: dict[str, str]

    def of_kind(self, kind: str) -> list[Subscription]:
        return [s for s in self.subscriptions if self.kinds[s.id] == kind]


def seed_book(
    book: Book,
    failing_methods: set[str],
    count: int,
    *,
    kinds: list[str] | None = None,
    name: str = "Acme",
    tenant=None,
) -> SeededBook:
    """A tenant (new, named ``name``, or ``tenant``) with ``count`` due monthly subscriptions (one
    customer and price each), in one transaction.

    Kinds follow :func:`kind_of` unless ``kinds`` is given. Anchors are one hour ago minus i seconds,
    so the drain's ``ORDER BY next_billing_at`` takes them in list order. A failing card's payment
    method joins ``failing_methods``, which the proxy answers with a 500 on PaymentIntent calls.
    Committed on return (the whole book becomes due at once).
    """
    from hardcount.times import database_now

    kinds = kinds or [kind_of(i) for i in range(count)]
    with transaction.atomic():
        tenant = tenant or book.tenant(name)
        base = database_now() - timedelta(hours=1)
        subscriptions, by_id = [], {}
        for i, kind in enumerate(kinds):
            customer = book.customer(tenant, card=DECLINING_CARD if kind == DECLINING else VISA)
            if kind == FAILING:
                failing_methods.add(customer.default_payment_method)
            price = book.price(tenant, amount=1000 + i)
            sub = book.subscription(customer, price, anchor=base - timedelta(seconds=count - i))
            subscriptions.append(sub)
            by_id[sub.id] = kind
    return SeededBook(tenant, subscriptions, by_id)


def _count(sql: str, tenant_id: str) -> int:
    # Raw SQL: these are polled every few milliseconds while a drain runs.
    with connection.cursor() as cursor:
        cursor.execute(sql, [tenant_id])
        return cursor.fetchone()[0]


def closes_recorded(tenant_id: str) -> int:
    """Billing attempt rows (closes whose outcome was recorded) of the tenant's subscriptions."""
    return _count(
        "SELECT count(*) FROM billing_billingattempt a JOIN billing_subscription s ON s.id = a.subscription_id"
        " WHERE s.tenant_id = %s",
        tenant_id,
    )


def invoices_of(tenant_id: str) -> int:
    """Invoices of the tenant (committed: step 1 of a close)."""
    return _count("SELECT count(*) FROM billing_invoice WHERE tenant_id = %s", tenant_id)


# --- the gateway's record -------------------------------------------------------------------------------------------

# Proxy actions after which the request did reach localstripe.
FORWARDED = ("forwarded", "timeout_after_forward", "reset")


def gateway_charges(proxy) -> dict[str, set[str]]:
    """Invoice id → ids of PaymentIntents that succeeded for it at the gateway (creates and confirms).

    Read from the proxy's log: only requests it forwarded to localstripe count (a replay under an
    idempotency key is Stripe's stored answer, not a new charge).
    """
    charges: dict[str, set[str]] = defaultdict(set)
    for entry in proxy.entries("POST /v1/payment_intents"):
        if entry.action not in FORWARDED or not entry.response:
            continue
        body = entry.response
        if body.get("object") == "payment_intent" and body.get("status") == "succeeded":
            invoice_id = (body.get("metadata") or {}).get("hardcount_invoice")
            if invoice_id:
                charges[invoice_id].add(body["id"])
    return charges


def gateway_requests(proxy, invoice_id: str) -> list:
    """Every PaymentIntent request the proxy saw for ``invoice_id`` (by metadata or idempotency key)."""
    out = []
    for entry in proxy.entries("POST /v1/payment_intents"):
        req = entry.request
        if req.params.get("metadata[hardcount_invoice]") == invoice_id or (req.idempotency_key or "").startswith(
            f"hc:{invoice_id}:"
        ):
            out.append(entry)
    return out


# --- the audit ------------------------------------------------------------------------------------------------------


@dataclass
class Audit:
    """What :func:`audit_book` found: counts for the report and the problems, in words."""

    invoices: int = 0
    duplicates: int = 0  # invoices beyond the first of a (subscription, period)
    double_charges: int = 0  # succeeded PaymentIntents beyond the first per invoice or per period
    lost_periods: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: Audit) -> None:
        self.invoices += other.invoices
        self.duplicates += other.duplicates
        self.double_charges += other.double_charges
        self.lost_periods += other.lost_periods
        self.problems += other.problems


def audit_book(seeded: SeededBook, proxy, *, expect_final_states: bool = True) -> Audit:
    """Check a drained book against docs/reference/guarantees.md; problems are listed, not raised.

    - exactly one non-void invoice per (subscription, period), for each period the subscription
      has passed (anchor … ``next_billing_at``), none beyond;
    - at most one succeeded PaymentIntent per invoice and per (subscription, period) at the
      gateway, and a paid invoice's charge is its recorded ``payment_intent_id``;
    - no lost period: nothing left due and not waiting on the retry ladder, no advanced period
      without its invoice;
    - with ``expect_final_states``, each kind's end state after one billing: paying → invoice
      paid, period advanced, active; declining → invoice open, period advanced, past_due, one
      dunning run; failing → invoice open, period kept, failure 1 saved (waiting).
    """
    from billing.periods import period_bounds
    from hardcount.times import database_now

    audit = Audit()
    now = database_now()
    charges = gateway_charges(proxy)
    subs = {s.id: s for s in Subscription.objects.filter(tenant_id=seeded.tenant.id).select_related("price")}
    invoices = list(Invoice.objects.filter(tenant_id=seeded.tenant.id).exclude(status=Invoice.VOID))
    audit.invoices = len(invoices)
    per_period = Counter((i.subscription_id, i.period_start) for i in invoices)
    audit.duplicates = sum(n - 1 for n in per_period.values())
    for (sub_id, start), n in per_period.items():
        if n > 1:
            audit.problems.append(f"{sub_id}: {n} invoices for the period starting {start:%Y-%m-%d %H:%M:%S}")

    charged_per_period: Counter = Counter()
    for invoice in invoices:
        intents = charges.get(invoice.id, set())
        charged_per_period[(invoice.subscription_id, invoice.period_start)] += len(intents)
        if len(intents) > 1:
            audit.double_charges += len(intents) - 1
            audit.problems.append(f"{invoice.id}: {len(intents)} succeeded PaymentIntents at the gateway")
        if invoice.status == Invoice.PAID and intents and invoice.payment_intent_id not in intents:
            audit.problems.append(f"{invoice.id}: paid as {invoice.payment_intent_id}, gateway charged {intents}")
        if invoice.status != Invoice.PAID and intents:
            audit.problems.append(f"{invoice.id}: {invoice.status}, but charged at the gateway")
    for (sub_id, start), n in charged_per_period.items():
        if n > 1 and per_period[(sub_id, start)] > 1:
            audit.double_charges += n - 1
            audit.problems.append(f"{sub_id}: charged {n} times for the period starting {start:%Y-%m-%d %H:%M:%S}")

    for sub in subs.values():
        price = sub.price
        passed = {
            period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, n)[0]
            for n in range(sub.periods_billed)
        }
        invoiced = {start for (sub_id, start) in per_period if sub_id == sub.id}
        waiting = sub.next_billing_attempt_at is not None and sub.next_billing_attempt_at > now
        still_due = sub.next_billing_at is not None and sub.next_billing_at <= now
        missing = passed - invoiced
        if missing:
            audit.lost_periods += len(missing)
            audit.problems.append(f"{sub.id}: {len(missing)} period(s) advanced past without an invoice")
        if still_due and not waiting and sub.billing_parked_at is None:
            audit.lost_periods += 1
            audit.problems.append(f"{sub.id}: still due at {sub.next_billing_at} and not waiting: the drain left it")
        extra = invoiced - passed - ({sub.next_billing_at} if waiting else set())
        if extra:
            audit.problems.append(f"{sub.id}: invoices for periods it has not reached: {sorted(extra)}")

    if expect_final_states:
        by_sub = defaultdict(list)
        for invoice in invoices:
            by_sub[invoice.subscription_id].append(invoice)
        for sub_id, kind in seeded.kinds.items():
            sub, its = subs[sub_id], by_sub[sub_id]
            state = (
                sub.status,
                sub.periods_billed,
                sub.billing_failure_count,
                [i.status for i in its],
                len(charges.get(its[0].id, ())) if its else 0,
            )
            expected = {
                PAYING: ("active", 1, 0, ["paid"], 1),
                DECLINING: ("past_due", 1, 0, ["open"], 0),
                FAILING: ("active", 0, 1, ["open"], 0),
            }[kind]
            if state != expected:
                audit.problems.append(
                    f"{sub_id} ({kind}): (status, periods, failures, invoices, charges) = {state}, expected "
                    f"{expected}; last billing error {sub.last_billing_error!r}"
                )
            if kind == DECLINING and its and not hasattr(its[0], "dunning_run"):
                audit.problems.append(f"{sub_id} (declining): its open invoice has no dunning run")
            if kind == FAILING and sub.next_billing_attempt_at is None:
                audit.problems.append(f"{sub_id} (failing): failure not saved on the retry ladder")
    return audit


def doctor_violations() -> dict[str, tuple[int, list[str]]]:
    """Failing checks of the money-invariant sweep (``manage.py doctor``) → (violations, examples)."""
    from ops import doctor

    return {
        r.name: (r.violations, r.examples or [r.note])
        for r in doctor.run_checks()
        if r.status not in (doctor.OK, doctor.NOT_CHECKED)
    }


def assert_clean(audit: Audit, where: str, proxy=None) -> None:
    """Fail (naming ``where``) if the audit found problems or the doctor finds violations; with the
    proxy, the failure also lists its idempotency-key conflicts."""
    conflicts = idempotency_conflicts(proxy) if proxy is not None else []
    assert audit.problems == [], f"{where}: {audit.problems}; idempotency conflicts at the gateway: {conflicts}"
    violations = doctor_violations()
    assert violations == {}, f"{where}: doctor found {violations}"


def assert_gateway_agrees() -> str:
    """The doctor's gateway comparison (``doctor --gateway``): localstripe itself, not the proxy's log,
    agrees with the books — every paid invoice's PaymentIntent succeeded for its amount, no unpaid
    invoice was charged, no invoice has two succeeded PaymentIntents. Returns its note."""
    from ops import doctor

    result = doctor.check_gateway(max_examples=10)
    assert result.status == doctor.OK, f"{result.status}: {result.examples} {result.note}"
    return result.note


# --- the report -----------------------------------------------------------------------------------------------------


@dataclass
class ReportRow:
    """One experiment's line in the report table (docs/benchmarks/failure-correctness.md)."""

    experiment: str
    runs: int
    kill_points: str
    invoices: int | str
    duplicates: int
    lost: int
    doctor_violations: int
    wall_s: float
    note: str = ""


_report_lock = threading.Lock()


def record_row(row: ReportRow) -> None:
    """Print ``row`` and append it to ``$HARDCOUNT_CORRECTNESS_REPORT`` (JSON lines) when set."""
    print(
        f"\n[correctness] {row.experiment}: runs={row.runs} kill_points={row.kill_points} invoices={row.invoices} "
        f"duplicates={row.duplicates} lost={row.lost} doctor_violations={row.doctor_violations} "
        f"wall={row.wall_s:.1f}s {row.note}"
    )
    path = os.environ.get("HARDCOUNT_CORRECTNESS_REPORT")
    if path:
        with _report_lock, open(path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")


def idempotency_conflicts(proxy) -> list[str]:
    """Requests the proxy refused because their key was first used with other parameters, with the difference."""
    first: dict[str, object] = {}
    out = []
    for entry in proxy.entries():
        key = entry.request.idempotency_key
        if not key:
            continue
        if entry.action in FORWARDED and key not in first:
            first[key] = entry.request
        elif entry.action == "conflict":
            before = first.get(key)
            old = before.params if before else {}
            new = entry.request.params
            diff = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
            history = [
                (e.action, e.status, e.request.params) for e in proxy.entries() if e.request.idempotency_key == key
            ]
            out.append(f"{entry.request.line} key={key}: {diff}; every request under the key: {history}")
    return out
