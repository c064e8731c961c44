"""The billing drain on the demo book, against the SQL limit: subscriptions closed per second.

    .venv/bin/python bench/drain.py                       # the full run: 20,000 subscriptions (~25-40 min)
    .venv/bin/python bench/drain.py --subscriptions 2000 --latency-subscriptions 200   # a quick run (~3 min)
    .venv/bin/python bench/drain.py --modes a --concurrency 8 --profile a:8           # where the time goes
    .venv/bin/python bench/drain.py --subscriptions 200000 --tenants 1000 --modes ad --concurrency 8 \
        --no-sql-limit --claims 0 --rss 20000 200000                                  # the large book
    .venv/bin/python bench/drain.py --shards 1 2 --subscriptions 200000 --shard-tenants 1000 \
        --shard-latency-ms 300 --concurrency 8                # the large book, one shard and two

Each figure bills a fresh copy of the same book: ``seed_demo`` (devstack/seed.py) with
``--subscriptions`` subscriptions and ``--seed``, seeded once into a template database on the
embedded PostgreSQL (or ``DATABASE_URL``'s server) and cloned with ``CREATE DATABASE … TEMPLATE``
before each run, so every run starts from the same rows. About 92% of the book is due (the
rest is trialing); 3% of the cards decline and 1% fail at the gateway, as in the demo.

Figures, each at ``HARDCOUNT_BILLING_CONCURRENCY`` 1 and 8 (``--concurrency``), one drain
(``drain_due``, every tenant, test mode, page size 100) per figure:

- (a) an instant gateway stub inside the process (no HTTP: the drain's own cost);
- (b) the real ``stripe`` library to localstripe (``python -m devstack.devstripe``, restarted
  for each run); the first charge of a customer is three requests (customer, attach,
  PaymentIntent), as in production;
- (c) the stub with 200 ms of latency per charge (``--latency-ms``), on a book of
  ``--latency-subscriptions`` (serially, 200 ms × 20,000 would take 67 minutes);
- (d) the stub with 300 ms of latency per charge (``--latency-d-ms``) on the same book as (a), in the
  same run: the gateway's latency hidden by the charges in flight, held to 80% of (a)'s rate.

``--tenants N`` splits the book over N tenants, each charged through a stub account of its own, so
``--requests-per-s R`` (each account's rate limit; 0, the default, none) bounds each tenant apart.
``--claims N`` times a page claim at page 1 and past N rows the run claimed and left due (added
as copies of one of the book's), against the exclude list it replaced (with ``--old-claims`` ids: its
cost grows with the list times the rows it passes). ``--rss SMALL LARGE`` seeds two books and drains
each in a fresh process at (d)'s latency, printing its peak RSS (``ru_maxrss``) and the ratio.

The SQL limit: the same number of minimal single-row close transactions (claim one due
subscription with ``FOR UPDATE SKIP LOCKED``, insert its invoice, advance its period; commit)
in plain SQL from 1 and from 4 connections (processes), on the same book. Every figure is
printed as a ratio to the 4-connection limit, and the run ends with the targets it is held to.

``--shards 1 2`` measures billing shards instead (docs/decisions/0194-billing-shards.md): a book of
``--subscriptions`` spread over ``--shard-tenants`` tenants, half of them in each of two shards, billed
by one process per shard (forked, each one scheduler drain of its shard, ``drain_due(shard=…)``, under
gateway (a) at ``--concurrency``'s first value, or (d) with ``--shard-latency-ms``), for each count given;
the wall time is the slowest process's, the peak RSS the largest process's. Each figure is printed
beside the first count's (the peer: ``--shards 1 2`` compares one process with two on the same book).

``--profile MODE:CONCURRENCY`` samples that run with py-spy (every thread, 100 Hz) and prints
where the time goes, by our own function and by library; the raw samples stay in
``var/bench/``. Databases ``bench_drain_*`` are dropped at the end.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "ERROR")

STRIPE_KEY = "sk_test_hardcount_localstripe"
EMPTY_DB = "bench_drain_empty"
BOOK_DB = "bench_drain_book"
SMALL_BOOK_DB = "bench_drain_book_small"
RUN_DB = "bench_drain_run"
SHARD_BOOK_DB = "bench_drain_book_sharded"
MODE_NAMES = {
    "a": "(a) instant stub, in-process",
    "b": "(b) stripe library -> localstripe",
    "c": "(c) stub + {latency} ms per charge",
    "d": "(d) stub + {latency_d} ms per charge",
}


# --- databases -------------------------------------------------------------------------------------------------------


def _conninfo(dbname: str) -> dict:
    from django.conf import settings

    db = settings.DATABASES["default"]
    info = {"dbname": dbname, "user": db.get("USER") or None, "host": db.get("HOST") or None}
    if db.get("PORT"):
        info["port"] = db["PORT"]
    if db.get("PASSWORD"):
        info["password"] = db["PASSWORD"]
    return {k: v for k, v in info.items() if v is not None}


def _admin(*statements: str) -> None:
    """Run statements on the server's ``postgres`` database (CREATE/DROP DATABASE need autocommit)."""
    import psycopg

    with psycopg.connect(**_conninfo("postgres"), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _use_database(name: str) -> None:
    """Point Django's default connection (this thread's and every new one) at database ``name``."""
    from django.conf import settings
    from django.db import connections

    connections.close_all()
    settings.DATABASES["default"]["NAME"] = name
    connections.settings["default"]["NAME"] = name
    connections["default"].settings_dict["NAME"] = name


def _clone(template: str, name: str) -> None:
    from django.db import connections

    connections.close_all()
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}" TEMPLATE "{template}"')


