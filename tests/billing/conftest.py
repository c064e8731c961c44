"""Billing fixtures: localstripe (a child process) behind the strict dev Stripe, and a small book.

localstripe runs once per session on a free port (``python -m devstack.devstripe``); every test
talks to it through :class:`devstack.strict_stripe.StrictStripe` (the proxy ``make run`` puts in
front of its localstripe too: Stripe's idempotency layer plus faults), whose faults are cleared
before each test. Drain tests use ``transactional_db``: the drain's parallel closes run on their own
threads and connections, so they must see committed rows.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import stripe

from devstack.strict_stripe import StrictStripe

ROOT = Path(__file__).resolve().parents[2]
STRIPE_KEY = "sk_test_hardcount_localstripe"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, child: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"localstripe exited with {child.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/v1/customers?limit=1", headers={"Authorization": f"Bearer {STRIPE_KEY}"})
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("localstripe did not answer")


@pytest.fixture(scope="session")
def localstripe_base():
    """``http://127.0.0.1:<port>`` of a fresh, in-memory localstripe for this session."""
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "devstack.devstripe", "--port", str(port)],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port, child)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@pytest.fixture(scope="session")
def proxy_session(localstripe_base):
    """The strict dev Stripe in front of ``localstripe_base``, in this process (keys kept 24 h, in memory)."""
    proxy = StrictStripe(localstripe_base).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def stripe_proxy(proxy_session, settings):
    """The proxy, faults cleared, with the gateway pointed at it (timeout 2 s unless a test lowers it).

    Every account's 429 backoff gate opens first: a rate limit one test provoked is not the next test's.
    """
    from billing.gateway import clear_backoffs

    clear_backoffs()
    proxy_session.clear()
    settings.STRIPE_API_BASE = proxy_session.api_base
    settings.STRIPE_API_KEY = STRIPE_KEY
    settings.HARDCOUNT_GATEWAY_TIMEOUT_S = 2.0
    yield proxy_session
    proxy_session.clear()


@pytest.fixture
def stripe_client(localstripe_base):
    """A library client straight to localstripe, for test set-up and inspection."""
    return stripe.StripeClient(STRIPE_KEY, base_addresses={"api": localstripe_base}, max_network_retries=0)


VISA = "4242424242424242"
DECLINING_CARD = "4000000000000341"  # attaches, then every charge is declined (localstripe and Stripe)


@pytest.fixture
def make_card(stripe_client):
    """``make_card(number) -> "pm_…"``: a card PaymentMethod in localstripe."""

    def make(number: str = VISA) -> str:
        pm = stripe_client.v1.payment_methods.create(
            params={"type": "card", "card": {"number": number, "exp_month": 12, "exp_year": 2034, "cvc": "123"}}
        )
        return pm.id

    return make


T0 = datetime(2027, 1, 1, tzinfo=UTC)


def _clock_time(test_clock_id: str | None) -> datetime | None:
    """The clock's time for the event of an object on ``test_clock_id`` (as the services date it), else None."""
    from billing.models import TestClock

    return TestClock.objects.get(pk=test_clock_id).frozen_time if test_clock_id else None


