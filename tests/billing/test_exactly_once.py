"""Exactly one invoice per (subscription, period) with drains racing, and the negative control.

The negative control drops the partial unique index ``invoice_one_per_period`` and shows that
racing drains then do bill a period twice: the index, not the application's re-checks, is
what holds.
"""

import threading
from collections import Counter

from django.db import connection, connections

from billing.models import Invoice, PaymentAttempt
from billing.services import close as close_module
from billing.services.drain import drain_due


def _drain(tenant, **kw):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, **kw)


def _race_inside_a_charge(monkeypatch, tenant):
    """Drain A; while A's first close is between its invoice and its charge, drain B runs to the end."""
    fired = threading.Event()
    second = {}

    def run_b_now(plan):
        if fired.is_set():
            return
        fired.set()
        second["run"] = _drain(tenant, concurrency=1)

    monkeypatch.setattr(close_module.hooks, "after_prepare", run_b_now)
    first = _drain(tenant, concurrency=1)
    monkeypatch.setattr(close_module.hooks, "after_prepare", None)
    return first, second["run"]


def test_a_drain_racing_a_close_in_flight_does_not_bill_the_period_again(book, tenant, stripe_proxy, monkeypatch):
    sub = book.subscribed(tenant)

    first, second = _race_inside_a_charge(monkeypatch, tenant)

    assert second.attempted == 1 and second.billed == 0  # it saw the payment in flight and skipped
    assert first.billed == 1
    assert [i.status for i in Invoice.objects.filter(subscription=sub)] == ["paid"]
    assert len(stripe_proxy.entries("POST /v1/payment_intents", "forwarded")) == 1


def test_racing_drains_bill_every_subscription_exactly_once(book, tenant, stripe_proxy):
    subs = [book.subscribed(tenant) for _ in range(24)]
    # Slow charges keep closes in flight while the other drains claim the same rows.
    stripe_proxy.fail_next("delay", times=1000, match="POST /v1/payment_intents", delay_s=0.02)
    errors = []

    def drain():
        try:
            _drain(tenant, page_size=4, concurrency=3)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=drain) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    per_period = Counter(Invoice.objects.values_list("subscription_id", "period_start"))
    assert len(per_period) == 24 and set(per_period.values()) == {1}
    assert Invoice.objects.filter(status="paid").count() == 24
    assert PaymentAttempt.objects.filter(outcome="succeeded").count() == 24
    assert len(stripe_proxy.entries("POST /v1/payment_intents", "forwarded")) == 24
    assert {s.id for s in subs} == set(Invoice.objects.values_list("subscription_id", flat=True))


def test_negative_control_without_the_unique_index_racing_drains_bill_a_period_twice(
    book, tenant, stripe_proxy, monkeypatch, no_doctor
):
    sub = book.subscribed(tenant)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_indexdef('invoice_one_per_period'::regclass)")
        index_sql = cursor.fetchone()[0]
        cursor.execute("DROP INDEX invoice_one_per_period")
    try:
        _race_inside_a_charge(monkeypatch, tenant)

        invoices = list(Invoice.objects.filter(subscription=sub))
        assert len(invoices) == 2, "without the index the racing drain must create a second invoice"
        assert len({i.period_start for i in invoices}) == 1
        assert [i.status for i in invoices] == ["paid", "paid"]  # and the customer is charged twice
        assert len(stripe_proxy.entries("POST /v1/payment_intents", "forwarded")) == 2
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE billing_invoice, billing_invoicelineitem, billing_paymentattempt, billing_billingattempt,"
                " billing_ledgerentry, dunning_dunningrun CASCADE"
            )
            cursor.execute(index_sql)
