"""Collecting an open invoice for dunning: retry its payment now, or give up on it.

Dunning (:mod:`dunning.services`) reaches billing through these two functions only. Both lock
subscription → invoice (→ customer) first, the order every billing writer uses, then hand
dunning a hook that runs inside the same transaction, after the billing rows, so the dunning
run always changes together with the invoice it follows.

- :func:`retry_invoice_payment` charges the invoice's ``amount_due`` (frozen since it was
  finalised) to the customer's *current* default payment method through the three steps of
  :mod:`billing.services.payments`: a new attempt confirms the invoice's PaymentIntent under its
  own key ``hc:{invoice}:attempt:{n}``, or an attempt whose outcome is still unresolved is
  re-sent under its own key (SPEC §4). A decline continues the invoice's dunning run
  (``dunning.services.start_dunning``), a success ends it as recovered.
- :func:`mark_uncollectible` settles an invoice whose retries are exhausted: ``uncollectible``,
  and the tenant's final action on the subscription (``unpaid`` or ``canceled``, SPEC §5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from billing.models import Invoice, PaymentAttempt, Subscription
from billing.representations import invoice_data, subscription_data
from billing.services.ledger import lock_customer
from billing.services.payments import (
    Outcome,
    PaymentInFlight,
    act_on_paid_locked,
    billing_time,
    clear_failure_state,
    invoice_clock_id,
    needs_no_charge,
    record_outcome,
    reserve_attempt_locked,
    send,
    settle_without_charge_locked,
)
from hardcount.fencing import NO_FENCE, Fence
from hardcount.times import database_now
from outbox.services import emit_event

# What a collection call came to, besides a recorded payment outcome.
CHARGED = "charged"  # a payment attempt was recorded: see ``outcome``
IN_FLIGHT = "in_flight"  # an attempt of this invoice is being sent right now, or its outcome is unknown
NOT_OPEN = "not_open"  # the invoice is no longer open (paid, void or uncollectible): see ``invoice_status``
SUBSCRIPTION_CANCELED = "subscription_canceled"  # nothing is collected for a canceled subscription
MARKED_UNCOLLECTIBLE = "marked_uncollectible"

UNPAID, CANCELED = "unpaid", "canceled"  # final actions


@dataclass
class CollectionResult:
    """``kind`` is one of the module's constants; ``outcome`` is the recorded payment's (``CHARGED``)."""

    kind: str
    invoice_status: str
    outcome: Outcome | None = None


def _lock(invoice_id: str) -> tuple[Subscription | None, Invoice]:
    """Lock the invoice's subscription, then the invoice (the billing lock order)."""
    subscription_id = Invoice.objects.filter(pk=invoice_id).values_list("subscription_id", flat=True).get()
    subscription = None
    if subscription_id:
        subscription = (
            Subscription.objects.select_for_update(of=("self",)).select_related("price").get(pk=subscription_id)
        )
    return subscription, Invoice.objects.select_for_update().get(pk=invoice_id)


