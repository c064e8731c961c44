"""Closing one subscription period: the three crash-safe steps of docs/reference/billing.md#closing-a-period.

1. One transaction: lock the subscription and re-check it is still due for the claimed period;
   materialise the period's invoice (``INSERT … ON CONFLICT DO NOTHING`` on the unique index,
   or take the existing one); compute tax and apply the customer's balance; finalise it with a
   gapless number; reserve the payment attempt (:mod:`billing.services.payments`). A tax outage
   leaves the invoice a ``pending`` draft and advances the period without a charge.
2. Charge ``amount_due`` through the gateway, outside any transaction.
3. One transaction: record the attempt and act on it (paid → period advances; declined → the
   period advances, ``past_due``, dunning; failure → the period stays, the retry ladder).

A crash between any two steps is harmless: after step 1 the invoice and the reserved attempt
exist, and the next close takes both and re-sends the attempt under its key; after step 2 the
gateway has stored its answer under that key. ``hooks`` lets tests stop a close between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import InterfaceError, OperationalError, connection, transaction

from billing import gateway as gw
from billing.events import invoice_event, subscription_event
from billing.lock_objects import customer_locked, invoice_qs_select_for_update, subscription_qs_select_for_update
from billing.models import (
    BillingRun,
    Customer,
    Invoice,
    InvoiceLineItem,
    PaymentAttempt,
    Subscription,
    SubscriptionItem,
)
from billing.periods import period_bounds
from billing.queries import lock_due_subscription, materialise_invoice, next_invoice_number
from billing.services.discounts import apply_discount_locked
from billing.services.items import apply_scheduled_locked
from billing.services.ledger import apply_balance_locked
from billing.services.lines import items_by_subscription, period_lines, sweep_pending_locked
from billing.services.payments import (
    ChargePlan,
    Outcome,
    OutcomeKind,
    PaymentInFlight,
    act_on_paid_locked,
    advance_period_locked,
    attempt_time,
    billing_time,
    charging,
    clear_failure_state,
    needs_no_charge,
    period_advances,
    record_outcome,
    reserve_attempt_locked,
    save_failure_locked,
    send,
    settle_without_charge_locked,
    write_billing_attempt,
)
from billing.services.usage import (
    HOLD_AMOUNT_TOO_LARGE,
    bill_final_usage_locked,
    hold_reason,
    usage_before_schedule_locked,
    usage_lines_for,
)
from billing.tax import TaxableInvoice, TaxQuote, TaxUnavailable, get_tax_provider
from hardcount.fencing import NO_FENCE, Fence, LeaseLost
from hardcount.ids import PREFIXES, new_id
from hardcount.money import MAX_AMOUNT
from outbox import services as outbox_services

log = logging.getLogger("billing.close")


@dataclass
class Hooks:
    """Test seams between the steps of a close: ``after_prepare(plan)`` once step 1 has
    committed, ``after_charge(plan, result)`` once the gateway answered, ``during_record(invoice,
    attempt, outcome)`` inside step 3's transaction after its writes, before it commits (the kill
    points of tests/system/test_failure_correctness.py), and ``after_usage(subscription_id, lines)``
    inside step 1's transaction once a close's usage is aggregated, before its invoice is written
    (tests/system/test_usage_processes.py; both close paths). None in production."""

    after_prepare: Callable[[ChargePlan], None] | None = None
    after_charge: Callable[[ChargePlan, gw.ChargeResult], None] | None = None
    during_record: Callable[[Invoice, PaymentAttempt, Outcome], None] | None = None
    after_usage: Callable[[str, list[InvoiceLineItem]], None] | None = None


hooks = Hooks()


def close_subscription_period(
    subscription_id: str,
    *,
    periods_billed: int,
    run: BillingRun | None,
    as_of: datetime | None = None,
    test_clock_id: str | None = None,
    fence: Fence = NO_FENCE,
    manual_retry: bool = False,
) -> Outcome:
    """Close period ``periods_billed`` of a subscription claimed as due; returns its :class:`Outcome`.

    ``as_of`` is the billing time (a test clock's time; None: the DB's now()); ``test_clock_id``
    must be the subscription's clock (None for wall-clock ones). ``manual_retry`` is an operator's
    retry-billing: it ignores and clears the failure state, and a failure starts the ladder
    afresh. Never raises for a failing subscription (the failure is saved on the subscription,
    or for transient database errors only reported); raises :class:`LeaseLost` when the fence
    refuses a write.
    """

    def steps() -> Outcome:
        prepared = _prepare(
            subscription_id,
            periods_billed=periods_billed,
            run=run,
            as_of=as_of,
            test_clock_id=test_clock_id,
            fence=fence,
            manual_retry=manual_retry,
        )
        if isinstance(prepared, Outcome):
            return prepared
        if hooks.after_prepare:
            hooks.after_prepare(prepared)
        result = send(prepared)
        if hooks.after_charge:
            hooks.after_charge(prepared, result)
        return _record(prepared, result, run=run, as_of=as_of, fence=fence, manual_retry=manual_retry)

    with charging():
        return _guarded(
            steps,
            subscription_id,
            periods_billed=periods_billed,
            run=run,
            as_of=as_of,
            test_clock_id=test_clock_id,
            fence=fence,
            manual_retry=manual_retry,
        )


def record_charge(
    plan: ChargePlan,
    result: gw.ChargeResult,
    *,
    periods_billed: int,
    run: BillingRun | None,
    as_of: datetime | None = None,
    test_clock_id: str | None = None,
    fence: Fence = NO_FENCE,
) -> Outcome:
    """Step 3 of a close whose steps 1 and 2 ran elsewhere (the page close, :mod:`billing.services.page`).

    ``plan`` was reserved for period ``periods_billed`` of ``plan.subscription_id``; ``result`` is
    the gateway's answer. Records it as :func:`close_subscription_period` would, with the same
    handling of failures; raises :class:`LeaseLost` when the fence refuses a write.
    """
    return _guarded(
        lambda: _record(plan, result, run=run, as_of=as_of, fence=fence, manual_retry=False),
        plan.subscription_id,
        periods_billed=periods_billed,
        run=run,
        as_of=as_of,
        test_clock_id=test_clock_id,
        fence=fence,
        manual_retry=False,
    )


def _record(
    plan: ChargePlan,
    result: gw.ChargeResult,
    *,
    run: BillingRun | None,
    as_of: datetime | None,
    fence: Fence,
    manual_retry: bool,
) -> Outcome:
    return record_outcome(
        plan,
        result,
        fence=fence,
        save_failure=True,
        fresh_ladder=manual_retry,
        run=run,
        as_of=as_of,
        on_record=hooks.during_record,
    )


def _guarded(
    steps: Callable[[], Outcome],
    subscription_id: str,
    *,
    periods_billed: int,
    run: BillingRun | None,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
    manual_retry: bool,
) -> Outcome:
    """Run a close's ``steps``; a failure becomes its :class:`Outcome` (saved on the subscription where
    docs/reference/billing.md#retry-ladder says so)."""
    try:
        return steps()
    except LeaseLost:
        raise
    except (OperationalError, InterfaceError) as exc:
        # A serialization or deadlock abort, or a lost connection: not saved on the subscription
        # (docs/reference/billing.md#failures-that-are-not-saved); the run's claim mark keeps it
        # from being retried in this run.
        log.warning("close of %s hit a database error (not saved): %s", subscription_id, exc)
        outcome = Outcome(OutcomeKind.FAILED, error=f"database: {exc}")
        _best_effort_attempt_row(
            run, subscription_id, outcome=outcome, test_clock_id=test_clock_id, as_of=as_of, fence=fence
        )
        return outcome
    except Exception as exc:
        log.exception("close of %s failed", subscription_id)
        return _save_exception(
            subscription_id,
            periods_billed=periods_billed,
            run=run,
            error=f"{type(exc).__name__}: {exc}",
            as_of=as_of,
            test_clock_id=test_clock_id,
            fence=fence,
            manual_retry=manual_retry,
        )


