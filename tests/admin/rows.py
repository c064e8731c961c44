"""Rows for admin tests, written straight with the ORM (no gateway): a tenant's customer, price and subscription."""

from __future__ import annotations

from datetime import timedelta
from itertools import count

from django.utils import timezone

_n = count(1)


def subscription(tenant, *, livemode: bool = False, email: str | None = None, external_id: str = "", **fields):
    """A new customer subscribed to a new monthly 10.00 USD price; ``fields`` override the subscription's."""
    from billing.models import Customer, Price, Subscription

    n = next(_n)
    customer = Customer.objects.create(
        tenant=tenant,
        livemode=livemode,
        email=email or f"customer{n}@example.com",
        external_id=external_id,
        currency="usd",
    )
    price = Price.objects.create(tenant=tenant, livemode=livemode, amount=1000, currency="usd", interval="month")
    now = timezone.now()
    values = {"status": "active", "billing_cycle_anchor": now, "next_billing_at": now + timedelta(days=30), **fields}
    return Subscription.objects.create(tenant=tenant, livemode=livemode, customer=customer, price=price, **values)


def waiting(tenant, **fields):
    """A subscription on the retry ladder: failure 2, next attempt in an hour."""
    return subscription(
        tenant,
        billing_failure_count=2,
        next_billing_attempt_at=timezone.now() + timedelta(hours=1),
        last_billing_error="gateway: 503 Service Unavailable",
        **fields,
    )


def parked(tenant, **fields):
    """A subscription parked after its eighth failure."""
    return subscription(
        tenant,
        billing_failure_count=8,
        billing_parked_at=timezone.now(),
        last_billing_error="gateway: connection reset",
        **fields,
    )


def invoice(sub, *, status: str = "open", tax_status: str = "not_applicable", offset: int = 0):
    """An invoice of ``sub``'s period number ``offset`` (amounts of its price, nothing applied)."""
    from billing.models import Invoice

    price = sub.price
    start = sub.billing_cycle_anchor + timedelta(days=30 * offset)
    return Invoice.objects.create(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        subscription=sub,
        status=status,
        tax_status=tax_status,
        currency=price.currency,
        period_start=start,
        period_end=start + timedelta(days=30),
        subtotal=price.amount,
        total=price.amount,
        amount_due=price.amount,
    )
