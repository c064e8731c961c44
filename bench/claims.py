"""Delivery claims per second on one primary: the executor's claim and record statements beside a bare queue.

    .venv/bin/python bench/claims.py [--connections 1,2,4,8] [--batch 8] [--seconds 10] [--backlog 60000]

What one webhook delivery costs the database, with no HTTP request: a cycle is the executor's own
claim statement (``outbox.queries.CLAIM_DUE_RECORDING_LOST``, up to ``--batch`` due deliveries, with
their events and endpoints) and its writer's statement (``outbox.queries.RECORD_OUTCOMES``, every
claimed row succeeded with its attempt row), each in its own autocommit transaction, as the executor
runs them. The peer, in the same run, is the least a claim queue can do on this server: a table of
an id and two times, claim up to ``--batch`` rows (``FOR UPDATE SKIP LOCKED`` in id order, stamped
claimed), then mark them done, two autocommit statements likewise.

For each number of connections (one process each, so the GIL does not set the rate), each side gets
a fresh backlog of ``--backlog`` rows and runs for ``--seconds``; printed: claims/s of each side and
the ratio, with the load average before and after each side (the machine is shared). A side whose
backlog ran out before the end says so.

Runs in a throw-away database (``bench_claims``, created and migrated, dropped at the end) on the
embedded PostgreSQL or ``DATABASE_URL``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_claims")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

PEER_TABLE = """
DROP TABLE IF EXISTS bench_queue;
CREATE TABLE bench_queue (id bigserial PRIMARY KEY, claimed_at timestamptz, done_at timestamptz);
CREATE INDEX bench_queue_due ON bench_queue (id) WHERE done_at IS NULL AND claimed_at IS NULL;
"""
PEER_CLAIM = """
UPDATE bench_queue q SET claimed_at = now()
FROM (SELECT id FROM bench_queue WHERE done_at IS NULL AND claimed_at IS NULL ORDER BY id LIMIT %(limit)s
      FOR UPDATE SKIP LOCKED) due
WHERE q.id = due.id
RETURNING q.id
"""
PEER_DONE = "UPDATE bench_queue SET done_at = now() WHERE id = ANY(%(ids)s)"


def _hardcount_side(conninfo: str, batch: int, seconds: float, index: int, results) -> None:
    """One executor's database work in a loop: claim up to ``batch``, record each succeeded.

    Puts (claims, seconds it ran, whether the backlog ran out) on ``results``; the clock starts once connected.
    """
    import psycopg
    from psycopg.rows import dict_row

    from hardcount.ids import new_ids
    from outbox import queries

    executor = f"bench:{os.getpid()}:{index}"
    claims, ran_out = 0, False
    with psycopg.connect(conninfo, autocommit=True, row_factory=dict_row, prepare_threshold=None) as conn:
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline:
            rows = conn.execute(
                queries.CLAIM_DUE_RECORDING_LOST,
                {"executor": executor, "lease_s": 20.0, "limit": batch, "attempt_ids": new_ids("wha", batch)},
            ).fetchall()
            if not rows:
                ran_out = True
                break
            n = len(rows)
            conn.execute(
                queries.RECORD_OUTCOMES,
                {
                    "ids": [r["id"] for r in rows],
                    "claims": [r["claimed_by"] for r in rows],
                    "statuses": ["succeeded"] * n,
                    "attempts": [None] * n,
                    "errors": [""] * n,
                    "delays_s": [0.0] * n,
                    "attempt_ids": new_ids("wha", n),
                    "numbers": [r["attempts"] for r in rows],
                    "outcomes": ["succeeded"] * n,
                    "status_codes": [200] * n,
                    "latencies_ms": [1] * n,
                    "attempt_errors": [""] * n,
                    "excerpts": ["ok"] * n,
                    "endpoint_ids": [r["endpoint_id"] for r in rows],
                    "effects": ["reset"] * n,
                    "executor": executor,
                    "threshold": 5,
                    "base_s": 60.0,
                    "max_s": 3600.0,
                },
            )
            claims += n
        results.put((claims, time.monotonic() - started, ran_out))


def _peer_side(conninfo: str, batch: int, seconds: float, index: int, results) -> None:
    """The bare queue in a loop: claim up to ``batch`` rows, mark them done. Puts what :func:`_hardcount_side` puts."""
    import psycopg

    claims, ran_out = 0, False
    with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as conn:
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline:
            ids = [r[0] for r in conn.execute(PEER_CLAIM, {"limit": batch}).fetchall()]
            if not ids:
                ran_out = True
                break
            conn.execute(PEER_DONE, {"ids": ids})
            claims += len(ids)
        results.put((claims, time.monotonic() - started, ran_out))


def load_peer(backlog: int) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(PEER_TABLE)
        cursor.execute("INSERT INTO bench_queue (id) SELECT generate_series(1, %s)", [backlog])
        cursor.execute("VACUUM ANALYZE bench_queue")


def run_side(target, conninfo: str, *, connections: int, batch: int, seconds: float) -> tuple[float, bool, str]:
    """(claims/s, the sum of each connection's own rate; whether the backlog ran out; load average before → after)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    before = os.getloadavg()[0]
    workers = [
        ctx.Process(target=target, args=(conninfo, batch, seconds, i, results), daemon=True) for i in range(connections)
    ]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join(30)
    rate = sum(claims / elapsed for claims, elapsed, _ in reports if elapsed > 0)
    return rate, any(ran_out for _, _, ran_out in reports), f"{before:.1f} → {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", default="1,2,4,8", help="comma-separated connection counts (default 1,2,4,8)")
    parser.add_argument("--batch", type=int, default=8, help="rows per claim (default 8, the executor's workers)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--backlog", type=int, default=60000, help="rows queued before each side runs")
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]

    import django

    django.setup()
    from django.db import connection

    sys.path.append(str(Path(__file__).resolve().parent))  # last: bench/leases.py must not shadow the leases app
    from outbox_delivery import load_hardcount

    from outbox.executor import conninfo_from_django

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    rows = []
    try:
        conninfo = conninfo_from_django()
        for n in counts:
            load_peer(args.backlog)
            peer = run_side(_peer_side, conninfo, connections=n, batch=args.batch, seconds=args.seconds)
            load_hardcount("https://receiver.invalid/hook", args.backlog)
            ours = run_side(_hardcount_side, conninfo, connections=n, batch=args.batch, seconds=args.seconds)
            rows.append((n, ours, peer))
            print(
                f"  {n} connection(s): hardcount {ours[0]:,.0f}/s (load {ours[2]}), bare queue {peer[0]:,.0f}/s "
                f"(load {peer[2]})",
                flush=True,
            )
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)

    print(f"\ndelivery claims on one primary, batch {args.batch}, {args.seconds:g} s per side (claims/s):")
    print("  connections | hardcount claim + record | bare SKIP LOCKED queue | ratio")
    for n, ours, peer in rows:
        note = " (a backlog ran out: raise --backlog)" if ours[1] or peer[1] else ""
        print(f"  {n:>11} | {ours[0]:>24,.0f} | {peer[0]:>22,.0f} | {ours[0] / peer[0]:.2f}{note}")


if __name__ == "__main__":
    main()