def _prepare(
    subscription_id: str,
    *,
    periods_billed: int,
    run: BillingRun | None,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
    manual_retry: bool,
) -> ChargePlan | Outcome:
    """Step 1. Returns the plan to charge, or the outcome when the close ends without a call."""
    with transaction.atomic(), outbox_services.deferred_events():
        fence.check()
        if not lock_due_subscription(
            subscription_id,
            periods_billed=periods_billed,
            test_clock_id=test_clock_id,
            as_of=as_of,
            manual_retry=manual_retry,
        ):
            outcome = Outcome(OutcomeKind.SKIPPED, error="not due for this period any more, or being closed elsewhere")
            write_billing_attempt(run, subscription_id, outcome, now=billing_time(test_clock_id, as_of))
            return outcome
        sub = Subscription.objects.select_related("price").get(pk=subscription_id)
        now = billing_time(test_clock_id, as_of)
        if manual_retry:
            clear_failure_state(sub)
            sub.save(
                update_fields=[
                    "billing_failure_count",
                    "next_billing_attempt_at",
                    "billing_parked_at",
                    "last_billing_error",
                    "updated_at",
                ]
            )
        if sub.cancel_at_period_end:
            bill_final_usage_locked(sub, now, finalize=finalize_or_pend_locked)
            return cancel_at_period_end_locked(sub, run, now)
        price = sub.price
        start, end = period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed)
        usage = None
        if sub.scheduled_items:
            usage = usage_before_schedule_locked(sub)
            if apply_scheduled_locked(sub, now, usage_since=start):
                sub = Subscription.objects.select_related("price").get(pk=subscription_id)

        inserted = materialise_period_invoice(sub, start, end, now, usage=usage)
        lines = None
        if inserted:
            # Ours alone until commit (the insert holds it): no need to read it back.
            invoice, lines = inserted
        else:
            invoice = (
                invoice_qs_select_for_update()
                .filter(subscription_id=sub.id, period_start=start, billing_reason=Invoice.CYCLE)
                .exclude(status=Invoice.VOID)
                .order_by("created_at", "id")
                .first()
            )
            if invoice is None:  # voided meanwhile (the insert saw it): try again next run
                raise RuntimeError(f"invoice for {sub.id} at {start} vanished")

        if invoice.status == Invoice.DRAFT and invoice.hold_reason:
            return _held_locked(sub, invoice, run, now)
        customer = customer_locked(sub.customer_id)
        if invoice.status == Invoice.DRAFT and not finalize_or_pend_locked(
            invoice, now=now, customer=customer, lines=lines
        ):
            if invoice.hold_reason:
                return _held_locked(sub, invoice, run, now)
            return _tax_pending_locked(sub, invoice, run, now)
        if invoice.status in (Invoice.PAID, Invoice.UNCOLLECTIBLE):
            # Settled but not advanced (cannot happen through the close; defensive).
            act_on_paid_locked(sub, invoice, now=now)
            outcome = Outcome(OutcomeKind.BILLED, invoice.id)
            write_billing_attempt(run, sub.id, outcome, now=now)
            return outcome

        if needs_no_charge(invoice):
            settle_without_charge_locked(invoice, customer, now=now)
            act_on_paid_locked(sub, invoice, now=now)
            outcome = Outcome(OutcomeKind.BILLED, invoice.id)
            write_billing_attempt(run, sub.id, outcome, now=now)
            return outcome
        try:
            plan = reserve_attempt_locked(
                invoice,
                customer,
                now=attempt_time(now, test_clock_id=test_clock_id, as_of=as_of),
                first_attempt=bool(inserted),
            )
        except PaymentInFlight as exc:
            outcome = Outcome(OutcomeKind.SKIPPED, invoice.id, error=exc.message)
            write_billing_attempt(run, sub.id, outcome, now=now)
            return outcome
        if plan.known_result is not None:
            # Nothing to send (no payment method): record it in this same transaction.
            return record_outcome(
                plan,
                plan.known_result,
                fence=fence,
                save_failure=True,
                fresh_ladder=manual_retry,
                run=run,
                as_of=as_of,
            )
        return plan


