"""Usage billing throughput: meter events ingested per second, and a period close's usage aggregation, each beside
the plain-SQL floor on the same table in the same run.

    .venv/bin/python bench/usage_ingest.py                      # 100 batches of 1,000 over HTTP; 1M events aggregated
    .venv/bin/python bench/usage_ingest.py --aggregate-events 10000000    # the 10M aggregation (adds ~5-10 min)
    .venv/bin/python bench/usage_ingest.py --profile            # also samples the gunicorn workers with py-spy
    .venv/bin/python bench/usage_ingest.py --skip-http --skip-aggregate   # the service call beside COPY only

(a) Ingest. A real gunicorn (``hardcount/gunicorn.conf.py``, ``--web-workers`` × ``--web-threads``) serves
``POST /v1/billing/meter_events/batch``; ``--clients`` threads each post batches of ``--batch`` events (distinct
identifiers, 10,000 customers round-robin, no timestamp: the billing time) until ``--batches`` are sent. Beside
it, in this process on one connection: the service call the endpoint makes
(:func:`billing.services.usage.record_meter_events`) on the same shape of batches, and a plain ``COPY`` of the
same rows into ``billing_meterevent`` (the same table and index; no identifier guard, no validation), the two
alternating batch by batch.

(b) Aggregation. ``--aggregate-events`` events (10,000 customers, one meter, spread over one past month) are
written server-side (``INSERT … SELECT generate_series``), then the product's statement for 10,000 customers'
period close (:func:`billing.queries.aggregate_usage`, barrier included) is timed beside the plain ``GROUP BY
customer_id`` over the same rows (best of ``--rounds``).

Runs in a throw-away database ``bench_usage`` (created and migrated, dropped at the end) on the embedded
PostgreSQL or ``DATABASE_URL``. Prints each figure and the ratios against the targets.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_usage")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

CUSTOMERS = 10_000
PERIOD = (datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC))


def _setup():
    """A tenant with a test key, a ``sum`` meter ``api_calls`` and 10,000 customers; (tenant, key, meter, ids)."""
    from billing.models import Customer
    from billing.services import usage
    from hardcount.models import ApiKey, Tenant

    tenant = Tenant.objects.create(name="Bench")
    _, key = ApiKey.issue(tenant, livemode=False)
    meter = usage.create_meter(
        tenant_id=tenant.id, livemode=False, display_name="API calls", event_name="api_calls", formula="sum"
    )
    customers = Customer.objects.bulk_create(
        Customer(tenant=tenant, livemode=False, email=f"c{n}@bench.test") for n in range(CUSTOMERS)
    )
    return tenant, key, meter, [c.id for c in customers]


def _batch(customer_ids: list[str], tag: str, size: int, start: int) -> list[dict]:
    return [
        {
            "event_name": "api_calls",
            "identifier": f"{tag}-{start + i}",
            "payload": {"stripe_customer_id": customer_ids[(start + i) % len(customer_ids)], "value": "3"},
        }
        for i in range(size)
    ]


# --- (a) ingest ------------------------------------------------------------------------------------------------------


def _gunicorn(args) -> tuple[object, int]:
    from django.db import connection

    from devstack.stack import start_gunicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = connection.settings_dict
    url = f"postgresql://{db['USER']}@/{db['NAME']}?host={db['HOST']}&port={db['PORT']}"
    if not str(db["HOST"]).startswith("/"):
        url = f"postgresql://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "HARDCOUNT_WEB_WORKERS": str(args.web_workers),
        "HARDCOUNT_WEB_THREADS": str(args.web_threads),
        "HARDCOUNT_RUN_SCHEDULER": "0",
        "HARDCOUNT_LOG_LEVEL": "WARNING",
    }
    child = start_gunicorn(base_dir=ROOT, bind=f"127.0.0.1:{port}", env=env, access_log=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return child, port
        except OSError:
            time.sleep(0.2)
    child.stop(5)
    raise RuntimeError("gunicorn did not start")


def bench_http(args, key: str, customer_ids: list[str]) -> tuple[float, int]:
    """Events per second through the batch endpoint from ``--clients`` threads; (rate, events accepted)."""
    import httpx

    child, port = _gunicorn(args)
    profiler = _profile_workers(child) if args.profile else []
    try:
        url = f"http://127.0.0.1:{port}/v1/billing/meter_events/batch"
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        bodies = [
            json.dumps({"events": _batch(customer_ids, "http", args.batch, n * args.batch)}).encode()
            for n in range(args.batches)
        ]
        with httpx.Client(trust_env=False) as warm:  # the workers load the app and open their connections
            for _ in range(args.web_workers * 2):
                warm.post(url, content=json.dumps({"events": []}), headers=headers, timeout=60)
        accepted, errors, lock, todo = [0], [], threading.Lock(), list(range(len(bodies)))

        def client():
            with httpx.Client(trust_env=False, timeout=120) as http:
                while True:
                    with lock:
                        if not todo:
                            return
                        n = todo.pop()
                    response = http.post(url, content=bodies[n], headers=headers)
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text[:200]}")
                        return
                    with lock:
                        accepted[0] += response.json()["accepted"]

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        if errors:
            raise RuntimeError(f"the batch endpoint refused a request: {errors[0]}")
    finally:
        for p in profiler:
            p.stop()
        child.stop(10)
    if profiler:
        for line in _profile_report(profiler):
            print(line)
    return accepted[0] / elapsed, accepted[0]


def bench_service_and_copy(args, tenant, customer_ids: list[str]) -> tuple[float, float]:
    """Events per second through :func:`record_meter_events` and through a plain ``COPY`` of the same rows into
    ``billing_meterevent`` (one COPY and one commit per batch), on this process's one connection.

    The two alternate batch by batch (a service batch, then a COPY batch), each timed on its own, so a change
    in the machine's load during the run weighs on both alike and their ratio is taken over the same moments.
    """
    from django.db import connection, transaction

    from billing.services.usage import record_meter_events
    from hardcount.ids import new_id

    batches = [_batch(customer_ids, "svc", args.batch, n * args.batch) for n in range(args.batches)]
    now = datetime.now(UTC).isoformat()
    buffers = []
    for n in range(args.batches):
        out = io.StringIO()
        for event in _batch(customer_ids, "copy", args.batch, n * args.batch):
            payload = json.dumps(event["payload"], sort_keys=True).replace("\\", "\\\\")
            customer = event["payload"]["stripe_customer_id"]
            out.write(f"{new_id('mev')}\t{tenant.id}\tf\tapi_calls\t{customer}\t{event['identifier']}\t3\t")
            out.write(f"{payload}\t{now}\t{now}\n")
        buffers.append(out.getvalue())
    columns = "id, tenant_id, livemode, event_name, customer_id, identifier, value, payload, timestamp, created_at"
    service_s = copy_s = 0.0
    total = 0
    for events, data in zip(batches, buffers, strict=True):
        started = time.perf_counter()
        results = record_meter_events(tenant_id=tenant.id, livemode=False, events=events)
        service_s += time.perf_counter() - started
        total += sum(r.status == "accepted" for r in results)
        started = time.perf_counter()
        with transaction.atomic(), connection.cursor() as cursor:
            with cursor.cursor.copy(f"COPY billing_meterevent ({columns}) FROM STDIN") as copy:
                copy.write(data)
        copy_s += time.perf_counter() - started
    assert total == args.batch * args.batches, total
    return total / service_s, args.batch * args.batches / copy_s


# --- (b) aggregation -------------------------------------------------------------------------------------------------


def seed_events(tenant, customer_ids: list[str], count: int) -> float:
    """``count`` events of 10,000 customers over PERIOD, written by the server; seconds taken."""
    from django.db import connection

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO billing_meterevent
                (id, tenant_id, livemode, event_name, customer_id, identifier, value, payload, timestamp, created_at)
            SELECT 'mev_agg' || g, %s, false, 'api_calls', c.ids[1 + g %% cardinality(c.ids)], 'agg-' || g,
                   1 + g %% 97, '{}'::jsonb,
                   %s::timestamptz + (g %% 2678400) * interval '1 second', %s::timestamptz
            FROM generate_series(0, %s - 1) g, (SELECT %s::text[] AS ids) c
            """,
            [tenant.id, PERIOD[0], PERIOD[1], count, customer_ids],
        )
    with connection.cursor() as cursor:  # outside a transaction: a closed period's pages, as autovacuum leaves them
        cursor.execute("VACUUM (ANALYZE) billing_meterevent")
    return time.perf_counter() - started


