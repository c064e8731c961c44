"""How fast the billing drain closes due subscriptions, serial versus parallel closes.

    .venv/bin/python bench/drain.py [--subscriptions 400] [--latency-ms 50] [--concurrency 1 8] [--page-size 100]

Seeds a throw-away database (``bench_drain``, created and migrated, dropped at the end) with
``--subscriptions`` due monthly subscriptions (one tenant, a card each), starts localstripe
(``python -m billing.devstripe``) behind the test proxy (``tests/stripe_proxy.py``), which
delays every PaymentIntent request by ``--latency-ms`` to stand in for Stripe's own latency,
and runs one drain per ``--concurrency`` value on a fresh copy of the book. Each close makes
three gateway requests the first time a customer is charged (customer, attach, PaymentIntent).

Printed beside each figure: the limit serial closes cannot beat (one PaymentIntent latency per
subscription: ``1000 / latency_ms`` per second), which is why closes run in parallel
(``HARDCOUNT_BILLING_CONCURRENCY``, SPEC §4), and how many subscriptions one hourly tick then
bills. localstripe is single-threaded, so at zero latency the fake gateway is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_drain")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

STRIPE_KEY = "sk_test_hardcount_localstripe"


def _start_localstripe() -> tuple[subprocess.Popen, str]:
    import socket

    from tests.billing.conftest import _wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "billing.devstripe", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(port, child)
    return child, f"http://127.0.0.1:{port}"


def _seed(count: int, payment_method: str) -> str:
    from billing.models import Customer, Price, Subscription
    from billing.queries import database_now
    from hardcount.models import Tenant

    tenant = Tenant.objects.create(name="Bench")
    price = Price.objects.create(tenant=tenant, livemode=False, amount=1999, currency="usd", interval="month")
    anchor = database_now() - timedelta(hours=1)
    customers = Customer.objects.bulk_create(
        Customer(
            tenant=tenant,
            livemode=False,
            email=f"bench{i}@example.com",
            default_payment_method=payment_method,
            currency="usd",
        )
        for i in range(count)
    )
    Subscription.objects.bulk_create(
        Subscription(
            tenant=tenant,
            livemode=False,
            customer=c,
            price=price,
            status="active",
            billing_cycle_anchor=anchor,
            next_billing_at=anchor,
        )
        for c in customers
    )
    return tenant.id


def _wipe() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE billing_subscription, billing_customer, billing_price, billing_invoice, billing_invoicelineitem,"
            " billing_paymentattempt, billing_billingrun, billing_billingattempt, billing_ledgerentry,"
            " billing_invoicecounter, outbox_event, hardcount_tenant CASCADE"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscriptions", type=int, default=400)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--page-size", type=int, default=100)
    args = parser.parse_args()

    import django

    django.setup()
    import stripe
    from django.conf import settings
    from django.db import connection

    from billing.services.drain import drain_due
    from tests.stripe_proxy import StripeProxy

    child, base = _start_localstripe()
    proxy = StripeProxy(base).start()
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        settings.STRIPE_API_BASE = proxy.api_base
        settings.STRIPE_API_KEY = STRIPE_KEY
        client = stripe.StripeClient(STRIPE_KEY, base_addresses={"api": base})
        card = {"number": "4242424242424242", "exp_month": 12, "exp_year": 2034, "cvc": "123"}
        payment_method = client.v1.payment_methods.create(params={"type": "card", "card": card}).id
        serial_limit = 1000.0 / args.latency_ms if args.latency_ms else float("inf")
        print(
            f"drain of {args.subscriptions} due subscriptions, gateway latency {args.latency_ms:.0f} ms per "
            f"PaymentIntent request, page size {args.page_size}"
        )
        for concurrency in args.concurrency:
            _wipe()
            tenant_id = _seed(args.subscriptions, payment_method)
            proxy.clear()
            if args.latency_ms:
                proxy.fail_next("delay", times=10**9, match="POST /v1/payment_intents", delay_s=args.latency_ms / 1000)
            started = time.perf_counter()
            run = drain_due(
                livemode=False,
                trigger="manual",
                tenant_id=tenant_id,
                page_size=args.page_size,
                concurrency=concurrency,
            )
            elapsed = time.perf_counter() - started
            rate = run.billed / elapsed
            print(
                f"  concurrency {concurrency:>2}: {run.billed}/{run.attempted} billed in {elapsed:6.2f} s = "
                f"{rate:7.1f} closes/s ({rate * 3600:>9,.0f} per hourly tick); serial limit "
                f"{serial_limit:.1f}/s; {run.pages} pages, {run.failed} failed"
            )
    finally:
        connection.creation.destroy_test_db(settings.DATABASES["default"]["NAME"], verbosity=0)
        proxy.stop()
        child.terminate()
        child.wait(5)


if __name__ == "__main__":
    main()