def materialise_period_invoice(
    sub: Subscription,
    start: datetime,
    end: datetime,
    now: datetime,
    *,
    sweep: bool = True,
    previous_billing_cycle_anchor: datetime | None = None,
    usage: list[InvoiceLineItem] | None = None,
    change_key: str | None = None,
) -> tuple[Invoice, list[InvoiceLineItem]] | None:
    """Insert the period's draft invoice and its lines unless one exists; the new invoice and its lines, or None.

    The lines are one per subscription item, then (``sweep``) one per pending invoice item swept in
    (:func:`billing.services.lines.sweep_pending_locked`). An invoice that will never be collected
    (a paused period's) passes ``sweep=False``: its pending items stay pending for the next one.
    ``previous_billing_cycle_anchor``: the first period of a restarted cycle records the anchor it replaced.
    ``usage``: the usage lines when they were taken before a scheduled change replaced the items
    (:func:`billing.services.usage.usage_before_schedule_locked`); None: those of the items now.
    ``change_key``: a restart made under an ``Idempotency-Key`` records it (UNIQUE), so a retry finds its invoice.
    """
    items = items_by_subscription([sub.id])[sub.id]
    if usage is None:
        usage = usage_lines_for([(sub, items)]).get(sub.id, [])
    if hooks.after_usage:
        hooks.after_usage(sub.id, usage)
    invoice, lines = new_draft_invoice(sub, start, end, now, items, usage=usage)
    invoice.previous_billing_cycle_anchor = previous_billing_cycle_anchor
    invoice.change_key = change_key
    row = {f.column: f.get_db_prep_save(getattr(invoice, f.attname), connection) for f in Invoice._meta.concrete_fields}
    if not materialise_invoice(row):
        return None
    invoice._state.adding = False
    invoice._state.db = connection.alias
    InvoiceLineItem.objects.bulk_create(lines)
    swept = sweep_pending_locked(invoice, sub) if sweep else []
    if swept:
        lines += swept
        invoice.hold_reason = hold_reason(lines)
        invoice.save(update_fields=["subtotal", "total", "amount_due", "hold_reason"])
    invoice_event(invoice, "invoice.created", lines=lines, created_at=now)
    return invoice, lines


