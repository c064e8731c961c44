"""CPU per webhook request: the outbound policy's client beside httpx's, on the same receiver, in one run.

    .venv/bin/python bench/outbound_client.py [--requests 3000] [--concurrency 8] [--rounds 2]

Each side POSTs the same signed-size JSON body ``--requests`` times, ``--concurrency`` at a time, over
kept-alive connections, to the delivery bench's local HTTP/1.1 receiver (``bench/outbox_delivery.py``, in
its own process, answering 200 at once), and reads the answer. The figure is this process's CPU time
(user + system) per request, which is what a webhook executor pays per delivery for the request alone;
the rate is printed too. Sides:

- ``outbound``: :class:`hardcount.outbound.OutboundClient` (aiohttp, the policy's resolver), as the
  executor uses it: one client, at most ``--concurrency`` connections;
- ``httpx``: httpx's ``AsyncClient`` with the same limits, each request built once and sent with
  ``send(stream=True)`` as the executor did before decision 0226 (without the policy's transport, which
  only adds to it).

The receiver's address is put on the outbound allowlist, as ``make run`` does for its own receiver.
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
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

BODY = json.dumps(
    {
        "id": "evt_01jbench",
        "type": "invoice.paid",
        "data": {"object": {"id": "in_01jbench", "object": "invoice", "amount_due": 2500, "currency": "usd"}},
    }
).encode()
HEADERS = {"Content-Type": "application/json", "User-Agent": "Hardcount-Webhooks/1.0", "Hardcount-Signature": "x" * 90}


async def _outbound(url: str, requests: int, concurrency: int) -> None:
    from hardcount import outbound

    client = outbound.OutboundClient(timeout_s=10, connect_timeout_s=5, max_connections=concurrency)
    async with client:
        left = iter(range(requests))

        async def worker() -> None:
            for _ in left:
                answer = await client.post(url, BODY, HEADERS, max_bytes=1024)
                assert answer.status == 200, answer

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _httpx(url: str, requests: int, concurrency: int) -> None:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10, connect=5), trust_env=False) as client:
        left = iter(range(requests))
        target = httpx.URL(url)

        async def worker() -> None:
            for _ in left:
                response = await client.send(httpx.Request("POST", target, content=BODY, headers=HEADERS), stream=True)
                try:
                    async for _chunk in response.aiter_bytes():
                        break
                finally:
                    await response.aclose()
                assert response.status_code == 200, response

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from outbox_delivery import _serve as serve_receiver  # the delivery bench's receiver, in its own process

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    receiver = ctx.Process(target=serve_receiver, args=(ports,), daemon=True)
    receiver.start()
    port = ports.get(timeout=10)
    os.environ["HARDCOUNT_OUTBOUND_ALLOW"] = f"127.0.0.1:{port}"
    import django

    django.setup()
    url = f"http://127.0.0.1:{port}/hooks"
    sides = {"outbound (aiohttp)": _outbound, "httpx": _httpx}
    figures: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for round_number in range(1, args.rounds + 1):
            for name, side in sides.items():
                cpu, wall = time.process_time(), time.monotonic()
                asyncio.run(side(url, args.requests, args.concurrency))
                cpu_us = (time.process_time() - cpu) / args.requests * 1e6
                rate = args.requests / (time.monotonic() - wall)
                figures[name].append(cpu_us)
                print(f"  round {round_number}  {name:<18} {cpu_us:7.0f} µs CPU per request  {rate:7.0f} requests/s")
    finally:
        receiver.kill()
    ours, peer = min(figures["outbound (aiohttp)"]), min(figures["httpx"])
    print(
        f"{args.requests} requests × {args.rounds} rounds, {args.concurrency} at a time, load average "
        f"{os.getloadavg()[0]:.1f}: best round {ours:.0f} µs against httpx's {peer:.0f} µs "
        f"({peer / ours:.1f}× less CPU per request)"
    )


if __name__ == "__main__":
    main()
