"""Helpers of the test-clock tests: make a clock, subscribe on it, advance it and wait."""

from __future__ import annotations

from datetime import datetime

from tests.billing.conftest import VISA, Book


def make_clock(tenant, frozen_time: datetime, name: str = ""):
    """A ready test clock of ``tenant`` (test mode) at ``frozen_time``, through the service."""
    from billing.services.clocks import create_test_clock

    return create_test_clock(tenant_id=tenant.id, livemode=False, frozen_time=frozen_time, name=name)


def advance(clock, to: datetime, *, timeout_s: float = 600):
    """Advance ``clock`` to ``to`` through the service, wait for the background walk, return the clock re-read."""
    from billing.services.clocks import advance_test_clock, wait_for_advances

    started = advance_test_clock(tenant_id=clock.tenant_id, livemode=False, clock_id=clock.id, frozen_time=to)
    assert started.status == "advancing"
    assert wait_for_advances(timeout_s=timeout_s), "the advance did not finish"
    clock.refresh_from_db()
    return clock


def subscribe(book: Book, clock, *, interval: str = "month", card: str | None = VISA, amount: int = 1000, **kw):
    """A customer on ``clock`` (with ``card``) subscribed through the catalog service at the clock's time."""
    from billing.services.catalog import create_price, create_subscription

    customer = book.customer(clock.tenant, card=card, clock=clock)
    price = create_price(tenant_id=clock.tenant_id, livemode=False, amount=amount, currency="usd", interval=interval)
    return create_subscription(
        tenant_id=clock.tenant_id, livemode=False, customer_id=customer.id, price_id=price.id, **kw
    )