def new_draft_invoice(
    sub: Subscription,
    start: datetime,
    end: datetime,
    now: datetime,
    items: list[SubscriptionItem],
    *,
    usage: list[InvoiceLineItem] = (),
) -> tuple[Invoice, list[InvoiceLineItem]]:
    """The unsaved draft invoice of ``sub``'s period ``[start, end)`` and its lines, one per item of ``items``
    billed in advance, then ``usage`` (the previous period's usage lines,
    :func:`billing.services.usage.usage_lines_for`).

    ``subtotal = total = amount_due`` = the sum of the lines' amounts, in the subscription's currency (every
    item's; minor units); ``created_at`` = ``now``, the billing time. ``sub.price`` must be loaded. ``hold_reason``
    is set when no PaymentIntent could take it (:func:`billing.services.usage.hold_reason`, decision 0217).
    """
    lines = period_lines(sub, items, start, end)
    for line in usage:
        # Fresh (time-ordered) ids after the period lines': an invoice lists its lines in id order.
        line.id = new_id(PREFIXES["line_item"])
        lines.append(line)
    amount = sum(line.amount for line in lines)
    invoice = Invoice(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        subscription_id=sub.id,
        status=Invoice.DRAFT,
        currency=sub.price.currency,
        period_start=start,
        period_end=end,
        subtotal=amount,
        total=amount,
        amount_due=amount,
        created_at=now,
        hold_reason=hold_reason(lines),
    )
    for line in lines:
        line.invoice_id = invoice.id
    return invoice, lines


