"""Collecting an open invoice for its dunning run: retry its payment now, or give up on it.

The dunning pass (:mod:`billing.services.dunning_pass`) reaches the invoice through these two
functions only. Both lock subscription → invoice (→ customer) first, the order every billing
writer uses, then call dunning's state functions (:mod:`dunning.services`) inside the same
transaction, after the billing rows, so the dunning run always changes together with the
invoice it follows (docs/decisions/0120).

- :func:`retry_invoice_payment` charges the invoice's ``amount_due`` (frozen since it was
  finalised) to the customer's *current* default payment method through the three steps of
  :mod:`billing.services.payments`: a new attempt confirms the invoice's PaymentIntent under its
  own key ``hc:{invoice}:attempt:{n}``, or an attempt whose outcome is still unresolved is
  re-sent under its own key, or looked up once that key may have expired
  (docs/reference/billing.md#idempotency-keys-expire). A decline continues the invoice's
  dunning run (``dunning.services.start_dunning``), a success ends it as recovered, a gateway
  failure puts it off (``dunning.services.retry_failed_locked``).
- :func:`mark_uncollectible` settles an invoice whose retries are exhausted: ``uncollectible``,
  and the tenant's final action on the subscription (``unpaid`` or ``canceled``,
  docs/reference/dunning.md); the run is exhausted (``dunning.services.exhaust_locked``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from django.db import transaction

from billing.events import invoice_event, subscription_event
from billing.lock_objects import customer_locked, subscription_and_invoice_locked
from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services import pausing
from billing.services.payments import (
    Outcome,
    OutcomeKind,
    PaymentInFlight,
    act_on_paid_locked,
    attempt_time,
    billing_time,
    charging,
    clear_failure_state,
    in_flight_window,
    invoice_clock_id,
    needs_no_charge,
    record_outcome,
    reserve_attempt_locked,
    send,
    settle_without_charge_locked,
)
from dunning import services as dunning_services
from dunning.services import FinalAction
from hardcount.fencing import NO_FENCE, Fence
from hardcount.times import database_now

# A run of a subscription paused with no resumes_at looks again this much later (a resume by hand
# is not announced to dunning).
PAUSED_RECHECK = timedelta(days=1)


class CollectionKind(StrEnum):
    """What a collection call came to."""

    CHARGED = "charged"  # a payment attempt was recorded: see ``outcome``
    IN_FLIGHT = "in_flight"  # an attempt of this invoice is being sent right now, or its outcome is unknown
    NOT_OPEN = "not_open"  # the invoice is no longer open (paid, void or uncollectible): see ``invoice_status``
    SUBSCRIPTION_CANCELED = "subscription_canceled"  # nothing is collected for a canceled subscription
    COLLECTION_PAUSED = "collection_paused"  # the subscription's collection is paused: acted on after it resumes
    MARKED_UNCOLLECTIBLE = "marked_uncollectible"


@dataclass
class CollectionResult:
    """``kind``: what happened; ``outcome``: the recorded payment's (``CHARGED``)."""

    kind: CollectionKind
    invoice_status: str
    outcome: Outcome | None = None


def _lock(invoice_id: str) -> tuple[Subscription | None, Invoice]:
    """Lock the invoice's subscription, then the invoice (the billing lock order)."""
    subscription_id = Invoice.objects.filter(pk=invoice_id).values_list("subscription_id", flat=True).get()
    subscription, invoice = subscription_and_invoice_locked(invoice_id, subscription_id=subscription_id)
    if invoice is None:  # gone since it was read (invoices are not deleted): as a plain get() would raise
        raise Invoice.DoesNotExist(f"Invoice {invoice_id} does not exist.")
    return subscription, invoice