def retry_invoice_payment(
    invoice_id: str,
    *,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
    on_record: Callable[[Invoice, PaymentAttempt, Outcome], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> CollectionResult:
    """Charge an open invoice now, for a dunning retry; returns what happened.

    ``as_of`` is the billing time written on the records (a test clock's time; None: the clock's
    ``frozen_time`` for an invoice on a clock, else the DB's now()). Every transaction is fenced
    with ``fence``. ``on_record(invoice, attempt, outcome)`` runs inside the transaction that
    records the payment; ``on_skip(kind, invoice_status)`` inside the transaction that found
    nothing to charge: the invoice is not open (``NOT_OPEN``), its subscription is canceled
    (``SUBSCRIPTION_CANCELED``), or an attempt is in flight (``IN_FLIGHT``, an ``unknown`` attempt
    younger than the in-flight window; an older one is re-sent under its own key). Never raises
    for a gateway failure (that is an ``error`` or ``unknown`` outcome); raises
    :class:`~hardcount.fencing.LeaseLost` when the fence refuses a write.
    """
    with transaction.atomic():
        fence.check()
        subscription, invoice = _lock(invoice_id)
        skip = _skip_reason(subscription, invoice)
        if skip is not None:
            if on_skip is not None:
                on_skip(skip, invoice.status)
            return CollectionResult(skip, invoice.status)
        customer = lock_customer(invoice.customer_id)
        if needs_no_charge(invoice):
            # Not reachable for a declined invoice (its amount was charged once); settled like
            # POST /v1/invoices/{id}/pay would, for completeness.
            now = billing_time(invoice_clock_id(invoice, subscription), as_of)
            attempt = settle_without_charge_locked(invoice, customer, now=now)
            act_on_paid_locked(subscription, invoice, now=now)
            outcome = Outcome("billed", invoice.id)
            if on_record is not None:
                on_record(invoice, attempt, outcome)
            return CollectionResult(CHARGED, invoice.status, outcome)
        try:
            plan = reserve_attempt_locked(invoice, customer, now=database_now())
        except PaymentInFlight:
            if on_skip is not None:
                on_skip(IN_FLIGHT, invoice.status)
            return CollectionResult(IN_FLIGHT, invoice.status)
        if plan.known_result is not None:  # no payment method: a decline recorded without a call
            outcome = record_outcome(plan, plan.known_result, fence=fence, as_of=as_of, on_record=on_record)
            return CollectionResult(CHARGED, Invoice.objects.get(pk=invoice_id).status, outcome)
    outcome = record_outcome(plan, send(plan), fence=fence, as_of=as_of, on_record=on_record)
    return CollectionResult(CHARGED, Invoice.objects.get(pk=invoice_id).status, outcome)


def mark_uncollectible(
    invoice_id: str,
    *,
    final_action: str,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
    on_marked: Callable[[Invoice, Subscription | None], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> CollectionResult:
    """Give up on an open invoice whose dunning is exhausted (SPEC §5), in one fenced transaction.

    The invoice becomes ``uncollectible`` (``marked_uncollectible_at`` = the billing time,
    ``invoice.marked_uncollectible``); its subscription takes ``final_action``: ``unpaid``
    (``subscription.updated``; the drain stops billing it) or ``canceled`` (now, as
    ``POST /v1/subscriptions/{id}/cancel`` would: ``subscription.canceled``). A subscription
    already canceled keeps its state. The balance applied to the invoice stays applied.
    ``on_marked(invoice, subscription)`` runs inside the transaction. Nothing is written, and
    ``on_skip(kind, invoice_status)`` runs instead, when the invoice is not open (``NOT_OPEN``),
    its subscription is canceled (``SUBSCRIPTION_CANCELED``: nothing more is collected for it),
    or a payment of it has an unknown outcome (``IN_FLIGHT``: the card may have been charged).
    Raises ``ValueError`` for an unknown ``final_action``.
    """
    if final_action not in (UNPAID, CANCELED):
        raise ValueError(f"unknown final action {final_action!r}")
    with transaction.atomic():
        fence.check()
        subscription, invoice = _lock(invoice_id)
        skip = _skip_reason(subscription, invoice)
        if skip is None and invoice.payment_attempts.filter(outcome=PaymentAttempt.UNKNOWN).exists():
            skip = IN_FLIGHT
        if skip is not None:
            if on_skip is not None:
                on_skip(skip, invoice.status)
            return CollectionResult(skip, invoice.status)
        now = billing_time(invoice_clock_id(invoice, subscription), as_of)
        invoice.status = Invoice.UNCOLLECTIBLE
        invoice.marked_uncollectible_at = now
        invoice.save(update_fields=["status", "marked_uncollectible_at"])
        emit_event(
            tenant_id=invoice.tenant_id,
            livemode=invoice.livemode,
            type="invoice.marked_uncollectible",
            data=invoice_data(invoice),
            created_at=now,
        )
        if subscription is not None:
            _apply_final_action_locked(subscription, final_action, now=now)
        if on_marked is not None:
            on_marked(invoice, subscription)
    return CollectionResult(MARKED_UNCOLLECTIBLE, Invoice.UNCOLLECTIBLE)


def _skip_reason(subscription: Subscription | None, invoice: Invoice) -> str | None:
    if invoice.status != Invoice.OPEN:
        return NOT_OPEN
    if subscription is not None and subscription.status == Subscription.CANCELED:
        return SUBSCRIPTION_CANCELED
    return None


def _apply_final_action_locked(subscription: Subscription, final_action: str, *, now: datetime) -> None:
    if final_action == UNPAID:
        if subscription.status == Subscription.UNPAID:
            return
        subscription.status = Subscription.UNPAID
        subscription.save()
        event_type = "subscription.updated"
    else:
        subscription.status = Subscription.CANCELED
        subscription.canceled_at = now
        subscription.ended_at = now
        subscription.next_billing_at = None
        subscription.cancel_at_period_end = False
        clear_failure_state(subscription)
        subscription.save()
        event_type = "subscription.canceled"
    emit_event(
        tenant_id=subscription.tenant_id,
        livemode=subscription.livemode,
        type=event_type,
        data=subscription_data(subscription),
        created_at=now,
    )


__all__ = [
    "CANCELED",
    "CHARGED",
    "IN_FLIGHT",
    "MARKED_UNCOLLECTIBLE",
    "NOT_OPEN",
    "SUBSCRIPTION_CANCELED",
    "UNPAID",
    "CollectionResult",
    "mark_uncollectible",
    "retry_invoice_payment",
]