def finalize_or_pend_locked(
    invoice: Invoice,
    *,
    now: datetime,
    customer: Customer | None = None,
    lines: list[InvoiceLineItem] | None = None,
) -> bool:
    """Apply its discount, compute tax, apply the customer's balance and finalise a draft (locked) invoice; True
    when finalised.

    The discount first (:func:`billing.services.discounts.apply_discount_locked`, on ``lines`` and
    the invoice). When the tax provider cannot answer, the invoice stays a draft with ``tax_status=pending``
    and False is returned. When its tax carries the total above what one payment can take
    (:data:`hardcount.money.MAX_AMOUNT`), the draft is held for an operator (``hold_reason``, decision 0231)
    and False is returned. Finalising: ``total = subtotal - total_discount + tax``, the balance applied to the
    total (:func:`billing.services.ledger.apply_balance_locked`), the next gapless number,
    status ``open``, ``invoice.finalized``. The amounts are frozen from here on. ``customer``:
    the invoice's customer if the caller has locked it already; ``lines``: its line items if
    known (each saves a query).
    """
    # The customer before the discount: a once discount's row is claimed after it, as every close takes them.
    customer = customer or customer_locked(invoice.customer_id)
    lines = apply_discount_locked(invoice, lines)
    quote = tax_quote(invoice)
    if quote is None:
        invoice.tax_status = Invoice.TAX_PENDING
        invoice.save(update_fields=["tax_status", "discount", "total_discount", "total", "amount_due"])
        return False
    apply_tax(invoice, quote)
    if invoice.hold_reason:  # held before any balance is taken for it
        invoice.amount_due = invoice.total
        invoice.save()
        log.warning("invoice %s held for review: %s after tax, beyond %s", invoice.id, invoice.total, MAX_AMOUNT)
        return False
    apply_balance_locked(customer, invoice, at=now)
    mark_finalized(invoice, number=next_invoice_number(invoice.tenant_id, invoice.livemode), now=now)
    invoice.save()
    invoice_event(invoice, "invoice.finalized", lines=lines, created_at=now)
    return True


def tax_quote(invoice: Invoice) -> TaxQuote | None:
    """The tax provider's quote for a draft invoice's ``subtotal - total_discount`` (tax is on the discounted
    amount, as Stripe's), or None when it cannot answer (logged).

    A negative amount (credits larger than the charges) is not taxed: nothing is charged on it.
    """
    taxable = invoice.subtotal - invoice.total_discount
    if taxable < 0:
        return TaxQuote(rate_bps=0, amount=0, applicable=False)
    try:
        return get_tax_provider().calculate(
            TaxableInvoice(
                tenant_id=invoice.tenant_id,
                livemode=invoice.livemode,
                customer_id=invoice.customer_id,
                currency=invoice.currency,
                subtotal=taxable,
            )
        )
    except TaxUnavailable as exc:
        log.warning("tax unavailable for %s: %s", invoice.id, exc)
    except Exception:
        log.exception("tax provider failed for %s", invoice.id)
    return None


def apply_tax(invoice: Invoice, quote: TaxQuote) -> None:
    """Set the invoice's tax from ``quote`` and ``total = subtotal - total_discount + tax`` (minor units of its
    currency); a total above what one payment can take (:data:`hardcount.money.MAX_AMOUNT`) sets ``hold_reason``,
    and both close paths then leave the draft to an operator (decision 0231)."""
    invoice.tax = quote.amount
    invoice.tax_rate_bps = quote.rate_bps
    invoice.tax_status = Invoice.TAX_CALCULATED if quote.applicable else Invoice.TAX_NOT_APPLICABLE
    invoice.total = invoice.subtotal - invoice.total_discount + invoice.tax
    if invoice.total > MAX_AMOUNT:
        # The request's ceiling checks the subtotal (decision 0198); tax can still carry the total past it. Held as
        # usage beyond a payment is (0217).
        invoice.hold_reason = HOLD_AMOUNT_TOO_LARGE


def mark_finalized(invoice: Invoice, *, number: int, now: datetime) -> None:
    """Finalise a draft in memory: gapless ``number`` (six digits, per tenant and mode), ``open``, ``finalized_at``."""
    invoice.number = f"{number:06d}"
    invoice.status = Invoice.OPEN
    invoice.finalized_at = now


