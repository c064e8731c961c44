"""PostgreSQL sessions per replica, as the server counts them, beside what the settings add up to.

    .venv/bin/python bench/replica_connections.py [--seconds 15] [--subscriptions 1500] [--replicas 10]
                                                  [--backlog 30000]

Starts real replicas against a throw-away database (``bench_connections``, created and migrated,
dropped at the end) directly, not through a pooler, each with its own ``application_name``, and
samples ``pg_stat_activity`` every 100 ms for ``--seconds`` per phase; prints each replica's peak
and its median over the phase (the executors' pools apart: they name their sessions ``hardcount-outbox``
whichever replica they belong to, so they are counted over every replica running at the time):

1. a ``runscheduler`` with the defaults (every role, the webhook executor) alone: it takes every lease;
2. a second one beside it: a follower;
3. a gunicorn replica (``HARDCOUNT_RUN_SCHEDULER=1``, one worker, the default 4 request threads), also
   a follower, while 8 client threads call ``/health/ready`` (each call reads the database) without pause;
4. a replica draining a seeded book (``seed_demo``'s, ``--subscriptions``, through the
   in-memory dev Stripe, billing ticking every second) at the default concurrency (8), alone;
5. ``--replicas`` gunicorn replicas started together, on an empty delivery queue (``--keep-queue``: with
   the drain's deliveries, to endpoints that refuse, left queued): the sum of all their sessions, as a
   server without a pooler carries them;
6. the same fleet delivering ``--backlog`` queued deliveries to it.

Beside each phase, the count the settings predict (docs/scale.md, docs/operations.md#connections)
and the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Last: bench/leases.py must not shadow the leases app.
sys.path.append(str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_connections")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Replica:
    """A replica process (``runscheduler``, or gunicorn with the runtime) whose sessions carry ``name``."""

    def __init__(self, name: str, url: str, env: dict[str, str], *, web: bool = False):
        self.name = name
        self.port = _free_port() if web else None
        full_env = {**os.environ, "DATABASE_URL": f"{url}&application_name={name}", **env}
        if web:
            full_env.update(HARDCOUNT_BIND=f"127.0.0.1:{self.port}", HARDCOUNT_RUN_SCHEDULER="1")
            full_env.setdefault("HARDCOUNT_WEB_WORKERS", "1")
            command = [sys.executable, "-m", "gunicorn", "-c", "hardcount/gunicorn.conf.py", "hardcount.wsgi"]
        else:
            command = [sys.executable, "manage.py", "runscheduler"]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(5)


# The webhook executor's pool names its sessions so whatever the replica's DATABASE_URL says
# (outbox.executor.conninfo_from_django): its sessions are counted over every replica running so far.
OUTBOX = "hardcount-outbox"


def sessions_by_name() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend' GROUP BY 1"
        )
        return dict(cursor.fetchall())


def sample(names: list[str], seconds: float) -> dict[str, tuple[int, float]]:
    """name → (peak, median) of its sessions over ``seconds``, every 100 ms."""
    seen: dict[str, list[int]] = {name: [] for name in names}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = sessions_by_name()
        for name in names:
            seen[name].append(now.get(name, 0))
        time.sleep(0.1)
    return {name: (max(values), statistics.median(values)) for name, values in seen.items()}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def leases_held() -> dict[str, str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT role, holder FROM leases_leaderlease WHERE expires_at > now() AND holder IS NOT NULL")
        return dict(cursor.fetchall())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="sampling time per phase (default 15)")
    parser.add_argument("--replicas", type=int, default=10, help="the fleet of the last phases (default 10)")
    parser.add_argument(
        "--keep-queue",
        action="store_true",
        help="leave the drain's deliveries (to endpoints that refuse) queued for the fleet's first phase",
    )
    parser.add_argument("--backlog", type=int, default=30000, help="deliveries queued for the fleet (default 30000)")
    parser.add_argument("--subscriptions", type=int, default=1500, help="the book the drain phase bills (default 1500)")
    args = parser.parse_args()

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from drain import LocalStripe
    from outbox_delivery import _serve as serve_receiver
    from outbox_delivery import load_hardcount

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    db = connection.settings_dict
    url = (
        f"postgresql://{quote(db['USER'] or 'postgres')}@localhost:{db['PORT'] or 5432}/{db['NAME']}"
        f"?host={quote(db['HOST'])}"
    )
    gateway = LocalStripe()
    env = {
        "STRIPE_API_BASE": gateway.api_base,
        "STRIPE_API_KEY": "sk_test_bench",
        "HARDCOUNT_BILLING_INTERVAL_S": "3600",
        "HARDCOUNT_OUTBOUND_ALLOW": "127.0.0.1:1",
    }
    replicas: list[Replica] = []
    rows: list[tuple[str, str, int, float, str, str, str]] = []

    def phase(label: str, name: str, predicted: str) -> None:
        before = os.getloadavg()[0]
        seen = sample([name, OUTBOX], args.seconds)
        (peak, median), (outbox_peak, outbox_median) = seen[name], seen[OUTBOX]
        outbox = f"{outbox_peak} ({outbox_median:g})"
        rows.append((label, name, peak, median, outbox, predicted, f"{before:.1f} → {os.getloadavg()[0]:.1f}"))
        print(f"  {label}: peak {peak}, median {median:g}; executors' {outbox} (predicted {predicted})", flush=True)

    from hardcount.scheduler.registry import configured_roles

    tickers = len(configured_roles())
    executor = settings.HARDCOUNT_OUTBOX_WORKERS + 3
    web_threads = os.environ.get("HARDCOUNT_WEB_THREADS", "4")  # hardcount/gunicorn.conf.py reads it, not the settings
    try:
        first = Replica("hc-first", url, env)
        replicas.append(first)
        wait_for(lambda: len(leases_held()) >= tickers, 120, "the first replica to take every lease")
        time.sleep(3)  # its executor's pool settles
        phase(
            "runscheduler, every lease, idle",
            "hc-first",
            f"{tickers} tickers + {tickers} heartbeats + executor pool 1…{executor} + LISTEN 1",
        )

        second = Replica("hc-second", url, env)
        replicas.append(second)
        wait_for(lambda: sessions_by_name().get("hc-second", 0) >= tickers, 120, "the second replica's tickers")
        time.sleep(3)
        phase("runscheduler, follower, idle", "hc-second", f"{tickers} tickers + executor pool 1…{executor} + LISTEN 1")

        web = Replica("hc-web", url, env, web=True)
        replicas.append(web)
        wait_for(lambda: sessions_by_name().get("hc-web", 0) >= tickers, 120, "the web replica's tickers")
        stop = threading.Event()

        def call() -> None:
            while not stop.is_set():
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{web.port}/health/ready", timeout=10).read()
                except OSError:
                    time.sleep(0.1)

        callers = [threading.Thread(target=call, daemon=True) for _ in range(8)]
        for caller in callers:
            caller.start()
        phase(
            "gunicorn worker, follower, 8 callers of /health/ready",
            "hc-web",
            f"{tickers} tickers + executor pool 1…{executor} + LISTEN 1 + {web_threads} threads",
        )
        stop.set()

        from devstack.seed import seed_demo_book
        from hardcount.models import Tenant

        tenant = Tenant.objects.create(name="Bench")
        seed_demo_book(tenant_id=tenant.id, subscriptions=args.subscriptions, webhook_url="http://127.0.0.1:1/hook")
        for replica in (first, second, web):
            replica.stop()
            replicas.remove(replica)
        # A leader that bills every second, alone: it takes every lease and drains the book at once.
        drainer = Replica("hc-drain", url, {**env, "HARDCOUNT_BILLING_INTERVAL_S": "1"})
        replicas.append(drainer)
        wait_for(
            lambda: leases_held().get("billing", "").split(":")[1:2] == [str(drainer.process.pid)],
            120,
            "the drainer to lead billing",
        )
        concurrency = settings.HARDCOUNT_BILLING_CONCURRENCY
        phase(
            f"runscheduler, billing leader draining {args.subscriptions}",
            "hc-drain",
            f"the idle leader's + {concurrency} close workers (+ the page in flight's claim)",
        )
        drainer.stop()
        replicas.remove(drainer)

        # The fleet: --replicas gunicorn replicas at once, directly on the server, as without a pooler; first on
        # an empty delivery queue, then delivering a backlog to a local receiver that answers 200 at once.
        if not args.keep_queue:
            with connection.cursor() as cursor:
                cursor.execute("TRUNCATE outbox_deliveryattempt, outbox_delivery")
        ctx = multiprocessing.get_context("spawn")
        ports = ctx.Queue()
        receiver = ctx.Process(target=serve_receiver, args=(ports,), daemon=True)
        receiver.start()
        hook = f"127.0.0.1:{ports.get(timeout=30)}"
        fleet_env = {**env, "HARDCOUNT_OUTBOUND_ALLOW": f"{env['HARDCOUNT_OUTBOUND_ALLOW']},{hook}"}
        fleet = [Replica(f"hc-fleet-{i}", url, fleet_env, web=True) for i in range(args.replicas)]
        replicas.extend(fleet)
        names = [replica.name for replica in fleet]
        wait_for(
            lambda: all(sessions_by_name().get(name, 0) >= tickers for name in names), 180, "every replica's tickers"
        )
        time.sleep(3)

        def fleet_phase(label: str, predicted: str) -> None:
            before = os.getloadavg()[0]
            totals, own, executors = [], [], []
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                now = sessions_by_name()
                own.append(sum(now.get(name, 0) for name in names))
                executors.append(now.get(OUTBOX, 0))
                totals.append(own[-1] + executors[-1])
                time.sleep(0.1)
            split = f"replicas' own {statistics.median(own):g} + executors' {statistics.median(executors):g}"
            load = f"{before:.1f} → {os.getloadavg()[0]:.1f}"
            rows.append((label, "", max(totals), statistics.median(totals), split, predicted, load))
            print(f"  {label}: peak {max(totals)}, median {statistics.median(totals):g} ({split})", flush=True)

        n = args.replicas
        busy = f"up to {n * (tickers + settings.HARDCOUNT_OUTBOX_WORKERS + 4) + tickers} "
        busy += f"({n} × ({tickers} + pool {settings.HARDCOUNT_OUTBOX_WORKERS + 3} + LISTEN 1) + {tickers})"
        idle = f"{n * (tickers + 2) + tickers} ({n} × ({tickers} tickers + pool 1 + LISTEN 1) + {tickers} heartbeats)"
        fleet_phase(
            f"{n} gunicorn replicas, "
            + ("working the drain's deliveries (refused)" if args.keep_queue else "idle")
            + ": all their sessions",
            busy if args.keep_queue else idle,
        )
        load_hardcount(f"http://{hook}/hook", args.backlog)
        time.sleep(2)
        # With --keep-queue the pools have grown already and keep their idle connections: this phase then
        # shows what the first left behind.
        fleet_phase(f"{n} gunicorn replicas delivering a backlog of {args.backlog:,}: all their sessions", busy)
        receiver.terminate()
    finally:
        for replica in replicas:
            replica.stop()
        gateway.stop()
        connection.creation.destroy_test_db(old_name, verbosity=0)

    print("\nPostgreSQL sessions per replica (pg_stat_activity by application_name, every 100 ms):")
    print("  phase | replica's own: peak | median | every executor's pool so far: peak (median) | predicted | load")
    for label, _name, peak, median, outbox, predicted, load in rows:
        print(f"  {label} | {peak} | {median:g} | {outbox} | {predicted} | {load}")


if __name__ == "__main__":
    main()