def retry_invoice_payment(
    invoice_id: str, *, run_id: str, as_of: datetime | None = None, fence: Fence = NO_FENCE
) -> CollectionResult:
    """Charge an open invoice now, for a retry of its dunning run ``run_id``; returns what happened.

    ``as_of`` is the billing time written on the records (a test clock's time; None: the clock's
    ``frozen_time`` for an invoice on a clock, else the DB's now()). Every transaction is fenced
    with ``fence``. The transaction that records the payment moves the run on (a decline, a
    payment, or a gateway failure: tried again an hour later). Nothing is charged, and the run
    is told why in the same transaction, when the invoice is not open (``NOT_OPEN``: the run
    ends), its subscription is canceled (``SUBSCRIPTION_CANCELED``: the run ends), or an attempt
    is in flight (``IN_FLIGHT``, an ``unknown`` attempt younger than the in-flight window: the
    run is put off by that window; an older one is re-sent under its own key, or looked up). Never raises for
    a gateway failure (that is an ``error`` or ``unknown`` outcome); raises
    :class:`~hardcount.fencing.LeaseLost` when the fence refuses a write.
    """
    with charging():
        return _retry_charging(invoice_id, run_id=run_id, as_of=as_of, fence=fence)


def _retry_charging(invoice_id: str, *, run_id: str, as_of: datetime | None, fence: Fence) -> CollectionResult:
    with transaction.atomic():
        fence.check()
        subscription, invoice = _lock(invoice_id)
        skip = _skip_reason(subscription, invoice, as_of=as_of)
        if skip is not None:
            _skipped_locked(
                run_id,
                skip,
                invoice.status,
                as_of=as_of,
                resumes_at=getattr(subscription, "pause_collection_resumes_at", None),
            )
            return CollectionResult(skip, invoice.status)
        customer = customer_locked(invoice.customer_id)
        clock_id = invoice_clock_id(invoice, subscription)
        if needs_no_charge(invoice):
            # Not reachable for a declined invoice (its amount was charged once); settled like
            # POST /v1/invoices/{id}/pay would, for completeness.
            now = billing_time(clock_id, as_of)
            settle_without_charge_locked(invoice, customer, now=now)
            act_on_paid_locked(subscription, invoice, now=now)
            return CollectionResult(CollectionKind.CHARGED, invoice.status, Outcome(OutcomeKind.BILLED, invoice.id))
        attempted_at = attempt_time(billing_time(clock_id, as_of), test_clock_id=clock_id, as_of=as_of)
        try:
            plan = reserve_attempt_locked(invoice, customer, now=attempted_at)
        except PaymentInFlight:
            _skipped_locked(run_id, CollectionKind.IN_FLIGHT, invoice.status, as_of=as_of)
            return CollectionResult(CollectionKind.IN_FLIGHT, invoice.status)
        if plan.known_result is not None:  # no payment method: a decline recorded without a call
            outcome = record_outcome(plan, plan.known_result, fence=fence, as_of=as_of, retry_of=run_id)
            return CollectionResult(CollectionKind.CHARGED, Invoice.objects.get(pk=invoice_id).status, outcome)
    outcome = record_outcome(plan, send(plan), fence=fence, as_of=as_of, retry_of=run_id)
    return CollectionResult(CollectionKind.CHARGED, Invoice.objects.get(pk=invoice_id).status, outcome)


