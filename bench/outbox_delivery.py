"""Deliveries per second through the outbox executor, beside Procrastinate on the same database.

    .venv/bin/python bench/outbox_delivery.py [--deliveries 2000] [--workers 8] [--rounds 2]

Both sides do the same work per job: claim a row from PostgreSQL, POST the same signed
JSON body to a local receiver that answers 200 at once, and record completion in the
database. Hardcount's executor also writes an attempt row per delivery and checks its
lease on every write; Procrastinate (the Python PostgreSQL job queue, ``procrastinate``
3.x) runs an async task with the same httpx client settings and ``concurrency`` equal to the
executor's workers. The receiver is an asyncio HTTP/1.1 server in its own process, so it
does not share the benchmark's GIL.

Runs in a throw-away database (``bench_outbox``, created and migrated, dropped at the end)
on the embedded PostgreSQL or ``DATABASE_URL``. Prints each side's deliveries per second
and the ratio Hardcount / Procrastinate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

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


def bench_hardcount(url: str, deliveries: int, workers: int) -> float:
    from django.db import connection, transaction

    from hardcount.models import Tenant
    from outbox.executor import Executor, ExecutorConfig
    from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
    from outbox.services import emit_event
    from outbox.signing import generate_secret

    DeliveryAttempt.objects.all().delete()
    Delivery.objects.all().delete()
    tenant = Tenant.objects.create(name="bench")
    WebhookEndpoint.objects.create(
        tenant=tenant, livemode=False, url=url, enabled_events=["*"], secret=generate_secret()
    )
    with transaction.atomic():
        for i in range(deliveries):
            emit_event(tenant_id=tenant.id, livemode=False, type="invoice.paid", data={"id": f"in_{i}", "n": i})
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE outbox_delivery")

    executor = Executor(ExecutorConfig(workers=workers, timeout_s=10, poll_interval_s=0.05), executor_id="bench")
    started = time.perf_counter()
    executor.start()
    try:
        while True:
            done = Delivery.objects.filter(status="succeeded").count()
            if done >= deliveries:
                break
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
    finally:
        executor.stop()
    assert DeliveryAttempt.objects.filter(outcome="succeeded").count() == deliveries
    return deliveries / elapsed


# --- Procrastinate ------------------------------------------------------------------------


def bench_procrastinate(url: str, deliveries: int, workers: int, conninfo: str) -> float:
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

    async def run() -> float:
        async with app.open_async():
            exists = await app.connector.execute_query_one_async("SELECT to_regclass('procrastinate_jobs') AS t")
            if exists["t"] is None:
                await app.schema_manager.apply_schema_async()
            await app.connector.execute_query_async("TRUNCATE procrastinate_jobs CASCADE")
            await deliver.batch_defer_async(*({"n": i} for i in range(deliveries)))
            await app.connector.execute_query_async("ANALYZE procrastinate_jobs")
            started = time.perf_counter()
            await app.run_worker_async(concurrency=workers, wait=False, install_signal_handlers=False)
            elapsed = time.perf_counter() - started
            rows = await app.connector.execute_query_all_async(
                "SELECT count(*) AS n FROM procrastinate_jobs WHERE status = 'succeeded'"
            )
            assert rows[0]["n"] == deliveries, rows
            if "c" in client:
                await client["c"].aclose()
        return deliveries / elapsed

    return asyncio.run(run())


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deliveries", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection

    from outbox.executor import conninfo_from_django

    queue = multiprocessing.get_context("spawn").Queue()
    receiver = multiprocessing.get_context("spawn").Process(target=_serve, args=(queue,), daemon=True)
    receiver.start()
    port = queue.get(timeout=10)
    url = f"http://127.0.0.1:{port}/hook"
    # Webhook deliveries reach only public addresses unless an operator allows one (decision 0123).
    from django.conf import settings

    settings.HARDCOUNT_OUTBOUND_ALLOW = [*settings.HARDCOUNT_OUTBOUND_ALLOW, f"127.0.0.1:{port}"]

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        conninfo = conninfo_from_django()
        results: dict[str, list[float]] = {"hardcount": [], "procrastinate": []}
        for _ in range(args.rounds):
            results["procrastinate"].append(bench_procrastinate(url, args.deliveries, args.workers, conninfo))
            results["hardcount"].append(bench_hardcount(url, args.deliveries, args.workers))
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
        receiver.terminate()

    best = {name: max(values) for name, values in results.items()}
    print(f"outbox delivery throughput: {args.deliveries} deliveries, {args.workers} workers, {args.rounds} rounds")
    for name, values in results.items():
        print(f"  {name:<14} {', '.join(f'{v:7.0f}' for v in values)} deliveries/s (best {best[name]:.0f})")
    print(f"  ratio hardcount / procrastinate (best of each): {best['hardcount'] / best['procrastinate']:.2f}")


if __name__ == "__main__":
    main()
