"""Sustained deliveries per second through the outbox executor, beside Procrastinate on the same database.

    .venv/bin/python bench/outbox_delivery.py [--processes 1,2,3] [--workers 8] [--seconds 60] [--backlog 130000]
                                              [--sides procrastinate,poll,nats]

Both sides do the same work per job: claim a row from PostgreSQL, POST the same signed
JSON body to a local receiver that answers 200 at once, and record completion in the
database. Hardcount's executor also writes an attempt row per delivery and checks its
lease on every write; Procrastinate (the Python PostgreSQL job queue, ``procrastinate``
3.x) runs an async task posting with httpx's client. For each number of processes, each
side gets a backlog of ``--backlog`` jobs and that many processes, each with ``--workers``
concurrent jobs (Procrastinate's ``concurrency``), and runs for ``--seconds``; completions
are counted every ``--every`` seconds (the rate per window is printed as it goes). The
receiver is an asyncio HTTP/1.1 server in its own process; the executors and the
Procrastinate workers are processes of their own too.

Runs in a throw-away database (``bench_outbox``, created and migrated, dropped at the end)
on the embedded PostgreSQL or ``DATABASE_URL``. Prints a table: each side's mean rate over
the run and its slowest window, per number of processes, and the ratio Hardcount / Procrastinate.
A run whose backlog ran out before the end says so (raise ``--backlog``).

The executor runs twice per number of processes, on the same deliveries, receiver and concurrency: with
the claim query (``poll``, the default dispatch) and through a stream (``nats``,
``HARDCOUNT_DELIVERY_DISPATCH=nats``: the loader publishes every delivery id after commit to a
``nats-server -js`` the bench starts on a free port with a temporary store, and the executors pull ids
from the shared durable consumer; docs/decisions/0200). The stream side's backlog is published before
its clock starts; each executor process prints how many rows the stream brought and how many its sweep
claimed. Without ``nats-server`` (``make nats``) the stream side is left out, saying so.

Beside each executor side's rate the bench prints what a delivery cost the primary in that side's
run, from the server's own counters read before its processes start and after they have exited (a
session's statistics reach ``pg_stat_database`` when it ends): commits per delivery (``xact_commit``
+ ``xact_rollback`` of the bench database), WAL bytes per delivery (``pg_current_wal_lsn()``; the
WAL is the whole server's, so this holds only because the sides run one after another, each after a
``CHECKPOINT`` so each starts with the same full-page writes to make), and statements per delivery
when ``pg_stat_statements`` is loaded. Then, with nothing due, one idle executor process per dispatch
(the executor's own poll interval of 1 s and sweep of 5 s) runs for ``--idle-seconds``: the
transactions per second it alone costs the primary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_outbox")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


# --- the receiver (its own process) -----------------------------------------------------


class _Receiver(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: reads each request (headers + Content-Length body), answers 200."""

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = 0
            for line in self.buffer[:head_end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            self.buffer = self.buffer[end:]
            self.transport.write(RESPONSE)


def _serve(port_queue) -> None:
    async def main():
        server = await asyncio.get_running_loop().create_server(_Receiver, "127.0.0.1", 0, backlog=1024)
        port_queue.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


# --- Hardcount ----------------------------------------------------------------------------


def _executor_process(
    conninfo: str, workers: int, nats_url: str | None, index: int, ready, stop, poll_interval_s: float = 0.05
) -> None:
    """One executor process (the bench's DATABASE_URL and allowlist come from the environment).

    With ``nats_url`` it dispatches through the stream there, else with the claim query.
    """
    import django

    django.setup()
    from outbox.executor import Executor, ExecutorConfig
    from outbox.stream import NatsDeliveryStream

    dispatch = "nats" if nats_url else "poll"
    config = ExecutorConfig(workers=workers, timeout_s=10, poll_interval_s=poll_interval_s, dispatch=dispatch)
    stream = NatsDeliveryStream(nats_url, ack_wait_s=config.stream_ack_wait_s) if nats_url else None
    executor = Executor(config, executor_id=f"bench-{index}", conninfo=conninfo, stream=stream).start()
    ready.set()
    stop.wait()
    executor.stop()
    if nats_url:
        c = executor.stats.counts
        print(
            f"    executor {index}: {c['stream_claimed']} rows from the stream ({c['stream_messages']} messages), "
            f"{c['swept']} swept, {c['polled']} polled while the stream was down",
            flush=True,
        )


# --- the stream engine (its own process) ---------------------------------------------------


class NatsServer:
    """``nats-server -js`` on a free port with a temporary store, for the stream side; ``None`` url if absent."""

    def __init__(self):
        binary = shutil.which("nats-server") or (
            "/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None
        )
        self.url = None
        self.process = None
        if binary is None:
            return
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.store = tempfile.mkdtemp(prefix="bench-nats-")
        self.process = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", self.store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                self.url = f"nats://127.0.0.1:{port}"
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            shutil.rmtree(self.store, ignore_errors=True)


def purge_stream(url: str) -> None:
    """Empty the stream and its consumer's backlog (the previous run's ids)."""
    from outbox.stream import NatsDeliveryStream

    async def run() -> None:
        stream = NatsDeliveryStream(url)
        try:
            js = await stream._connection(consume=False)
            await js.purge_stream(stream.stream)
        finally:
            await stream.close()

    asyncio.run(run())


def load_hardcount(url: str, backlog: int, *, nats_url: str | None = None) -> None:
    """Empty the outbox and queue ``backlog`` deliveries of ``invoice.paid`` to one endpoint at ``url``.

    With ``nats_url``, the writer publishes every delivery's id there after commit (the stream side);
    returns once all are published.
    """
    from django.conf import settings
    from django.db import connection, transaction

    from hardcount.models import Tenant
    from outbox import stream as stream_module
    from outbox.models import WebhookEndpoint
    from outbox.services import emit_events
    from outbox.signing import generate_secret

    settings.HARDCOUNT_DELIVERY_DISPATCH = "nats" if nats_url else "poll"
    if nats_url:
        settings.HARDCOUNT_NATS_URL = nats_url
        purge_stream(nats_url)
        stream_module._publishers[:] = [stream_module.Publisher()]

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE outbox_deliveryattempt, outbox_delivery, outbox_event, outbox_webhookendpoint CASCADE")
    tenant = Tenant.objects.create(name="bench")
    secret = generate_secret()
    WebhookEndpoint.objects.create(tenant=tenant, livemode=False, url=url, enabled_events=["*"], secret=secret)
    for start in range(0, backlog, 20000):
        with transaction.atomic():
            numbers = range(start, min(backlog, start + 20000))
            events = [("invoice.paid", {"id": f"in_{i}", "n": i}, None) for i in numbers]
            emit_events(events, tenant_id=tenant.id, livemode=False)
    if nats_url:
        publisher = stream_module.publisher()
        if not publisher.flush(300):
            raise RuntimeError("the delivery ids were not published in 300 s")
        publisher.stop()
        stream_module._publishers[:] = []
        settings.HARDCOUNT_DELIVERY_DISPATCH = "poll"
        if publisher.published != backlog:
            raise RuntimeError(f"{publisher.published} of {backlog} ids published ({publisher.dropped} dropped)")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE outbox_delivery")
        cursor.execute("VACUUM ANALYZE outbox_event")


def hardcount_done() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM outbox_delivery WHERE status = 'succeeded'")
        return cursor.fetchone()[0]


def check_hardcount() -> None:
    """Every delivered row has exactly one succeeded attempt row; nothing failed."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM outbox_delivery WHERE status = 'succeeded'),"
            " (SELECT count(*) FROM outbox_deliveryattempt WHERE outcome = 'succeeded'),"
            " (SELECT count(*) FROM outbox_delivery WHERE status = 'failed')"
        )
        delivered, attempts, failed = cursor.fetchone()
    assert delivered == attempts and failed == 0, (delivered, attempts, failed)


# --- what the primary sees ------------------------------------------------------------------


class PrimaryMeter:
    """The server's counters for the bench database, read from a session on the ``postgres`` database.

    Reading from another database keeps the meter's own transactions out of the counts.
    """

    def __init__(self, conninfo: str, database: str):
        import psycopg

        parts = {**psycopg.conninfo.conninfo_to_dict(conninfo), "dbname": "postgres", "application_name": "bench"}
        self.conn = psycopg.connect(**parts, autocommit=True)
        self.database = database
        preload = self.conn.execute("SELECT current_setting('shared_preload_libraries')").fetchone()[0]
        self.statements = "pg_stat_statements" in preload
        if self.statements:
            with psycopg.connect(conninfo, autocommit=True) as bench_db:
                bench_db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def checkpoint(self) -> None:
        """Start the next side after a checkpoint: each then pays the same full-page writes."""
        self.conn.execute("CHECKPOINT")

    def settled(self) -> dict:
        """The counters once no session is left on the bench database (its statistics are flushed at exit).

        Closes this process's own Django connection first; the next query opens another.
        """
        from django.db import connection

        connection.close()
        deadline = time.monotonic() + 30
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
        while self.conn.execute(query, (self.database,)).fetchone()[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a session leaves pg_stat_activity just before its statistics are flushed
        return self.read()

    def read(self) -> dict:
        """Commits + rollbacks of the bench database, the WAL position, statements (or None), and the time."""
        row = self.conn.execute(
            "SELECT xact_commit + xact_rollback, pg_current_wal_lsn() FROM pg_stat_database WHERE datname = %s",
            (self.database,),
        ).fetchone()
        statements = None
        if self.statements:
            statements = self.conn.execute(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
                " WHERE d.datname = %s",
                (self.database,),
            ).fetchone()[0]
        return {"xacts": row[0], "lsn": row[1], "statements": statements, "at": time.perf_counter()}

    def autovacuum(self) -> bool:
        """Whether an autovacuum worker is working in the bench database now."""
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'autovacuum worker'"
        return self.conn.execute(query, (self.database,)).fetchone()[0] > 0

    def wal_bytes(self, before: dict, after: dict) -> int:
        return self.conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (after["lsn"], before["lsn"])).fetchone()[0]

    def per(self, before: dict, after: dict, n: float) -> dict:
        """Commits, WAL bytes and statements (None without pg_stat_statements) between two readings, per ``n``."""
        statements = None
        if after["statements"] is not None:
            statements = (after["statements"] - before["statements"]) / n
        return {
            "commits": (after["xacts"] - before["xacts"]) / n,
            "wal": float(self.wal_bytes(before, after)) / n,
            "statements": statements,
        }


def idle_cost(meter: PrimaryMeter, conninfo: str, workers: int, nats_url: str | None, seconds: float) -> dict:
    """Transactions/s and WAL bytes/s the primary sees from one idle executor process (nothing due).

    The executor runs with its own poll interval (1 s). The window opens 11 s after it is ready: a
    session holds back statistics of transactions less than 1 s apart for up to 10 s idle, so its
    start-up's would otherwise land in the window; its end is read after the process exited.
    """
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_executor_process, args=(conninfo, workers, nats_url, 0, ready, stop, 1.0), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise RuntimeError(f"idle executor {proc.pid} did not start")
    time.sleep(11)
    before = meter.read()
    autovacuum = False  # its transactions and WAL would count too: said beside the figure
    while time.perf_counter() - before["at"] < seconds:
        autovacuum |= meter.autovacuum()
        time.sleep(0.1)
    stop.set()
    elapsed = time.perf_counter() - before["at"]
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    return {**meter.per(before, meter.settled(), elapsed), "autovacuum": autovacuum}


# --- Procrastinate ------------------------------------------------------------------------


def _procrastinate_app(conninfo: str, url: str, workers: int):
    import httpx
    import procrastinate

    from outbox.signing import generate_secret, sign

    secret = generate_secret()
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))
    client: dict[str, httpx.AsyncClient] = {}

    @app.task(name="deliver")
    async def deliver(n: int) -> None:
        if "c" not in client:
            limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
            client["c"] = httpx.AsyncClient(timeout=httpx.Timeout(10, connect=5), limits=limits, trust_env=False)
        body = json.dumps(
            {"id": f"evt_{n}", "object": "event", "type": "invoice.paid", "data": {"id": f"in_{n}", "n": n}},
            separators=(",", ":"),
        ).encode()
        headers = {"Content-Type": "application/json", "Hardcount-Signature": sign(body, secret)}
        async with asyncio.timeout(10):
            response = await client["c"].post(url, content=body, headers=headers)
        response.raise_for_status()

    return app, deliver


def _procrastinate_process(conninfo: str, url: str, workers: int, index: int, ready, stop) -> None:
    import django

    django.setup()
    app, _ = _procrastinate_app(conninfo, url, workers)

    async def run() -> None:
        async with app.open_async():
            options = {"concurrency": workers, "wait": True, "install_signal_handlers": False}
            worker = asyncio.create_task(app.run_worker_async(name=f"bench-{index}", **options))
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.2)
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(run())


def load_procrastinate(conninfo: str, url: str, workers: int, backlog: int) -> None:
    app, deliver = _procrastinate_app(conninfo, url, workers)

    async def run() -> None:
        async with app.open_async():
            exists = await app.connector.execute_query_one_async("SELECT to_regclass('procrastinate_jobs') AS t")
            if exists["t"] is None:
                await app.schema_manager.apply_schema_async()
            await app.connector.execute_query_async("TRUNCATE procrastinate_jobs CASCADE")
            for start in range(0, backlog, 20000):
                await deliver.batch_defer_async(*({"n": i} for i in range(start, min(backlog, start + 20000))))
            await app.connector.execute_query_async("ANALYZE procrastinate_jobs")

    asyncio.run(run())


def procrastinate_done() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
        return cursor.fetchone()[0]


# --- a sustained run ------------------------------------------------------------------------


def sustained(name: str, target, args_of, done, *, processes: int, seconds: float, every: float, backlog: int) -> dict:
    """Start ``processes`` of ``target``, count completions every ``every`` s for ``seconds``; the figures."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    started = []
    for index in range(processes):
        ready = ctx.Event()
        proc = ctx.Process(target=target, args=(*args_of(index), ready, stop), daemon=True)
        proc.start()
        started.append((proc, ready))
    for proc, ready in started:
        if not ready.wait(60):
            raise RuntimeError(f"{name} process {proc.pid} did not start")
    windows: list[float] = []
    last, t_last = done(), time.perf_counter()
    first, t_first = last, t_last
    ran_out = None
    try:
        while t_last - t_first < seconds - 1e-6:
            time.sleep(max(0.0, t_first + (len(windows) + 1) * every - time.perf_counter()))
            now_done, now = done(), time.perf_counter()
            windows.append((now_done - last) / (now - t_last))
            print(f"    {name:<14} {processes} process(es) {now - t_first:5.1f} s: {windows[-1]:7.0f}/s", flush=True)
            last, t_last = now_done, now
            if now_done >= backlog:
                ran_out = now - t_first
                break
    finally:
        stop.set()
        for proc, _ in started:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    mean = (last - first) / (t_last - t_first)
    return {"mean": mean, "slowest": min(windows), "windows": windows, "ran_out": ran_out}


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2,3", help="comma-separated process counts (default 1,2,3)")
    parser.add_argument("--workers", type=int, default=8, help="concurrent jobs per process (default 8)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=5.0, help="window of the printed rates, s (default 5)")
    parser.add_argument("--backlog", type=int, default=130000, help="jobs queued before each run (default 130000)")
    parser.add_argument(
        "--idle-seconds", type=float, default=15.0, help="each idle executor's window, s (0: not measured)"
    )
    parser.add_argument(
        "--sides",
        default="procrastinate,poll,nats",
        help="what runs: procrastinate, poll (the executor with the claim query), nats (through the stream)",
    )
    args = parser.parse_args()
    counts = [int(p) for p in args.processes.split(",")]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from outbox.executor import conninfo_from_django

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    receiver = ctx.Process(target=_serve, args=(queue,), daemon=True)
    receiver.start()
    port = queue.get(timeout=10)
    url = f"http://127.0.0.1:{port}/hook"
    # Webhook deliveries reach only public addresses unless an operator allows one (decision 0123);
    # the environment carries the allowlist to the executor processes.
    settings.HARDCOUNT_OUTBOUND_ALLOW = [*settings.HARDCOUNT_OUTBOUND_ALLOW, f"127.0.0.1:{port}"]
    os.environ["HARDCOUNT_OUTBOUND_ALLOW"] = ",".join(settings.HARDCOUNT_OUTBOUND_ALLOW)

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    db = connection.settings_dict
    os.environ["DATABASE_URL"] = (
        f"postgresql://{quote(db['USER'] or 'postgres')}@localhost:{db['PORT'] or 5432}/{db['NAME']}"
        f"?host={quote(db['HOST'])}"
    )
    nats = NatsServer() if "nats" in sides else None
    if nats is not None and nats.url is None:
        print("  nats-server is not installed (make nats): the stream side is left out", flush=True)
        sides.remove("nats")
    results: dict[int, dict[str, dict]] = {}
    idle: dict[str, dict] = {}
    common = {"seconds": args.seconds, "every": args.every, "backlog": args.backlog}
    try:
        conninfo = conninfo_from_django()
        meter = PrimaryMeter(conninfo, db["NAME"])
        for processes in counts:
            print(f"  {processes} process(es) x {args.workers} workers, {args.seconds:g} s each:", flush=True)
            results[processes] = {}
            if "procrastinate" in sides:
                load_procrastinate(conninfo, url, args.workers, args.backlog)
                results[processes]["procrastinate"] = sustained(
                    "procrastinate",
                    _procrastinate_process,
                    lambda i: (conninfo, url, args.workers, i),
                    procrastinate_done,
                    processes=processes,
                    **common,
                )
            for side in ("poll", "nats"):
                if side not in sides:
                    continue
                nats_url = nats.url if side == "nats" else None
                load_hardcount(url, args.backlog, nats_url=nats_url)
                meter.checkpoint()
                before, load = meter.settled(), os.getloadavg()[0]
                figures = sustained(
                    f"hardcount {side}",
                    _executor_process,
                    lambda i, nats_url=nats_url: (conninfo, args.workers, nats_url, i),
                    hardcount_done,
                    processes=processes,
                    **common,
                )
                after = meter.settled()
                figures["load"] = f"{load:.1f} → {os.getloadavg()[0]:.1f}"
                figures["delivered"] = hardcount_done()
                figures["cost"] = meter.per(before, after, max(1, figures["delivered"]))
                results[processes][f"hardcount {side}"] = figures
                check_hardcount()
        for side in ("poll", "nats") if args.idle_seconds > 0 else ():
            if side not in sides:
                continue
            nats_url = nats.url if side == "nats" else None
            load_hardcount(url, 0, nats_url=nats_url)  # nothing due, an empty stream
            with connection.cursor() as cursor:
                # Else autovacuum, after the runs' updates and the truncation, lands in the window. In this
                # order: ANALYZE leaves dead rows in pg_statistic, VACUUM removes them.
                cursor.execute("ANALYZE")
                cursor.execute("VACUUM")
            meter.settled()
            load = os.getloadavg()[0]
            idle[side] = idle_cost(meter, conninfo, args.workers, nats_url, args.idle_seconds)
            idle[side]["load"] = f"{load:.1f} → {os.getloadavg()[0]:.1f}"
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
        receiver.terminate()
        if nats is not None:
            nats.stop()

    print(f"outbox delivery, sustained {args.seconds:g} s, {args.workers} workers per process (deliveries/s):")
    names = [n for n in ("hardcount poll", "hardcount nats", "procrastinate") if n.split()[-1] in sides]
    print("  processes | " + " | ".join(f"{n} mean (slowest {args.every:g} s)" for n in names) + " | ratios")
    for processes, figures in results.items():
        cells = [f"{figures[n]['mean']:7.0f} ({figures[n]['slowest']:7.0f})".ljust(len(n) + 19) for n in names]
        ratios = []
        if "hardcount nats" in figures and "hardcount poll" in figures:
            ratios.append(f"nats/poll {figures['hardcount nats']['mean'] / figures['hardcount poll']['mean']:.2f}")
        for n in ("hardcount poll", "hardcount nats"):
            if n in figures and "procrastinate" in figures:
                ratio = figures[n]["mean"] / figures["procrastinate"]["mean"]
                ratios.append(f"{n.split()[1]}/procrastinate {ratio:.2f}")
        note = "".join(
            f"  [{name} backlog ran out at {fig['ran_out']:.0f} s]" for name, fig in figures.items() if fig["ran_out"]
        )
        print(f"  {processes:9d} | " + " | ".join(cells) + " | " + ", ".join(ratios) + note)
    if any(n.startswith("hardcount") for n in names):
        print("the primary's cost per delivery, each side's run alone on the server:")
        print("  processes | side | deliveries | commits | WAL bytes | statements | load average")
    for processes, figures in results.items():
        for n in ("hardcount poll", "hardcount nats"):
            if n not in figures:
                continue
            fig, cost = figures[n], figures[n]["cost"]
            statements = "—" if cost["statements"] is None else f"{cost['statements']:.2f}"
            print(
                f"  {processes:9d} | {n.split()[1]:<4} | {fig['delivered']:10d} | {cost['commits']:7.3f} | "
                f"{cost['wal']:9.0f} | {statements:>10} | {fig['load']}"
            )
    if results and not meter.statements:
        print("  (statements: pg_stat_statements is not in shared_preload_libraries, left out)")
    if idle:
        print(f"one idle executor process, nothing due, {args.idle_seconds:g} s (per second):")
        print("  side | transactions | WAL bytes | statements | load average")
        for side, cost in idle.items():
            statements = "—" if cost["statements"] is None else f"{cost['statements']:.2f}"
            note = "  [autovacuum ran in the window: counted too]" if cost["autovacuum"] else ""
            print(
                f"  {side:<4} | {cost['commits']:12.2f} | {cost['wal']:9.0f} | {statements:>10} | {cost['load']}{note}"
            )


if __name__ == "__main__":
    main()
