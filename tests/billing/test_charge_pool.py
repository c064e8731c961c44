"""The drain's gateway calls in flight at once, on sender threads with no database connection, bounded per account.

docs/decisions/0186-charges-in-flight-without-connections.md. Real PostgreSQL; the gateway is a stub in the
process where a test needs to hold its calls (a barrier that only opens once every charge of a page is in
flight at the same moment), the real ``stripe`` library to localstripe otherwise.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from billing import gateway as gw
from billing.models import Invoice
from billing.services import charge_pool, drain, payments
from billing.services.charge_pool import AccountLimits, ChargePool
from billing.services.drain import drain_due


class _HeldGateway:
    """Answers every charge ``succeeded``, but only once ``parties`` charges wait in it at the same time."""

    account = "stub:held"

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=30)
        self.threads: set[str] = set()

    def charge(self, req):
        self.threads.add(threading.current_thread().name)
        self.barrier.wait()  # raises BrokenBarrierError unless all are in flight together
        return gw.ChargeResult(
            outcome=gw.SUCCEEDED,
            gateway_customer_id=req.gateway_customer_id or f"cus_stub_{req.customer_id}",
            payment_method_attached=req.attach_payment_method,
            payment_intent_id=f"pi_stub_{req.invoice_id}",
        )


class _RecordingPool(ChargePool):
    made: list[ChargePool] = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.made.append(self)


@pytest.fixture
def recorded_pools(monkeypatch):
    _RecordingPool.made = []
    monkeypatch.setattr(drain, "ChargePool", _RecordingPool)
    return _RecordingPool.made


def test_a_page_s_charges_are_all_in_flight_at_once_on_one_database_connection(
    book, tenant, monkeypatch, recorded_pools
):
    subs = [book.subscribed(tenant) for _ in range(6)]
    held = _HeldGateway(parties=len(subs))
    monkeypatch.setattr(payments, "gateway_for", lambda tenant_id, livemode: held)

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, concurrency=1, page_size=10)

    # Six charges met in the gateway together although the drain had one connection (concurrency 1).
    assert (run.attempted, run.billed) == (6, 6)
    assert set(Invoice.objects.filter(subscription__in=subs).values_list("status", flat=True)) == {"paid"}
    assert len(held.threads) == 6 and all(name.startswith("billing-charge-") for name in held.threads)
    # ...and none of the sender threads opened a database connection.
    (pool,) = recorded_pools
    assert pool.connections_opened == 0


def test_negative_control_one_charge_in_flight_cannot_meet_the_others(book, tenant, monkeypatch, settings):
    settings.HARDCOUNT_BILLING_CHARGES_IN_FLIGHT = 1
    subs = [book.subscribed(tenant) for _ in range(3)]
    held = _HeldGateway(parties=3)
    held.barrier = threading.Barrier(3, timeout=0.5)
    monkeypatch.setattr(payments, "gateway_for", lambda tenant_id, livemode: held)

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, concurrency=1, page_size=10)

    # Sent one at a time, the first charge waits alone and the barrier breaks: every charge fails.
    assert (run.attempted, run.billed, run.failed) == (3, 0, 3)
    assert len(subs) == 3


def test_a_sender_thread_that_touches_the_database_is_counted_and_its_connection_closed(transactional_db):
    pool = ChargePool(2, limits=AccountLimits())
    clean = pool.submit(lambda: 1, account="a", livemode=False)
    assert clean.result() == 1

    def query():
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone()[0]

    touched = pool.submit(query, account="a", livemode=False)
    assert touched.result() == 1
    pool.shutdown()
    assert pool.connections_opened == 1


class _FrozenClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait_done(pendings) -> None:
    for pending in pendings:
        pending.result()


def test_an_account_s_calls_keep_to_its_rate_while_another_account_s_go_ahead(settings):
    settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S = 5
    clock = _FrozenClock()
    pool = ChargePool(8, limits=AccountLimits(clock))
    try:
        busy = [pool.submit(lambda i=i: i, account="busy", livemode=False) for i in range(12)]
        calm = [pool.submit(lambda i=i: i, account="calm", livemode=False) for i in range(4)]

        # Time stands still: the busy account gets its bucket's five, the calm one all four of its own.
        _wait_done(busy[:5] + calm)
        assert [p._done.is_set() for p in busy] == [True] * 5 + [False] * 7

        clock.now += 1.0  # one second later: five more, in submission order
        _wait_done(busy[5:10])
        assert [p._done.is_set() for p in busy] == [True] * 10 + [False] * 2
        assert [p.result() for p in busy[:10]] == list(range(10))

        clock.now += 1.0
        _wait_done(busy)
    finally:
        pool.shutdown()


def test_a_call_costs_the_requests_it_makes(settings):
    settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S = 6
    clock = _FrozenClock()
    pool = ChargePool(4, limits=AccountLimits(clock))
    try:
        # A first charge of a customer is three requests (customer, attach, PaymentIntent): two fit in six.
        first = [pool.submit(lambda: "first", account="a", livemode=False, requests=3) for _ in range(3)]
        _wait_done(first[:2])
        assert [p._done.is_set() for p in first] == [True, True, False]
        clock.now += 0.5
        _wait_done(first)
    finally:
        pool.shutdown()


def test_negative_control_without_a_limit_nothing_waits(settings):
    settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S = 0
    pool = ChargePool(8, limits=AccountLimits(_FrozenClock()))
    try:
        calls = [pool.submit(lambda: None, account="busy", livemode=False) for _ in range(40)]
        _wait_done(calls)  # would hang at the sixth if the bucket applied
    finally:
        pool.shutdown()


def test_the_limit_is_stripe_s_when_charging_stripe_and_none_for_another_gateway(settings):
    from billing.gateway_accounts import requests_per_s

    settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S = None
    settings.STRIPE_API_BASE = ""
    assert (requests_per_s(True), requests_per_s(False)) == (100.0, 25.0)
    settings.STRIPE_API_BASE = "http://127.0.0.1:12111"
    assert (requests_per_s(True), requests_per_s(False)) == (0.0, 0.0)
    settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S = 40
    assert requests_per_s(False) == 40.0
    assert charge_pool.ACCOUNT_LIMITS is not None
