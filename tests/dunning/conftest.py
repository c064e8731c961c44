"""Dunning fixtures: billing's localstripe-behind-the-proxy and its small book, plus dunning helpers.

Time moves by passing ``as_of`` to the dunning pass or by setting rows' timestamps, never by
sleeping. ``declined(book, tenant)`` drains one subscription whose card always declines and
returns what the tests need about the decline.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest

from tests.billing import conftest as billing_fixtures
from tests.billing.conftest import DECLINING_CARD, VISA, events  # noqa: F401  (re-exported for the tests)

# Billing's fixtures, shared: localstripe behind the fault proxy, cards, and the small book.
localstripe_base = billing_fixtures.localstripe_base
proxy_session = billing_fixtures.proxy_session
stripe_proxy = billing_fixtures.stripe_proxy
stripe_client = billing_fixtures.stripe_client
make_card = billing_fixtures.make_card
book = billing_fixtures.book
tenant = billing_fixtures.tenant
STOLEN_CARD = "4000000000009979"  # declined with decline_code stolen_card (devstack.devstripe fix 3)
DAY = timedelta(days=1)
MINUTE = timedelta(minutes=1)


@dataclass
class Declined:
    """One subscription's first invoice, declined by the drain at ``at`` (the DB's now())."""

    subscription: object
    invoice: object
    run: object
    at: datetime


def decline(book, tenant, *, card: str = DECLINING_CARD, amount: int = 1000, currency: str = "usd") -> Declined:
    """Drain a new subscription whose card is ``card``; returns its declined invoice and dunning run."""
    from billing.models import Invoice
    from billing.services.drain import drain_due
    from dunning.models import DunningRun

    sub = book.subscribed(tenant, card=card, amount=amount, currency=currency)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    run = DunningRun.objects.get(invoice=invoice)
    return Declined(sub, invoice, run, run.first_declined_at)


@pytest.fixture
def declined(book, tenant):
    return decline(book, tenant)


def confirms(proxy, action: str | None = "forwarded") -> list:
    """Confirmation requests of PaymentIntents that reached localstripe (or got ``action``)."""
    return [e for e in proxy.entries("POST /v1/payment_intents/", action=action) if e.request.line.endswith("/confirm")]


def charges_sent(proxy) -> list:
    """Every request that could charge a card (PaymentIntent create or confirm, attach) that reached localstripe."""
    return [
        e
        for e in proxy.entries(action="forwarded")
        if e.request.method == "POST"
        and (e.request.line.startswith("POST /v1/payment_intents") or e.request.line.endswith("/attach"))
    ]


def doctor_failures() -> list[str]:
    """Names and examples of the money-invariant checks that fail right now (``manage.py doctor``)."""
    from ops.doctor import run_checks

    return [f"{r.name}: {r.examples}" for r in run_checks() if r.status != "ok"]


def pytest_configure(config):
    # stripe's HTTPX client passes bytes as data=; httpx warns on every request.
    config.addinivalue_line("filterwarnings", "ignore:Use 'content=<...>':DeprecationWarning")
