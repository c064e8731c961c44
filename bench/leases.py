"""What the leader lease costs: the fence check on every write, and the lease statements themselves.

    .venv/bin/python bench/leases.py [--transactions 2000]

Creates a throw-away database (``bench_leases``, migrated, dropped at the end) and times, on
one connection:

- a small write transaction (one INSERT) without a fence, then the same with
  ``LeaseFence.check()`` first (the ``FOR KEY SHARE`` lock of the lease row): the difference
  is what fencing adds to each of the billing drain's write transactions;
- ``ACQUIRE`` (re-taking our own live lease), ``HEARTBEAT`` (with its ``SET LOCAL``
  statement timeout) and ``PEEK`` (a follower's poll).

Printed beside them, the limits they are compared with: a heartbeat must take far less than
its 2 s statement timeout and the 3 s period; a follower's poll runs twice a second per role;
and the fence should cost less than one gateway round trip (~50 ms), the drain's unit of work.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_leases")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")


def _per_call_ms(fn, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - started) * 1000 / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000)
    args = parser.parse_args()

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection, transaction

    from leases import services as leases

    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE bench_write (id bigserial PRIMARY KEY, note text)")
        fence = leases.try_acquire("bench", "bench-holder")
        fence.start_heartbeat()

        def plain_write():
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("INSERT INTO bench_write (note) VALUES ('x')")

        def fenced_write():
            with transaction.atomic():
                fence.check()
                with connection.cursor() as cursor:
                    cursor.execute("INSERT INTO bench_write (note) VALUES ('x')")

        n = args.transactions
        _per_call_ms(plain_write, 200)  # warm up
        # Alternate the two, five rounds each, and keep each one's best: the machine is shared.
        plain_ms = fenced_ms = float("inf")
        for _ in range(5):
            plain_ms = min(plain_ms, _per_call_ms(plain_write, n // 5))
            fenced_ms = min(fenced_ms, _per_call_ms(fenced_write, n // 5))
        acquire_ms = _per_call_ms(lambda: leases.acquire("bench", "bench-holder", ttl_s=10), n // 4)
        heartbeat_ms = _per_call_ms(lambda: leases.heartbeat("bench", "bench-holder", fence.token, ttl_s=10), n // 4)
        peek_ms = _per_call_ms(lambda: leases.peek("bench"), n // 4)

        print(f"write transaction, no fence : {plain_ms:7.3f} ms")
        print(
            f"write transaction, fenced   : {fenced_ms:7.3f} ms  (+{fenced_ms - plain_ms:.3f} ms per transaction; "
            f"compare: one gateway round trip ~50 ms)"
        )
        print(f"acquire (ours, live)        : {acquire_ms:7.3f} ms")
        print(
            f"heartbeat                   : {heartbeat_ms:7.3f} ms  (limit: statement timeout 2000 ms, "
            f"period {settings.HARDCOUNT_LEASE_HEARTBEAT_S * 1000:.0f} ms)"
        )
        print(
            f"follower poll (peek)        : {peek_ms:7.3f} ms  (every {settings.HARDCOUNT_LEASE_POLL_S * 1000:.0f} ms "
            f"per role per follower)"
        )
        fence.close()
    finally:
        connection.creation.destroy_test_db(settings.DATABASES["default"]["NAME"], verbosity=0)


if __name__ == "__main__":
    main()