def mark_uncollectible(
    invoice_id: str,
    *,
    run_id: str,
    final_action: FinalAction,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
) -> CollectionResult:
    """Give up on an open invoice whose dunning run ``run_id`` is exhausted, in one fenced transaction.

    The invoice becomes ``uncollectible`` (``marked_uncollectible_at`` = the billing time,
    ``invoice.marked_uncollectible``); its subscription takes ``final_action``: ``unpaid``
    (``subscription.updated``; the drain stops billing it) or ``canceled`` (now, as
    ``POST /v1/subscriptions/{id}/cancel`` would: ``subscription.canceled``). A subscription
    already canceled keeps its state. The balance applied to the invoice stays applied. The run
    is exhausted in the same transaction (:func:`dunning.services.exhaust_locked`, which raises
    :class:`dunning.services.RunRevived` and so rolls it all back when the run was revived
    since its claim). Nothing is written, and the run is told why as by
    :func:`retry_invoice_payment`, when the invoice is not open (``NOT_OPEN``), its subscription
    is canceled (``SUBSCRIPTION_CANCELED``: nothing more is collected for it), or a payment of it
    has an unknown outcome (``IN_FLIGHT``: the card may have been charged). Raises
    ``ValueError`` for an unknown ``final_action``.
    """
    if final_action not in FinalAction.values:
        raise ValueError(f"unknown final action {final_action!r}")
    with transaction.atomic():
        fence.check()
        subscription, invoice = _lock(invoice_id)
        skip = _skip_reason(subscription, invoice, as_of=as_of)
        if skip is None and invoice.payment_attempts.filter(outcome=PaymentAttempt.UNKNOWN).exists():
            skip = CollectionKind.IN_FLIGHT
        if skip is not None:
            _skipped_locked(
                run_id,
                skip,
                invoice.status,
                as_of=as_of,
                resumes_at=getattr(subscription, "pause_collection_resumes_at", None),
            )
            return CollectionResult(skip, invoice.status)
        now = billing_time(invoice_clock_id(invoice, subscription), as_of)
        invoice.status = Invoice.UNCOLLECTIBLE
        invoice.marked_uncollectible_at = now
        invoice.save(update_fields=["status", "marked_uncollectible_at"])
        invoice_event(invoice, "invoice.marked_uncollectible", created_at=now)
        if subscription is not None:
            _apply_final_action_locked(subscription, final_action, now=now)
        dunning_services.exhaust_locked(
            run_id,
            at=now,
            subscription_id=subscription.id if subscription is not None else None,
            subscription_canceled=subscription is not None and subscription.status == Subscription.CANCELED,
        )
    return CollectionResult(CollectionKind.MARKED_UNCOLLECTIBLE, Invoice.UNCOLLECTIBLE)


def _skip_reason(
    subscription: Subscription | None, invoice: Invoice, *, as_of: datetime | None = None
) -> CollectionKind | None:
    if invoice.status != Invoice.OPEN:
        return CollectionKind.NOT_OPEN
    if subscription is not None and subscription.status == Subscription.CANCELED:
        return CollectionKind.SUBSCRIPTION_CANCELED
    if subscription is not None and pausing.collection_paused(
        subscription, now=billing_time(invoice_clock_id(invoice, subscription), as_of)
    ):
        return CollectionKind.COLLECTION_PAUSED
    return None


def _skipped_locked(
    run_id: str,
    kind: CollectionKind,
    invoice_status: str,
    *,
    as_of: datetime | None,
    resumes_at: datetime | None = None,
) -> None:
    """Tell the run why its invoice was neither charged nor settled, inside the transaction that found it."""
    at = as_of or database_now()
    if kind == CollectionKind.IN_FLIGHT:
        dunning_services.payment_in_flight_locked(run_id, until=at + in_flight_window())
    elif kind == CollectionKind.COLLECTION_PAUSED:
        dunning_services.collection_paused_locked(run_id, until=resumes_at or at + PAUSED_RECHECK)
    elif kind == CollectionKind.SUBSCRIPTION_CANCELED:
        dunning_services.subscription_canceled_locked(run_id, at=at)
    else:
        dunning_services.invoice_not_open_locked(run_id, invoice_status=invoice_status, at=at)


def _apply_final_action_locked(subscription: Subscription, final_action: FinalAction, *, now: datetime) -> None:
    if final_action == FinalAction.UNPAID:
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
    subscription_event(subscription, event_type, created_at=now)


__all__ = [
    "CollectionKind",
    "CollectionResult",
    "mark_uncollectible",
    "retry_invoice_payment",
]