def _advance_without_charge_locked(sub: Subscription, invoice: Invoice, now: datetime) -> None:
    """Advance ``sub`` past ``invoice``'s period, if that is its current one, leaving the draft uncharged."""
    if period_advances(sub, invoice):
        advance_period_locked(sub, invoice)
        clear_failure_state(sub)
        if sub.status == Subscription.TRIALING:
            sub.status = Subscription.ACTIVE
        sub.save()
        subscription_event(sub, "subscription.updated", created_at=now)


def _tax_pending_locked(sub: Subscription, invoice: Invoice, run: BillingRun | None, now: datetime) -> Outcome:
    """The period advances without a charge; the reconciler finalises and charges the draft later."""
    _advance_without_charge_locked(sub, invoice, now)
    outcome = Outcome(OutcomeKind.TAX_PENDING, invoice.id, error="tax provider unavailable: invoice waits as a draft")
    write_billing_attempt(run, sub.id, outcome, now=now)
    return outcome


def _held_locked(sub: Subscription, invoice: Invoice, run: BillingRun | None, now: datetime) -> Outcome:
    """A draft held for an operator (``hold_reason``): never finalised nor charged by the close, which advances the
    period as for a pending tax, so later periods bill as usual; the attempt row names the invoice (decision 0217)."""
    _advance_without_charge_locked(sub, invoice, now)
    outcome = Outcome(
        OutcomeKind.HELD,
        invoice.id,
        error=f"invoice {invoice.id} held for review ({invoice.hold_reason}): beyond what one payment can take",
    )
    write_billing_attempt(run, sub.id, outcome, now=now)
    log.warning("invoice %s of %s held for review: %s", invoice.id, sub.id, invoice.hold_reason)
    return outcome


def cancel_at_period_end_locked(sub: Subscription, run: BillingRun | None, now: datetime) -> Outcome:
    """A subscription set to cancel at period end reaches its period end: cancel instead of billing."""
    sub.status = Subscription.CANCELED
    sub.canceled_at = sub.canceled_at or now
    sub.ended_at = sub.next_billing_at
    sub.next_billing_at = None
    clear_failure_state(sub)
    sub.save()
    subscription_event(sub, "subscription.canceled", created_at=now)
    outcome = Outcome(OutcomeKind.SKIPPED, error="canceled at period end")
    write_billing_attempt(run, sub.id, outcome, now=now)
    return outcome


def _save_exception(
    subscription_id: str,
    *,
    periods_billed: int,
    run: BillingRun | None,
    error: str,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
    manual_retry: bool,
) -> Outcome:
    """An exception in the close is a failure: saved on the subscription if it is still on that period."""
    outcome = Outcome(OutcomeKind.FAILED, error=error)
    try:
        with transaction.atomic():
            fence.check()
            sub = subscription_qs_select_for_update().filter(pk=subscription_id).first()
            now = billing_time(test_clock_id, as_of)
            if (
                sub is not None
                and sub.periods_billed == periods_billed
                and sub.status in Subscription.BILLABLE_STATUSES
            ):
                outcome.failure_number, _ = save_failure_locked(sub, error=error, fresh=manual_retry)
                outcome.saved = not sub.test_clock_id
            write_billing_attempt(run, subscription_id, outcome, now=now)
    except LeaseLost:
        raise
    except Exception:
        log.exception("could not save the failure of %s", subscription_id)
    return outcome


def _best_effort_attempt_row(
    run: BillingRun | None,
    subscription_id: str,
    *,
    outcome: Outcome,
    test_clock_id: str | None,
    as_of: datetime | None,
    fence: Fence,
) -> None:
    try:
        with transaction.atomic():
            fence.check()
            write_billing_attempt(run, subscription_id, outcome, now=billing_time(test_clock_id, as_of))
    except LeaseLost:
        raise
    except Exception:
        log.warning("could not write the billing attempt of %s", subscription_id)