def bench_aggregate(args, tenant, meter, customer_ids: list[str]) -> tuple[float, float, int]:
    """Seconds (best of ``--rounds``) of the product's statement and of the plain GROUP BY; and the units checked."""
    from django.db import connection

    from billing.queries import aggregate_usage

    wanted = [(cid, cid, meter.id, *PERIOD) for cid in customer_ids]
    plain = (
        "SELECT customer_id, sum(value) FROM billing_meterevent WHERE tenant_id = %s AND livemode = false"
        " AND event_name = 'api_calls' AND timestamp >= %s AND timestamp < %s GROUP BY customer_id"
    )
    ours, floor, product, grouped = [], [], {}, {}
    for _ in range(args.rounds):
        started = time.perf_counter()
        product = aggregate_usage(wanted)
        ours.append(time.perf_counter() - started)
        with connection.cursor() as cursor:
            started = time.perf_counter()
            cursor.execute(plain, [tenant.id, *PERIOD])
            grouped = dict(cursor.fetchall())
            floor.append(time.perf_counter() - started)
    assert product == {k: int(v) for k, v in grouped.items()}, "the two statements disagree"
    return min(ours), min(floor), sum(product.values())


# --- profiling -------------------------------------------------------------------------------------------------------


def _profile_workers(child) -> list:
    """py-spy on each gunicorn worker (the arbiter's children), raw collapsed stacks under var/bench/."""
    import shutil

    time.sleep(3)  # the workers have started
    pids = subprocess.run(["pgrep", "-P", str(child.pid)], check=False, capture_output=True, text=True).stdout.split()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = ROOT / "var" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    profilers = []
    for pid in pids:
        path = out / f"usage-worker-{pid}.txt"
        proc = subprocess.Popen(
            [spy, "record", "--pid", pid, "--rate", "100", "--format", "raw", "--output", str(path), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        profilers.append(_Spy(proc, path))
    time.sleep(1.5)
    return profilers


class _Spy:
    def __init__(self, proc, path):
        self.proc, self.path = proc, path

    def stop(self):
        self.proc.send_signal(2)  # SIGINT: py-spy writes its output
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _profile_report(profilers, top: int = 16) -> list[str]:
    """Share of the workers' request samples by function (inclusive), leaving out the frames every request has."""
    import collections

    inclusive: collections.Counter = collections.Counter()
    total = 0
    for spy in profilers:
        if not spy.path.exists():
            continue
        for line in spy.path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit() or "handle_request" not in stack:
                continue  # idle threads and the arbiter's bookkeeping
            total += int(count)
            names = set()
            for frame in stack.split(";"):
                function, _, where = frame.partition(" (")
                names.add(f"{function} ({where.split(':')[0].split('/')[-1]})")
            for name in names:
                inclusive[name] += int(count)
    lines = [f"  py-spy, gunicorn workers, {total} samples in requests (inclusive share, framework frames left out):"]
    shown = [(name, n) for name, n in inclusive.most_common() if n < 0.97 * total][:top]
    for name, n in shown:
        lines.append(f"    {100 * n / max(total, 1):5.1f}%  {name}")
    return lines


# --- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--web-threads", type=int, default=2)
    parser.add_argument("--aggregate-events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-ingest", action="store_true")
    parser.add_argument("--skip-http", action="store_true", help="(a) without the endpoint: service call and COPY")
    parser.add_argument("--skip-aggregate", action="store_true", help="(a) only")
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        tenant, key, meter, customer_ids = _setup()
        n = args.batch * args.batches
        print(f"usage bench: {n:,} events in batches of {args.batch:,}; {args.aggregate_events:,} aggregated")
        if not args.skip_ingest:
            http = None
            if not args.skip_http:
                http, accepted = bench_http(args, key, customer_ids)
                assert accepted == n, accepted
            service, copy = bench_service_and_copy(args, tenant, customer_ids)
            if http is not None:
                print(f"  (a) batch endpoint, gunicorn {args.web_workers}×{args.web_threads}, {args.clients} clients: "
                      f"{http:9,.0f} events/s   (target ≥ 10,000)")  # fmt: skip
            print(f"      service call, 1 connection:            {service:9,.0f} events/s")
            print(f"      plain COPY, same rows, 1 connection:   {copy:9,.0f} events/s")
            print(f"      service / COPY: {service / copy:.2f} (target ≥ 0.50)"
                  + ("" if http is None else f";  endpoint / COPY: {http / copy:.2f}"))  # fmt: skip
        if args.skip_aggregate:
            return
        seeded = seed_events(tenant, customer_ids, args.aggregate_events)
        ours, floor, units = bench_aggregate(args, tenant, meter, customer_ids)
        print(f"  (b) {args.aggregate_events:,} events seeded in {seeded:.1f} s; {CUSTOMERS:,} customers' close:")
        print(f"      aggregate_usage (the close's statement): {ours * 1000:8.0f} ms")
        print(f"      plain GROUP BY customer_id:              {floor * 1000:8.0f} ms")
        print(f"      ours / GROUP BY: {ours / floor:.2f} (target ≤ 2.00); {units:,} units agree")
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
