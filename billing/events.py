"""Billing's events, one helper per kind of object: the event's data is the object's representation.

Each helper emits event ``type`` about one object through :func:`outbox.services.emit_for`
(the event's tenant and mode are the object's), its data built by :mod:`billing.representations`,
so a call reads ``invoice_event(invoice, "invoice.paid", created_at=now)``. The rules are
:func:`outbox.services.emit_event`'s: inside the transaction that makes the change, a known event
type, ``created_at`` the billing time of the change (None: the wall clock). An event whose data
is not the object as it is now (the page close's ``invoice.created``, built before the invoice
was taxed) uses :func:`~outbox.services.emit_for` with that data.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from billing.representations import (
    billing_run_data,
    coupon_data,
    credit_note_data,
    customer_data,
    discount_data,
    invoice_data,
    invoice_item_data,
    ledger_entry_data,
    price_data,
    subscription_data,
    test_clock_data,
)
from outbox.services import emit_for


def invoice_event(
    invoice, type: str, *, created_at: datetime | None = None, lines=None, extra: dict[str, Any] | None = None
):
    """Emit ``type`` about an invoice: :func:`~billing.representations.invoice_data` with ``extra`` keys added.

    ``lines``: the invoice's line items when the caller has them (saves a query).
    """
    data = invoice_data(invoice, lines=lines)
    if extra:
        data.update(extra)
    return emit_for(invoice, type, data, created_at=created_at)


def charge_event(invoice, type: str, data: dict[str, Any], *, created_at: datetime | None = None):
    """Emit ``type`` (``charge.refunded``, ``charge.dispute.created``) about a charge of ``invoice``: ``data`` is
    the Stripe object as recorded (:mod:`billing.stripe_webhooks`); the event's tenant and mode are the invoice's."""
    return emit_for(invoice, type, data, created_at=created_at)


def credit_note_event(note, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a credit note (:func:`~billing.representations.credit_note_data`)."""
    return emit_for(note, type, credit_note_data(note), created_at=created_at)


def subscription_event(subscription, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a subscription (:func:`~billing.representations.subscription_data`)."""
    return emit_for(subscription, type, subscription_data(subscription), created_at=created_at)


def invoice_item_event(item, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a pending invoice item (:func:`~billing.representations.invoice_item_data`)."""
    return emit_for(item, type, invoice_item_data(item), created_at=created_at)


def customer_event(customer, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a customer (:func:`~billing.representations.customer_data`)."""
    return emit_for(customer, type, customer_data(customer), created_at=created_at)


def price_event(price, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a price (:func:`~billing.representations.price_data`)."""
    return emit_for(price, type, price_data(price), created_at=created_at)


def ledger_entry_event(entry, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a credit ledger entry (:func:`~billing.representations.ledger_entry_data`)."""
    return emit_for(entry, type, ledger_entry_data(entry), created_at=created_at)


def billing_run_event(run, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` about a billing run of one tenant (:func:`~billing.representations.billing_run_data`).

    A scheduler run covers every tenant (``tenant_id`` None) and has no event: do not call this for one.
    """
    return emit_for(run, type, billing_run_data(run), created_at=created_at)


def coupon_event(coupon, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` (``coupon.created``, ``coupon.deleted``) about a coupon
    (:func:`~billing.representations.coupon_data`)."""
    return emit_for(coupon, type, coupon_data(coupon), created_at=created_at)


def discount_event(discount, type: str, *, created_at: datetime | None = None):
    """Emit ``type`` (``customer.discount.created`` / ``.deleted``, Stripe's names) about a discount
    (:func:`~billing.representations.discount_data`)."""
    return emit_for(discount, type, discount_data(discount), created_at=created_at)


def test_clock_event(clock, type: str):
    """Emit ``type`` about a test clock (:func:`~billing.representations.test_clock_data`), dated by the clock's
    own ``frozen_time``. The in-memory clock serves for ``test_clock.deleted`` after its row is deleted."""
    return emit_for(clock, type, test_clock_data(clock), created_at=clock.frozen_time)


test_clock_event.__test__ = False  # not a pytest test despite its name

__all__ = [
    "billing_run_event",
    "charge_event",
    "coupon_event",
    "credit_note_event",
    "customer_event",
    "discount_event",
    "invoice_event",
    "invoice_item_event",
    "ledger_entry_event",
    "price_event",
    "subscription_event",
    "test_clock_event",
]
