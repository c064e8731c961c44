"""How long ``python manage.py doctor`` takes on a book of ~100 000 invoices.

    .venv/bin/python bench/doctor.py [--subscriptions 20000] [--periods 5] [--tenants 10] [--rounds 3]

Seeds a throw-away database (``bench_doctor``, created and migrated, dropped at the end) on the
embedded PostgreSQL or ``DATABASE_URL`` with a clean book written by COPY: per subscription a
customer with a credit grant applied to its first invoice, one subscription item, ``--periods`` monthly invoices
(line, payment attempt, ``invoice.created/finalized/paid`` events), and one webhook endpoint per
tenant whose ``invoice.paid`` deliveries succeeded with one attempt each. 20 000 × 5 is 100 000
invoices and about 1.1 million rows in all. Then runs the sweep ``--rounds`` times and prints
the total and the slowest checks, beside the limit the kill/race suite needs: it runs the
doctor after every experiment, so the sweep should take seconds (limit: 10 s on 100 000
invoices on this machine's 2 cores). Every check must report 0 violations on this book: the
benchmark is also a false-positive test at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
os.environ.setdefault("HARDCOUNT_TEST_DB", "bench_doctor")
os.environ.setdefault("HARDCOUNT_LOG_LEVEL", "WARNING")

LIMIT_S = 10.0


def _required_defaults(cursor, table: str, now: datetime) -> dict[str, object]:
    """A value for every NOT NULL column without a database default (columns other helpers may add later)."""
    cursor.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_name = %s AND is_nullable = 'NO' AND column_default IS NULL AND is_identity = 'NO'",
        [table],
    )
    by_type = {"boolean": False, "jsonb": "{}", "timestamp with time zone": now}
    return {name: by_type.get(data_type, 0 if "int" in data_type else "") for name, data_type in cursor.fetchall()}


def _copy(cursor, table: str, rows: list[dict], now: datetime) -> int:
    """COPY ``rows`` (dicts) into ``table``, filling NOT NULL columns they leave out."""
    if not rows:
        return 0
    defaults = _required_defaults(cursor, table, now)
    columns = list(dict.fromkeys([*rows[0], *defaults]))
    fill = {c: defaults[c] for c in columns if c not in rows[0]}
    with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([row[c] if c in row else fill[c] for c in columns])
    return len(rows)


def seed(subscriptions: int, periods: int, tenants: int) -> int:
    """Write the clean book by COPY; returns the number of rows written."""
    from django.db import connection

    from billing.periods import period_bounds
    from hardcount.ids import new_id

    now = datetime.now(UTC)
    t0 = datetime(2025, 1, 31, 9, 0, tzinfo=UTC)
    scope = {"livemode": False}
    tables: dict[str, list[dict]] = {
        name: []
        for name in (
            "hardcount_tenant",
            "outbox_webhookendpoint",
            "billing_invoicecounter",
            "billing_price",
            "billing_customer",
            "billing_subscription",
            "billing_subscriptionitem",
            "billing_invoice",
            "billing_invoicelineitem",
            "billing_paymentattempt",
            "billing_ledgerentry",
            "outbox_event",
            "outbox_delivery",
            "outbox_deliveryattempt",
        )
    }
    tenants_ = []
    for k in range(tenants):
        tenant = {"id": new_id("ten"), "name": f"tenant {k}", "created_at": now}
        tables["hardcount_tenant"].append(tenant)
        endpoint = {
            "id": new_id("we"),
            "tenant_id": tenant["id"],
            **scope,
            "url": "https://receiver.example/hooks",
            "enabled_events": '["invoice.paid"]',
            "secret": "whsec_bench",
            "enabled": True,
            "created_at": now,
        }
        tables["outbox_webhookendpoint"].append(endpoint)
        price = {
            "id": new_id("price"),
            "tenant_id": tenant["id"],
            **scope,
            "amount": 2000,
            "currency": "usd",
            "interval": "month",
            "interval_count": 1,
            "active": True,
            "created_at": now,
        }
        tables["billing_price"].append(price)
        tenants_.append({"id": tenant["id"], "endpoint": endpoint["id"], "price": price["id"], "number": 0})
    time.sleep(0.002)  # every event id a millisecond younger than every endpoint id

    def event(tenant_id: str, type_: str, object_id: str, at: datetime) -> str:
        row = {"id": new_id("evt"), "tenant_id": tenant_id, **scope, "type": type_, "created_at": at}
        row["data"] = json.dumps({"id": object_id})
        tables["outbox_event"].append(row)
        return row["id"]

    credit = 500
    for i in range(subscriptions):
        t = tenants_[i % tenants]
        anchor = t0 + timedelta(minutes=i)
        customer_id, subscription_id = new_id("cus"), new_id("sub")
        tables["billing_customer"].append(
            {
                "id": customer_id,
                "tenant_id": t["id"],
                **scope,
                "email": f"c{i}@example.com",
                "currency": "usd",
                "default_payment_method": "pm_card_visa",
                "credit_balance": 0,
                "created_at": now,
            }
        )
        event(t["id"], "customer.created", customer_id, now)
        tables["billing_ledgerentry"].append(
            {
                "id": new_id("cbtxn"),
                "tenant_id": t["id"],
                **scope,
                "customer_id": customer_id,
                "amount": credit,
                "currency": "usd",
                "balance_after": credit,
                "reason": "grant",
                "invoice_id": None,
                "created_at": anchor,
            }
        )
        for n in range(periods):
            start, end = period_bounds(anchor, "month", 1, n)
            t["number"] += 1
            invoice_id = new_id("in")
            applied = credit if n == 0 else 0
            due = 2000 - applied
            intent = "pi_" + invoice_id[3:]
            tables["billing_invoice"].append(
                {
                    "id": invoice_id,
                    "tenant_id": t["id"],
                    **scope,
                    "customer_id": customer_id,
                    "subscription_id": subscription_id,
                    "number": f"{t['number']:06d}",
                    "status": "paid",
                    "currency": "usd",
                    "period_start": start,
                    "period_end": end,
                    "subtotal": 2000,
                    "tax": 0,
                    "tax_rate_bps": 0,
                    "tax_status": "not_applicable",
                    "credit_applied": applied,
                    "total": 2000,
                    "amount_due": due,
                    "amount_paid": due,
                    "payment_intent_id": intent,
                    "attempt_count": 1,
                    "created_at": start,
                    "finalized_at": start,
                    "paid_at": start,
                }
            )
            tables["billing_invoicelineitem"].append(
                {
                    "id": new_id("il"),
                    "invoice_id": invoice_id,
                    "description": "Subscription (per month)",
                    "price_id": t["price"],
                    "quantity": 1,
                    "amount": 2000,
                    "currency": "usd",
                    "period_start": start,
                    "period_end": end,
                }
            )
            tables["billing_paymentattempt"].append(
                {
                    "id": new_id("pa"),
                    "tenant_id": t["id"],
                    **scope,
                    "invoice_id": invoice_id,
                    "attempt_number": 1,
                    "payment_intent_id": intent,
                    "idempotency_key": f"hc:{invoice_id}:create",
                    "payment_method": "pm_card_visa",
                    "amount": due,
                    "currency": "usd",
                    "outcome": "succeeded",
                    "settled_without_charge": False,
                    "started_at": start,
                    "completed_at": start,
                }
            )
            if applied:
                tables["billing_ledgerentry"].append(
                    {
                        "id": new_id("cbtxn"),
                        "tenant_id": t["id"],
                        **scope,
                        "customer_id": customer_id,
                        "amount": -applied,
                        "currency": "usd",
                        "balance_after": 0,
                        "reason": "applied_to_invoice",
                        "invoice_id": invoice_id,
                        "created_at": start,
                    }
                )
            event(t["id"], "invoice.created", invoice_id, start)
            event(t["id"], "invoice.finalized", invoice_id, start)
            paid_event = event(t["id"], "invoice.paid", invoice_id, start)
            delivery_id = new_id("whd")
            tables["outbox_delivery"].append(
                {
                    "id": delivery_id,
                    "event_id": paid_event,
                    "endpoint_id": t["endpoint"],
                    "status": "succeeded",
                    "attempts": 1,
                    "fire_after": now,
                    "created_at": now,
                    "completed_at": now,
                }
            )
            tables["outbox_deliveryattempt"].append(
                {
                    "id": new_id("wha"),
                    "delivery_id": delivery_id,
                    "number": 1,
                    "outcome": "succeeded",
                    "status_code": 200,
                    "latency_ms": 12,
                    "executor": "host:1",
                    "created_at": now,
                }
            )
        tables["billing_subscription"].append(
            {
                "id": subscription_id,
                "tenant_id": t["id"],
                **scope,
                "customer_id": customer_id,
                "price_id": t["price"],
                "status": "active",
                "billing_cycle_anchor": anchor,
                "current_period_start": start,
                "current_period_end": end,
                "periods_billed": periods,
                "next_billing_at": end,
                "created_at": now,
                "updated_at": now,
            }
        )
        tables["billing_subscriptionitem"].append(
            {
                "id": new_id("si"),
                "tenant_id": t["id"],
                **scope,
                "subscription_id": subscription_id,
                "price_id": t["price"],
                "quantity": 1,
                "created_at": now,
            }
        )
        event(t["id"], "subscription.created", subscription_id, now)
    tables["billing_invoicecounter"] = [{"tenant_id": t["id"], **scope, "last_number": t["number"]} for t in tenants_]

    written = 0
    with connection.cursor() as wrapper:
        for table, rows in tables.items():
            written += _copy(wrapper.cursor, table, rows, now)
        wrapper.execute("ANALYZE")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subscriptions", type=int, default=20_000)
    parser.add_argument("--periods", type=int, default=5)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection

    from ops import doctor

    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        started = time.perf_counter()
        rows = seed(args.subscriptions, args.periods, args.tenants)
        seeded_s = time.perf_counter() - started
        totals, per_check = [], {}
        for _ in range(args.rounds):
            started = time.perf_counter()
            results = doctor.run_checks()
            totals.append(time.perf_counter() - started)
            for r in results:
                per_check.setdefault(r.name, []).append(r.duration_ms)
        bad = {r.name: (r.status, r.violations, r.examples[:2], r.note) for r in results if r.status != doctor.OK}
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)

    invoices = args.subscriptions * args.periods
    best = min(totals)
    print(f"doctor sweep: {len(results)} checks over {invoices} invoices ({rows} rows, seeded in {seeded_s:.0f} s)")
    print(f"  rounds: {', '.join(f'{t:.2f}' for t in totals)} s (best {best:.2f} s; limit {LIMIT_S:.0f} s)")
    print("  slowest checks (best of rounds, ms):")
    for name, ms in sorted(per_check.items(), key=lambda kv: -min(kv[1]))[:8]:
        print(f"    {name:<48} {min(ms):8.0f}")
    print(f"  violations on the clean book: {sum(v for _, v, _, _ in bad.values())} {bad or ''}".rstrip())
    print(f"  verdict: {'within' if best <= LIMIT_S and not bad else 'OVER'} the limit")
    if bad or best > LIMIT_S:
        sys.exit(1)


if __name__ == "__main__":
    main()