class Book:
    """Builds a tenant's customers, prices and subscriptions straight in the database.

    Subscriptions are anchored an hour before the DB's now() (so due) unless told otherwise;
    each customer gets its own card PaymentMethod in localstripe (``card=None``: no method).
    """

    def __init__(self, make_card):
        self._make_card = make_card

    def tenant(self, name: str = "Acme"):
        from hardcount.models import Tenant

        return Tenant.objects.create(name=name)

    def customer(self, tenant, *, card: str | None = VISA, livemode: bool = False, clock=None, currency: str = "usd"):
        from django.db import transaction

        from billing.models import Customer
        from billing.representations import customer_data
        from outbox.services import emit_event

        payment_method = self._make_card(card) if card else ""
        with transaction.atomic():
            customer = Customer.objects.create(
                tenant=tenant,
                livemode=livemode,
                email=f"c{Customer.objects.count()}@example.com",
                default_payment_method=payment_method,
                currency=currency,
                test_clock=clock,
            )
            emit_event(
                tenant_id=tenant.id,
                livemode=livemode,
                type="customer.created",
                data=customer_data(customer),
                created_at=_clock_time(customer.test_clock_id),
            )
        return customer

    def price(self, tenant, *, amount: int = 1000, currency: str = "usd", interval: str = "month", livemode=False):
        from billing.models import Price

        return Price.objects.create(
            tenant=tenant, livemode=livemode, amount=amount, currency=currency, interval=interval, interval_count=1
        )

    def subscription(
        self, customer, price, *, anchor: datetime | None = None, status: str = "active", quantity: int = 1
    ):
        from django.db import transaction

        from billing.models import Subscription, SubscriptionItem
        from billing.representations import subscription_data
        from hardcount.times import database_now
        from outbox.services import emit_event

        if anchor is None:
            anchor = database_now() - timedelta(hours=1)
        with transaction.atomic():
            sub = Subscription.objects.create(
                tenant_id=customer.tenant_id,
                livemode=customer.livemode,
                customer=customer,
                price=price,
                status=status,
                billing_cycle_anchor=anchor,
                next_billing_at=anchor,
                test_clock=customer.test_clock,
            )
            SubscriptionItem.objects.create(
                tenant_id=sub.tenant_id, livemode=sub.livemode, subscription=sub, price=price, quantity=quantity
            )
            emit_event(
                tenant_id=sub.tenant_id,
                livemode=sub.livemode,
                type="subscription.created",
                data=subscription_data(sub),
                created_at=_clock_time(sub.test_clock_id),
            )
        return sub

    def subscribed(
        self, tenant, *, card: str | None = VISA, amount: int = 1000, currency: str = "usd", interval="month", **kw
    ):
        """A new customer (with ``card``) subscribed to a new price: returns the subscription."""
        customer = self.customer(tenant, card=card, currency=currency)
        price = self.price(tenant, amount=amount, currency=currency, interval=interval)
        return self.subscription(customer, price, **kw)


@pytest.fixture
def book(request, transactional_db, stripe_proxy, make_card):
    """The book builder. After the test, the money-invariant sweep (``doctor``) must find nothing
    wrong in what the test left behind (opt out with the ``no_doctor`` fixture). A manual run's drain thread may
    not outlive its test: it is waited for first (the next test flushes the tables under it)."""
    yield Book(make_card)
    wait_for_manual_runs()
    if "no_doctor" in request.fixturenames:
        return
    from ops.doctor import run_checks

    failures = [(r.name, r.examples) for r in run_checks() if r.status not in ("ok", "not checked")]
    assert failures == [], failures


def wait_for_manual_runs() -> None:
    """Wait until this process's manual-run drains have ended."""
    from billing.services.manual_runs import wait_for_manual_runs as wait

    assert wait(timeout_s=120), "a manual billing run did not finish"


@pytest.fixture
def no_doctor():
    """Opt out of the doctor sweep after the test (a test that breaks an invariant on purpose)."""


@pytest.fixture
def tenant(book):
    return book.tenant()


def events(type_: str, **filters) -> list:
    """Outbox events of ``type_`` (oldest first)."""
    from outbox.models import Event

    return list(Event.objects.filter(type=type_, **filters).order_by("sequence"))


def age_payment_attempts(**filters) -> None:
    """Move unresolved payment attempts' ``started_at`` past the in-flight window and the poll interval of
    pending PaymentIntents (no sleeping): the reconciler takes them up next."""
    from billing.models import PaymentAttempt
    from billing.services.payments import pending_poll_interval

    for attempt in PaymentAttempt.objects.filter(**filters):
        attempt.started_at -= pending_poll_interval() + timedelta(seconds=1)
        attempt.save(update_fields=["started_at"])


def pytest_configure(config):
    # stripe's HTTPX client passes bytes as data=; httpx warns on every request.
    config.addinivalue_line("filterwarnings", "ignore:Use 'content=<...>':DeprecationWarning")