def _make_book(name: str, subscriptions: int, seed: int, tenants: int = 1) -> tuple[int, float]:
    """Clone the migrated empty database into ``name`` and seed the demo book there, split evenly over
    ``tenants`` tenants (each its own seed); (due, seconds to seed)."""
    from devstack.seed import seed_demo_book
    from hardcount.models import Tenant

    _clone(EMPTY_DB, name)
    _use_database(name)
    started = time.perf_counter()
    due = 0
    for index in range(tenants):
        tenant = Tenant.objects.create(name=f"Bench {index}")
        share = subscriptions // tenants + (1 if index < subscriptions % tenants else 0)
        summary = seed_demo_book(
            tenant_id=tenant.id, subscriptions=share, seed=seed + index, webhook_url="http://127.0.0.1:1/receiver"
        )
        due += summary.due
    elapsed = time.perf_counter() - started
    _use_database("postgres")
    return due, elapsed


def _prepare_empty() -> None:
    from django.core.management import call_command

    _admin(f'DROP DATABASE IF EXISTS "{EMPTY_DB}" WITH (FORCE)', f'CREATE DATABASE "{EMPTY_DB}"')
    _use_database(EMPTY_DB)
    call_command("migrate", verbosity=0, interactive=False)
    _use_database("postgres")


