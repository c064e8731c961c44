"""Operations on one invoice: pay it now, or void it.

``pay_invoice`` serves ``POST /v1/invoices/{id}/pay`` (dunning's retries charge through
:mod:`billing.services.collection` instead). It charges through the same three steps as the
drain (:mod:`billing.services.payments`): a new attempt with its own key
(``hc:{invoice}:attempt:{n}``), or a same-key re-send of an attempt whose outcome is still
unknown. A failure is kept on the attempt only; the retry ladder belongs to the drain.
"""

from __future__ import annotations

from django.db import transaction

from billing.events import invoice_event, subscription_event
from billing.lock_objects import customer_locked, subscription_and_invoice_locked
from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services.ledger import return_credit_locked
from billing.services.payments import (
    Outcome,
    OutcomeKind,
    PaymentInFlight,
    act_on_paid_locked,
    attempt_time,
    billing_time,
    charging,
    invoice_clock_id,
    needs_no_charge,
    record_outcome,
    reserve_attempt_locked,
    send,
    settle_without_charge_locked,
)
from dunning import services as dunning_services
from hardcount.errors import NotFoundError, StateConflictError
from hardcount.fencing import NO_FENCE, Fence


class InvoiceStateError(StateConflictError):
    """409: the invoice's status does not allow the operation."""

    default_code = "invoice_unexpected_state"


def _lock_invoice_and_subscription(
    invoice_id: str, *, tenant_id: str, livemode: bool
) -> tuple[Invoice, Subscription | None]:
    """Lock subscription then invoice (the billing lock order); NotFoundError when not the caller's."""
    found = (
        Invoice.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=invoice_id).only("subscription_id").first()
    )
    if found is None:
        raise NotFoundError(f"No such invoice: '{invoice_id}'.", param="id")
    sub, invoice = subscription_and_invoice_locked(invoice_id, subscription_id=found.subscription_id)
    if invoice is None:  # gone since it was read (invoices are not deleted): as a plain get() would raise
        raise Invoice.DoesNotExist(f"Invoice {invoice_id} does not exist.")
    return invoice, sub


def pay_invoice(
    invoice_id: str, *, tenant_id: str, livemode: bool, fence: Fence = NO_FENCE
) -> tuple[Invoice, PaymentAttempt | None, Outcome]:
    """Charge an ``open`` invoice's ``amount_due`` now; returns ``(invoice, attempt, outcome)`` after recording.

    The customer's current default payment method is charged (a decline starts or continues the
    invoice's dunning run; success ends it as recovered and, for the subscription's current
    period, advances the period and clears the failure state). Zero and below-minimum amounts
    settle without a call. Raises :class:`NotFoundError` (not the caller's invoice),
    :class:`InvoiceStateError` (409: not open; a draft waiting for tax) and
    :class:`PaymentInFlight` (409: an attempt is being sent right now).
    """
    with charging():
        return _pay_charging(invoice_id, tenant_id=tenant_id, livemode=livemode, fence=fence)


def _pay_charging(
    invoice_id: str, *, tenant_id: str, livemode: bool, fence: Fence
) -> tuple[Invoice, PaymentAttempt | None, Outcome]:
    with transaction.atomic():
        fence.check()
        invoice, sub = _lock_invoice_and_subscription(invoice_id, tenant_id=tenant_id, livemode=livemode)
        if invoice.status != Invoice.OPEN:
            detail = " (waiting for tax)" if invoice.tax_status == Invoice.TAX_PENDING else ""
            raise InvoiceStateError(
                f"Invoice {invoice.id} is {invoice.status}{detail}; only open invoices can be paid."
            )
        customer = customer_locked(invoice.customer_id)
        clock_id = invoice_clock_id(invoice, sub)
        now = billing_time(clock_id)
        if needs_no_charge(invoice):
            attempt = settle_without_charge_locked(invoice, customer, now=now)
            act_on_paid_locked(sub, invoice, now=now)
            return invoice, attempt, Outcome(OutcomeKind.BILLED, invoice.id)
        plan = reserve_attempt_locked(invoice, customer, now=attempt_time(now, test_clock_id=clock_id, as_of=None))
        if plan.known_result is not None:
            outcome = record_outcome(plan, plan.known_result, fence=fence)
            return Invoice.objects.get(pk=invoice.pk), PaymentAttempt.objects.get(pk=plan.attempt_id), outcome
    outcome = record_outcome(plan, send(plan), fence=fence)
    return Invoice.objects.get(pk=plan.invoice_id), PaymentAttempt.objects.get(pk=plan.attempt_id), outcome


def void_invoice(invoice_id: str, *, tenant_id: str, livemode: bool) -> Invoice:
    """Void a ``draft`` or ``open`` invoice and emit ``invoice.voided``.

    The balance applied to it goes back to the customer (a ledger ``adjustment``); its dunning
    run ends. The period is not advanced: a voided invoice leaves the partial unique index, so a
    subscription still on that period gets a fresh invoice from the next drain (void and
    re-issue, docs/decisions/0013). Raises :class:`NotFoundError`, :class:`InvoiceStateError`
    (409: paid, void or uncollectible) and :class:`PaymentInFlight` (409: a payment's outcome is
    still unknown — the card may have been charged; it must be resolved first).
    """
    with transaction.atomic():
        invoice, sub = _lock_invoice_and_subscription(invoice_id, tenant_id=tenant_id, livemode=livemode)
        if invoice.status not in (Invoice.DRAFT, Invoice.OPEN):
            raise InvoiceStateError(
                f"Invoice {invoice.id} is {invoice.status}; only draft or open invoices can be voided."
            )
        if invoice.payment_attempts.filter(outcome=PaymentAttempt.UNKNOWN).exists():
            raise PaymentInFlight(
                f"A payment of invoice {invoice.id} has an unknown outcome; it must be resolved before voiding."
            )
        now = billing_time(invoice_clock_id(invoice, sub))
        if invoice.credit_applied:
            return_credit_locked(customer_locked(invoice.customer_id), invoice, at=now)
        invoice.status = Invoice.VOID
        invoice.voided_at = now
        invoice.save(update_fields=["status", "voided_at"])
        invoice_event(invoice, "invoice.voided", created_at=now)
        dunning_services.stop_dunning(invoice, ended_at=now)
        if (
            sub is not None
            and sub.status == Subscription.PAST_DUE
            and not sub.invoices.filter(status=Invoice.OPEN).exists()
        ):
            sub.status = Subscription.ACTIVE
            sub.save()
            subscription_event(sub, "subscription.updated", created_at=now)
    return invoice
