"""Changing a customer: ``POST /v1/customers/{id}`` (docs/decisions/0071).

A new default payment method is the customer's answer to a declined invoice: each of the
customer's dunning runs retries at once with it (:func:`dunning.services.payment_method_changed`,
docs/reference/dunning.md: "a hard decline is not retried until the customer's payment method
changes"), in the same transaction as the change.
"""

from __future__ import annotations

from django.db import transaction

from billing.events import customer_event
from billing.lock_objects import callers_customer_locked
from billing.models import Customer
from billing.services.catalog import billing_now
from billing.services.discounts import KEEP, apply_to_customer_locked, end_customer_discount_locked
from dunning import services as dunning_services

UPDATABLE_FIELDS = ("email", "name", "external_id", "default_payment_method", "metadata")


def update_customer(*, tenant_id: str, livemode: bool, customer_id: str, **changes) -> Customer:
    """Change the given fields of a customer (``email``, ``name``, ``external_id``,
    ``default_payment_method``, ``metadata``; ``metadata`` replaces the whole set); returns it. ``coupon``: a
    coupon id to apply as the customer's discount, or None to delete its discount
    (:mod:`billing.services.discounts`), in the same transaction; ``coupon_param`` names it in a refusal.

    Emits ``customer.updated`` when something changed (nothing is written otherwise). A changed
    ``default_payment_method`` makes the customer's active dunning runs due at once. Raises
    :class:`~hardcount.errors.NotFoundError` for a customer not of the caller's tenant and mode,
    ``TypeError`` for a field that cannot be changed.
    """
    coupon = changes.pop("coupon", KEEP)
    coupon_param = changes.pop("coupon_param", "coupon")
    unknown = set(changes) - set(UPDATABLE_FIELDS)
    if unknown:
        raise TypeError(f"cannot update customer fields {sorted(unknown)}")
    with transaction.atomic():
        customer = callers_customer_locked(tenant_id, livemode, customer_id)
        if coupon is not KEEP:
            at = billing_now(customer.test_clock)
            if coupon is None:
                end_customer_discount_locked(customer, at=at)
            else:
                apply_to_customer_locked(customer, coupon, at=at, param=coupon_param)
        changed = [name for name, value in changes.items() if getattr(customer, name) != value]
        if not changed:
            return customer
        for name in changed:
            setattr(customer, name, changes[name])
        customer.save(update_fields=changed)
        now = billing_now(customer.test_clock)
        customer_event(customer, "customer.updated", created_at=now)
        if "default_payment_method" in changed and customer.default_payment_method:
            dunning_services.payment_method_changed(customer.id, at=now)
    return customer


__all__ = ["UPDATABLE_FIELDS", "update_customer"]