def _drop_all() -> None:
    from django.db import connections

    connections.close_all()
    names = (RUN_DB, BOOK_DB, SMALL_BOOK_DB, SHARD_BOOK_DB, EMPTY_DB)
    _admin(*(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' for name in names))


# --- the SQL limit ---------------------------------------------------------------------------------------------------

# The minimal close: the drain's claim predicate for one row, the invoice insert on the same unique
# index, the period advance. One round trip each, as a client library sends them.
CLAIM_ONE = """
    SELECT s.id, s.tenant_id, s.customer_id, s.billing_cycle_anchor, s.periods_billed,
           p.interval, p.interval_count, p.amount, p.currency
    FROM billing_subscription s JOIN billing_price p ON p.id = s.price_id
    WHERE s.livemode = false AND s.status IN ('trialing', 'active', 'past_due') AND s.billing_parked_at IS NULL
      AND s.test_clock_id IS NULL AND s.next_billing_at <= now()
      AND (s.next_billing_attempt_at IS NULL OR s.next_billing_attempt_at <= now())
    ORDER BY s.next_billing_at LIMIT 1 FOR UPDATE OF s SKIP LOCKED
"""
INSERT_INVOICE = """
    INSERT INTO billing_invoice (id, tenant_id, livemode, customer_id, subscription_id, status, currency,
        period_start, period_end, subtotal, tax, tax_rate_bps, tax_status, credit_applied, total, amount_due,
        amount_paid, payment_intent_id, attempt_count, created_at, billing_reason, hosted_url_version, total_discount,
        post_payment_credit_notes_amount, pre_payment_credit_notes_amount, hold_reason)
    VALUES (%s, %s, false, %s, %s, 'open', %s, %s, %s, %s, 0, 0, 'not_applicable', 0, %s, %s, 0, '', 0, now(),
        'subscription_cycle', 0, 0, 0, 0, '')
    ON CONFLICT DO NOTHING
"""
ADVANCE = "UPDATE billing_subscription SET periods_billed = %s, next_billing_at = %s, updated_at = now() WHERE id = %s"


def _sql_worker(dbname: str, go, results) -> None:
    import psycopg

    from billing.periods import period_bounds
    from hardcount.ids import new_id

    done = 0
    with psycopg.connect(**_conninfo(dbname)) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        go.wait()
        while True:
            row = conn.execute(CLAIM_ONE).fetchone()
            if row is None:
                conn.rollback()
                break
            sub_id, tenant_id, customer_id, anchor, n, interval, count, amount, currency = row
            start, end = period_bounds(anchor, interval, count, n)
            conn.execute(
                INSERT_INVOICE,
                (new_id("in"), tenant_id, customer_id, sub_id, currency, start, end, amount, amount, amount),
            )
            conn.execute(ADVANCE, (n + 1, end, sub_id))
            conn.commit()
            done += 1
    results.put(done)


def sql_limit(connections_count: int) -> tuple[int, float]:
    """Minimal close transactions from ``connections_count`` processes until none is due; (closes, seconds)."""
    from django.db import connections

    connections.close_all()
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    workers = [context.Process(target=_sql_worker, args=(RUN_DB, go, results)) for _ in range(connections_count)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # let every worker connect before the clock starts
    started = time.perf_counter()
    go.set()
    done = sum(results.get() for _ in workers)
    elapsed = time.perf_counter() - started
    for worker in workers:
        worker.join()
    return done, elapsed


# --- gateways --------------------------------------------------------------------------------------------------------


class StubGateway:
    """A gateway that answers at once (or after ``latency_s``), as localstripe would for the demo's cards.

    ``pm_card_chargeCustomerFail`` declines; an unknown ``pm_demo_unknown_…`` is a 404 error; anything
    else succeeds. The sleep releases the GIL like a socket wait does.
    """

    def __init__(self, latency_s: float = 0.0, account: str = "stub:bench"):
        self.latency_s = latency_s
        self.account = account

    def charge(self, req):
        from billing import gateway as gw
        from devstack.seed import CARD_DECLINES, CARD_UNKNOWN_PREFIX

        if self.latency_s:
            time.sleep(self.latency_s)
        result = gw.ChargeResult(
            outcome=gw.SUCCEEDED,
            gateway_customer_id=req.gateway_customer_id or f"cus_stub_{req.customer_id}",
            payment_method_attached=req.attach_payment_method,
            payment_intent_id=req.payment_intent_id or f"pi_stub_{req.invoice_id}",
        )
        if req.payment_method == CARD_DECLINES:
            result.outcome, result.decline_code, result.http_status = gw.DECLINED, "card_declined", 402
        elif req.payment_method.startswith(CARD_UNKNOWN_PREFIX):
            result.outcome, result.http_status, result.payment_intent_id = gw.ERROR, 404, ""
            result.payment_method_attached = False
            result.error_message = f"InvalidRequestError (404): No such PaymentMethod: '{req.payment_method}'"
        return result


class LocalStripe:
    """``python -m devstack.devstripe`` (in-memory, with the gateway's fixes) on a free port."""

    def __init__(self):
        from tests.billing.conftest import _wait_for

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.child = subprocess.Popen(
            [sys.executable, "-m", "devstack.devstripe", "--port", str(self.port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for(self.port, self.child)
        self.api_base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.child.terminate()
        try:
            self.child.wait(5)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


_real_get_gateway: list = []


def _install_gateway(gateway) -> None:
    """Make ``billing.gateway.get_gateway`` return ``gateway`` (None: the real one, for localstripe), and each
    tenant's charges go to a stub of its own account (``stub:{tenant}``, for the per-account limit)."""
    from billing import gateway as gw
    from billing.services import payments

    if not _real_get_gateway:
        _real_get_gateway.append((gw.get_gateway, payments.gateway_for))
    real_get_gateway, real_gateway_for = _real_get_gateway[0]
    if gateway is None:
        gw.get_gateway, payments.gateway_for = real_get_gateway, real_gateway_for
        return
    stubs: dict[str, StubGateway] = {}

    def gateway_for(tenant_id: str, livemode: bool) -> StubGateway:
        if tenant_id not in stubs:
            stubs[tenant_id] = StubGateway(gateway.latency_s, account=f"stub:{tenant_id}")
        return stubs[tenant_id]

    gw.get_gateway, payments.gateway_for = (lambda: gateway), gateway_for


# --- profiling -------------------------------------------------------------------------------------------------------


class Profiler:
    """py-spy sampling this process (all threads, idle waits left out) into ``path`` (collapsed stacks)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.child = subprocess.Popen(
            [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(os.getpid()),
             "--rate", "100", "--format", "raw", "--output", str(path), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(1.5)

    def stop(self) -> None:
        self.child.send_signal(2)  # SIGINT: py-spy writes its output and exits
        try:
            self.child.wait(30)
        except subprocess.TimeoutExpired:
            self.child.kill()

    def report(self, top: int = 25) -> list[str]:
        """Lines: share of samples by our functions (self + callees) and by library (leaf frames)."""
        if not self.path.exists():
            return [f"  (no profile written: {self.child.stderr.read().decode(errors='replace')[:300]})"]
        ours: collections.Counter = collections.Counter()
        libraries: collections.Counter = collections.Counter()
        total = 0
        for line in self.path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            if any(f.startswith("process ") for f in frames[:1]):
                frames = frames[1:]
            thread = frames[0] if frames else ""
            total += n
            leaf = frames[-1] if frames else "?"
            libraries[_library(leaf)] += n
            seen = set()
            for frame in frames:
                name = _our_function(frame)
                if name and name not in seen:
                    seen.add(name)
                    ours[name] += n
            del thread
        if not total:
            return ["  (no samples)"]
        lines = [f"  {total} samples (all threads, 100 Hz). Inclusive share by our function:"]
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in ours.most_common(top)]
        lines.append("  Exclusive share by where the leaf frame is:")
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in libraries.most_common(12)]
        return lines


def _our_function(frame: str) -> str | None:
    # py-spy raw frames look like "function (path/to/file.py:123)"
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for package in ("billing/", "outbox/", "dunning/", "hardcount/", "leases/", "ops/", "devstack/"):
        marker = str(ROOT / package)
        if path.startswith(marker) or path.startswith(package):
            return f"{path.replace(str(ROOT) + '/', '')}:{name}"
    return None


def _library(frame: str) -> str:
    _, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    if "site-packages/" in path:
        return "lib: " + path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path.startswith(str(ROOT)):
        return "ours: " + path.replace(str(ROOT) + "/", "").split("/", 1)[0]
    if "/lib/python3" in path:
        return "stdlib: " + path.rsplit("/", 1)[-1]
    return frame[:60]


# --- drains ----------------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured run: ``closes`` subscriptions attempted in ``seconds``."""

    label: str
    concurrency: int
    closes: int
    billed: int
    failed: int
    seconds: float
    cpu_seconds: float  # user + system time of this process (every thread) during the run
    server_cpu_seconds: float  # CPU time of the PostgreSQL server during the run (NaN: not a local server)

    @property
    def rate(self) -> float:
        return self.closes / self.seconds if self.seconds else 0.0


def run_drain(mode: str, concurrency: int, *, template: str, latency_ms: float, profile_path: Path | None) -> Figure:
    """Bill a fresh clone of ``template`` with one drain under gateway ``mode``; returns the figure."""
    from django.conf import settings

    from billing import gateway as gw
    from billing.services.drain import drain_due

    _clone(template, RUN_DB)
    _use_database(RUN_DB)
    localstripe = None
    if mode == "b":
        localstripe = LocalStripe()
        settings.STRIPE_API_BASE = localstripe.api_base
        settings.STRIPE_API_KEY = STRIPE_KEY
        gw._gateways.clear()
        _install_gateway(None)
    else:
        _install_gateway(StubGateway(latency_ms / 1000 if mode in "cd" else 0.0))
    profiler = Profiler(profile_path) if profile_path else None
    try:
        server = ServerCpu()
        started, cpu_started, server_started = time.perf_counter(), _cpu_seconds(), server.seconds()
        run = drain_due(livemode=False, trigger="manual", page_size=100, concurrency=concurrency)
        elapsed, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
        server_cpu = server.seconds() - server_started
    finally:
        if profiler:
            profiler.stop()
        if localstripe:
            localstripe.stop()
        _use_database("postgres")
    if profiler:
        print("\n".join(profiler.report()), flush=True)
    label = MODE_NAMES[mode].format(latency=f"{latency_ms:.0f}", latency_d=f"{latency_ms:.0f}")
    return Figure(label, concurrency, run.attempted, run.billed, run.failed, elapsed, cpu, server_cpu)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ServerCpu:
    """CPU seconds used by the PostgreSQL server (postmaster, its live backends, and those it reaped).

    Read from ``/proc``, so only for a server on this machine (the embedded one, or a local
    ``DATABASE_URL``); ``seconds()`` is NaN otherwise.
    """

    def __init__(self):
        import psycopg

        try:
            with psycopg.connect(**_conninfo("postgres")) as conn:
                backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            self.postmaster = int(_proc_stat(backend)[3])
        except (OSError, IndexError, ValueError, psycopg.Error):
            self.postmaster = None

    def seconds(self) -> float:
        if self.postmaster is None:
            return float("nan")
        tick = os.sysconf("SC_CLK_TCK")
        try:
            fields = _proc_stat(self.postmaster)
            ticks = sum(int(v) for v in fields[13:17])  # its own utime, stime and its reaped children's
        except OSError:
            return float("nan")
        for child in Path(f"/proc/{self.postmaster}/task/{self.postmaster}/children").read_text().split():
            try:
                ticks += sum(int(v) for v in _proc_stat(int(child))[13:15])
            except (OSError, IndexError):
                continue  # exited between the two reads: counted in the postmaster's next reading
        return ticks / tick


def _proc_stat(pid: int) -> list[str]:
    """Fields of ``/proc/PID/stat`` (0-based, as in proc(5) minus one), the command name removed."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return [str(pid), "comm", *text.rsplit(")", 1)[1].split()]


# --- shards ----------------------------------------------------------------------------------------------------------


def _make_sharded_book(name: str, subscriptions: int, tenants: int, seed: int) -> int:
    """Clone the empty database into ``name``: ``tenants`` tenants, half in each of two shards, sharing
    ``subscriptions`` demo subscriptions evenly; returns how many are due."""
    from billing.shards import shard_of
    from devstack.seed import seed_demo_book
    from hardcount.models import Tenant

    _clone(EMPTY_DB, name)
    _use_database(name)
    per_shard = {0: 0, 1: 0}
    due = 0
    while sum(per_shard.values()) < tenants:
        tenant = Tenant.objects.create(name=f"Bench {sum(per_shard.values())}")
        shard = shard_of(tenant.id, 2)
        if per_shard[shard] >= tenants // 2:
            tenant.delete()
            continue
        per_shard[shard] += 1
        due += seed_demo_book(
            tenant_id=tenant.id,
            subscriptions=subscriptions // tenants,
            seed=seed + sum(per_shard.values()),
            webhook_url="http://127.0.0.1:1/receiver",
        ).due
    _use_database("postgres")
    return due


def _shard_worker(index: int, count: int, concurrency: int, latency_s: float, go, results) -> None:
    from django.db import connections

    from billing.services.drain import drain_due
    from billing.shards import Shard

    connections.close_all()  # the parent's connection is not this process's
    _use_database(RUN_DB)
    _install_gateway(StubGateway(latency_s))
    go.wait()
    started = time.perf_counter()
    run = drain_due(
        livemode=False, trigger="scheduler", shard=Shard(index, count), page_size=100, concurrency=concurrency
    )
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results.put((index, run.attempted, time.perf_counter() - started, peak_mb))
    connections.close_all()


def run_shards(count: int, concurrency: int, latency_s: float = 0.0) -> tuple[int, float, list[float], float, float]:
    """Bill a fresh clone of the sharded book with one forked process per shard of ``count``.

    ``latency_s`` is the stub gateway's latency per charge. Returns (subscriptions attempted, wall
    seconds of the slowest process, each process's seconds, PostgreSQL's CPU seconds over the run,
    the largest peak RSS of a shard process in MB).
    """
    from django.db import connections

    _clone(SHARD_BOOK_DB, RUN_DB)
    connections.close_all()
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    workers = [
        context.Process(target=_shard_worker, args=(index, count, concurrency, latency_s, go, results))
        for index in range(count)
    ]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # every process set up before the clock starts
    server = ServerCpu()
    server_started = server.seconds()
    started = time.perf_counter()
    go.set()
    done = [results.get() for _ in workers]
    elapsed = time.perf_counter() - started
    for worker in workers:
        worker.join()
    return (
        sum(d[1] for d in done),
        elapsed,
        [d[2] for d in sorted(done)],
        server.seconds() - server_started,
        max(d[3] for d in done),
    )


def _shard_bench(args) -> None:
    concurrency = args.concurrency[0]
    try:
        _prepare_empty()
        started = time.perf_counter()
        due = _make_sharded_book(SHARD_BOOK_DB, args.subscriptions, args.shard_tenants, args.seed)
        print(
            f"  seeded {args.subscriptions} subscriptions over {args.shard_tenants} tenants ({due} due) in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
        rows = []
        for count in args.shards:
            closes, seconds, each, server_cpu, peak_mb = run_shards(count, concurrency, args.shard_latency_ms / 1000)
            rows.append((count, closes, seconds, each, server_cpu, peak_mb))
            print(
                f"  {count} shard(s), {count} process(es), concurrency {concurrency}, "
                f"{args.shard_latency_ms:.0f} ms per charge: {closes} closes in {seconds:.1f} s = "
                f"{closes / seconds:.1f}/s (processes: {', '.join(f'{s:.1f} s' for s in each)}; "
                f"peak RSS {peak_mb:.0f} MB)",
                flush=True,
            )
    finally:
        if not args.keep:
            _drop_all()
    print()
    print(f"{'shards':>6} {'subs':>7} {'wall s':>8} {'min':>6} {'subs/s':>8} {'x first':>8} {'PG ms':>6} {'RSS MB':>7}")
    base = rows[0][1] / rows[0][2] if rows else 0.0
    for count, closes, seconds, _, server_cpu, peak_mb in rows:
        rate = closes / seconds
        print(
            f"{count:>6} {closes:>7} {seconds:>8.1f} {seconds / 60:>6.1f} {rate:>8.1f} {rate / base:>8.2f} "
            f"{1000 * server_cpu / max(1, closes):>6.1f} {peak_mb:>7.0f}"
        )
    if args.shard_latency_ms and rows:
        fastest = min(seconds for _, _, seconds, *_ in rows)
        verdict = "met" if fastest < 600 else "MISSED"
        print(
            f"Target: the book billed in under 10 minutes with {args.shard_latency_ms:.0f} ms per charge: "
            f"{fastest / 60:.1f} min at best -> {verdict}"
        )
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


# --- the claim's cost -----------------------------------------------------------------------------------------------

# The claim as it was before the run's mark: the run's exclude list sent with every claim, rendered into
# the statement's text by Django's client-side binding.
OLD_CLAIM = """
    WITH due AS (
        SELECT id, periods_billed, next_billing_at FROM billing_subscription
        WHERE livemode = false AND {due} AND NOT (id = ANY(%s::text[]))
        ORDER BY next_billing_at LIMIT %s FOR UPDATE SKIP LOCKED
    )
    SELECT id, periods_billed FROM due ORDER BY next_billing_at
"""
BENCH_RUN = "brun_bench_claims"


def _timed_claims(claim, repeats: int) -> float:
    """Median milliseconds of ``claim()`` in its own transaction, rolled back (so every repeat claims the same
    page); the median, since the machine is shared and a single slow repeat says nothing of the claim."""
    import statistics

    from django.db import transaction

    claim()  # warm the plan and the cache
    times = []
    for _ in range(repeats):
        with transaction.atomic():
            started = time.perf_counter()
            claim()
            times.append(time.perf_counter() - started)
            transaction.set_rollback(True)
    return 1000 * statistics.median(times)


def _add_claimed_rows(count: int, start: int = 1) -> tuple:
    """Add ``count`` due subscriptions ahead of the book, marked as claimed by :data:`BENCH_RUN` and left due
    (a run's failures), copied from one of the book's; returns the (next_billing_at, id) of the last."""
    from django.db import connection

    from billing.models import Subscription

    columns = [f.column for f in Subscription._meta.concrete_fields]
    values = {
        "id": "'sub_bench_' || lpad(g::text, 9, '0')",
        "next_billing_at": "t.next_billing_at - interval '30 days'",
        "claimed_by_run": f"'{BENCH_RUN}'",
    }
    select = ", ".join(values.get(c, f"t.{c}") for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO billing_subscription ({', '.join(columns)}) SELECT {select} FROM generate_series(%s, %s) g,"
            " (SELECT * FROM billing_subscription WHERE livemode = false AND status = 'active'"
            " AND test_clock_id IS NULL AND next_billing_at <= now() ORDER BY next_billing_at LIMIT 1) t",
            [start, start + count - 1],
        )
        cursor.execute("ANALYZE billing_subscription")
        cursor.execute(
            "SELECT next_billing_at, id FROM billing_subscription WHERE claimed_by_run = %s"
            " ORDER BY next_billing_at DESC, id DESC LIMIT 1",
            [BENCH_RUN],
        )
        return cursor.fetchone()


def claim_costs(template: str, excluded: int, old_excluded: int, page_size: int = 100, repeats: int = 20) -> list[str]:
    """Page-claim times, the run's mark against the exclude list it replaced: at page 1, and with subscriptions
    the run claimed and left due ahead of the rest (as after that many failures): ``old_excluded`` of them for
    both, then ``excluded`` for the mark alone (the list's cost grows with the list times the rows it passes);
    lines to print."""
    from django.db import connection

    from billing.queries import claim_due_page, due_predicate

    _clone(template, RUN_DB)
    _use_database(RUN_DB)
    try:
        due, due_params = due_predicate(test_clock_id=None, as_of=None)

        def new(after=None):
            return lambda: claim_due_page(
                livemode=False, tenant_id=None, test_clock_id=None, as_of=None, page_size=page_size,
                run_id=BENCH_RUN, after=after,
            )  # fmt: skip

        def old(exclude):
            def claim():
                with connection.cursor() as cursor:
                    cursor.execute(OLD_CLAIM.format(due=due), [*due_params, exclude, page_size])
                    return cursor.fetchall()

            return claim

        first_old, first_new = _timed_claims(old([]), repeats), _timed_claims(new(), repeats)
        last = _add_claimed_rows(old_excluded)
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM billing_subscription WHERE claimed_by_run = %s", [BENCH_RUN])
            ids = [row[0] for row in cursor.fetchall()]
        mid_new = _timed_claims(new(tuple(last)), repeats)
        mid_old = _timed_claims(old(ids), 2)
        started = time.perf_counter()
        last = _add_claimed_rows(excluded - old_excluded, start=old_excluded + 1)
        added_s = time.perf_counter() - started
        deep_new = _timed_claims(new(tuple(last)), repeats)
        lap_new = _timed_claims(new(), 2)
    finally:
        _use_database("postgres")
    ratio = deep_new / first_new
    return [
        f"  claim of a page of {page_size} (median of {repeats}; of 2 for the slow ones), the book plus rows the run "
        f"left due ahead of it ({excluded - old_excluded} of them added in {added_s:.1f} s):",
        f"    run's mark + cursor: page 1 {first_new:7.2f} ms; past {old_excluded} left due {mid_new:7.2f} ms; past "
        f"{excluded} {deep_new:7.2f} ms ({ratio:.2f}x page 1; target <= 1.5x -> {'met' if ratio <= 1.5 else 'MISSED'})",
        f"    run's mark, a new lap from the start (walks the {excluded} once): {lap_new:7.2f} ms",
        f"    exclude list (before): page 1 {first_old:7.2f} ms; with {old_excluded} ids {mid_old:9.2f} ms "
        f"({mid_old / first_old:.0f}x page 1)",
    ]


# --- peak RSS of a drain ---------------------------------------------------------------------------------------------


def drain_child(database: str, latency_ms: float, concurrency: int) -> None:
    """In a fresh process: one drain of ``database`` with the stub gateway; prints its figures as JSON."""
    import json

    from billing.services.drain import drain_due

    _use_database(database)
    _install_gateway(StubGateway(latency_ms / 1000))
    started = time.perf_counter()
    run = drain_due(livemode=False, trigger="manual", page_size=100, concurrency=concurrency)
    print(json.dumps({"attempted": run.attempted, "seconds": time.perf_counter() - started}), flush=True)


def drain_rss(template: str, latency_ms: float, concurrency: int) -> tuple[float, int, float]:
    """Peak RSS (MB) of a fresh process draining a clone of ``template``; (MB, attempted, seconds)."""
    import json

    from django.db import connections

    _clone(template, RUN_DB)
    connections.close_all()
    rate = os.environ.get("HARDCOUNT_GATEWAY_REQUESTS_PER_S", "0")
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--drain-child", RUN_DB, "--latency-ms", str(latency_ms),
         "--concurrency", str(concurrency), "--requests-per-s", rate],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )  # fmt: skip
    out = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"the drain's process exited {child.returncode}")
    figures = json.loads(out.strip().splitlines()[-1])
    return usage.ru_maxrss / 1024, figures["attempted"], figures["seconds"]


# --- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscriptions", type=int, default=20_000, help="book size for (a), (b) and the SQL limit")
    parser.add_argument("--latency-subscriptions", type=int, default=400, help="book size for (c)")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="(c): gateway latency per charge")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", default="abcd", help="which of a, b, c, d to run (default abcd)")
    parser.add_argument("--latency-d-ms", type=float, default=300.0, help="(d): gateway latency per charge")
    parser.add_argument("--tenants", type=int, default=1, help="split the book over this many tenants")
    parser.add_argument(
        "--requests-per-s", type=float, default=0.0, help="each stub account's rate limit, requests/s (0: none)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sql-limit", action=argparse.BooleanOptionalAction, default=True, help="measure it")
    parser.add_argument(
        "--claims", type=int, default=500_000, help="page-claim time past this many left-due rows (0: skip)"
    )
    parser.add_argument("--old-claims", type=int, default=20_000, help="the same for the old exclude list")
    parser.add_argument(
        "--rss", type=int, nargs=2, default=None, metavar=("SMALL", "LARGE"), help="peak RSS of a drain of two books"
    )
    parser.add_argument("--profile", action="append", default=[], help="MODE:CONCURRENCY to sample with py-spy")
    parser.add_argument("--keep", action="store_true", help="keep the bench_drain_* databases")
    parser.add_argument("--shards", type=int, nargs="+", help="measure these billing shard counts instead (e.g. 1 2)")
    parser.add_argument("--shard-tenants", type=int, default=8, help="with --shards: tenants of the book (even)")
    parser.add_argument(
        "--shard-latency-ms", type=float, default=0.0, help="with --shards: the stub gateway's latency per charge"
    )
    parser.add_argument("--drain-child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    os.environ["HARDCOUNT_GATEWAY_REQUESTS_PER_S"] = str(args.requests_per_s)  # the drain's child reads it too
    import django

    django.setup()
    if args.drain_child:
        drain_child(args.drain_child, args.latency_ms, args.concurrency[0])
        return

    if args.shards:
        print(
            f"Billing shards benchmark: {args.subscriptions} subscriptions over {args.shard_tenants} tenants "
            f"(seed {args.seed}); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
            flush=True,
        )
        _shard_bench(args)
        return

    load = os.getloadavg()
    print(
        f"Drain benchmark: demo book of {args.subscriptions} subscriptions (seed {args.seed}); "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start",
        flush=True,
    )
    figures: list[Figure] = []
    try:
        _prepare_empty()
        due, seed_s = _make_book(BOOK_DB, args.subscriptions, args.seed, args.tenants)
        print(
            f"  seeded {args.subscriptions} subscriptions over {args.tenants} tenant(s) ({due} due) in {seed_s:.1f} s",
            flush=True,
        )
        small_due = 0
        if "c" in args.modes:
            small_due, _ = _make_book(SMALL_BOOK_DB, args.latency_subscriptions, args.seed)

        limits = {1: float("nan"), 4: float("nan")}
        for count in (1, 4) if args.sql_limit else ():
            _clone(BOOK_DB, RUN_DB)
            closes, seconds = sql_limit(count)
            limits[count] = closes / seconds
            print(
                f"  SQL limit, {count} connection{'s' if count > 1 else ' '}: {closes} minimal closes in "
                f"{seconds:6.2f} s = {limits[count]:7.1f}/s",
                flush=True,
            )
        limit = limits[4]

        if args.claims:
            for line in claim_costs(BOOK_DB, args.claims, min(args.old_claims, args.claims)):
                print(line, flush=True)

        for mode in "abcd":
            if mode not in args.modes:
                continue
            for concurrency in args.concurrency:
                spec = f"{mode}:{concurrency}"
                profile_path = (
                    ROOT / "var" / "bench" / f"drain-{mode}-{concurrency}.txt" if spec in args.profile else None
                )
                figure = run_drain(
                    mode,
                    concurrency,
                    template=SMALL_BOOK_DB if mode == "c" else BOOK_DB,
                    latency_ms=args.latency_d_ms if mode == "d" else args.latency_ms,
                    profile_path=profile_path,
                )
                figures.append(figure)
                print(_line(figure, limit), flush=True)

        rss = []
        for size in args.rss or ():
            _make_book(SMALL_BOOK_DB, size, args.seed, args.tenants)
            mb, attempted, seconds = drain_rss(SMALL_BOOK_DB, args.latency_d_ms, args.concurrency[-1])
            rss.append((size, mb, attempted, seconds))
            print(
                f"  peak RSS of a drain of {size} subscriptions over {args.tenants} tenant(s), "
                f"{args.latency_d_ms:.0f} ms per charge: {mb:.0f} MB ({attempted} closes in {seconds:.1f} s = "
                f"{attempted / seconds:.1f}/s)",
                flush=True,
            )
    finally:
        if not args.keep:
            _drop_all()

    print()
    print(
        f"{'run':<38} {'conc':>4} {'subs':>6} {'wall s':>8} {'subs/s':>8} {'x SQL-4':>8} {'x SQL-1':>8} "
        f"{'CPU ms':>7} {'PG ms':>6}"
    )
    for figure in figures:
        print(
            f"{figure.label:<38} {figure.concurrency:>4} {figure.closes:>6} {figure.seconds:>8.1f} "
            f"{figure.rate:>8.1f} {figure.rate / limit:>8.3f} {figure.rate / limits[1]:>8.3f} "
            f"{1000 * figure.cpu_seconds / max(1, figure.closes):>7.1f} "
            f"{1000 * figure.server_cpu_seconds / max(1, figure.closes):>6.1f}"
        )
    print(f"{'SQL limit, 1 connection':<38} {'':>4} {'':>6} {'':>8} {limits[1]:>8.1f} {limits[1] / limit:>8.3f}")
    print(f"{'SQL limit, 4 connections':<38} {'':>4} {'':>6} {'':>8} {limit:>8.1f} {1.0:>8.3f}")
    print()
    _targets(figures, limit, args)
    if len(rss) == 2:
        (small, small_mb, *_), (large, large_mb, *_) = rss
        ratio = large_mb / small_mb
        print(
            f"  peak RSS, {large} against {small}: {large_mb:.0f} MB / {small_mb:.0f} MB = {ratio:.2f}x "
            f"(target <= 1.5x) -> {'met' if ratio <= 1.5 else 'MISSED'}"
        )
    if "c" in args.modes:
        serial_min = args.latency_ms * args.subscriptions / 60000
        print(
            f"(c) ran on a book of {args.latency_subscriptions} ({small_due} due), not the full book: serially, "
            f"{args.latency_ms:.0f} ms x {args.subscriptions} would take {serial_min:.0f} min."
        )
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def _line(figure: Figure, limit: float) -> str:
    return (
        f"  {figure.label} at concurrency {figure.concurrency}: {figure.closes} closes ({figure.billed} billed, "
        f"{figure.failed} failed) in {figure.seconds:7.1f} s = {figure.rate:7.1f}/s = {figure.rate / limit:.3f} x the "
        f"4-connection SQL limit; CPU per close: {1000 * figure.cpu_seconds / max(1, figure.closes):.1f} ms here, "
        f"{1000 * figure.server_cpu_seconds / max(1, figure.closes):.1f} ms in PostgreSQL"
    )


def _targets(figures: list[Figure], limit: float, args) -> None:
    by = {(f.label[1], f.concurrency): f for f in figures}
    print("Targets (docs/benchmarks/drain.md):")
    a8 = by.get(("a", 8))
    if a8:
        verdict = "met" if a8.rate >= 0.4 * limit else "MISSED"
        print(f"  (a) at concurrency 8 >= 40% of the 4-connection SQL limit: {100 * a8.rate / limit:.1f}% -> {verdict}")
    for concurrency in args.concurrency:
        a, d = by.get(("a", concurrency)), by.get(("d", concurrency))
        if a and d:
            share = d.rate / a.rate
            print(
                f"  (d) {args.latency_d_ms:.0f} ms per charge >= 80% of (a) at concurrency {concurrency}: "
                f"{100 * share:.1f}% -> {'met' if share >= 0.8 else 'MISSED'}"
            )
    c1, c8 = by.get(("c", 1)), by.get(("c", 8))
    if c1 and c8:
        speedup = c8.rate / c1.rate
        print(f"  (c) concurrency 8 >= 7x concurrency 1: {speedup:.2f}x -> {'met' if speedup >= 7 else 'MISSED'}")
    b8 = by.get(("b", 8))
    if b8:
        whole = b8.seconds * 20_000 / max(1, args.subscriptions)
        scaled = "" if args.subscriptions == 20_000 else f" (scaled from {args.subscriptions}: {b8.seconds:.1f} s)"
        print(
            f"  (b) the 20,000 book through localstripe at concurrency 8 under 5 min: {whole:.0f} s{scaled} -> "
            f"{'met' if whole < 300 else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
