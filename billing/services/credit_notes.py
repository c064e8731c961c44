"""Credit notes against finalised invoices, and the refunds they send to the card.

A credit note (Stripe's, https://docs.stripe.com/invoicing/dashboard/credit-notes) lowers what a
finalised invoice asks for: on an ``open`` invoice it reduces ``amount_due`` (pre-payment); on a
``paid`` one its total splits between ``refund_amount`` (back to the card), ``credit_amount`` (the
customer's credit balance, a ledger entry of reason ``credit_note``) and ``out_of_band_amount``
(returned outside Hardcount). docs/decisions/0156-credit-notes.md.

Every writer locks the invoice (after its subscription: :mod:`billing.lock_objects`) and recomputes
the invoice's non-void credit notes under that lock, so two requests racing for the last of an
invoice's total cannot both pass; the invoice's CHECK ``invoice_credit_notes_within_total`` is the
guard below it. Numbers are gapless per tenant and mode (:func:`billing.queries.next_credit_note_number`,
taken last).

A refund is sent as a payment is (docs/decisions/0157-refunds.md): its row is written with outcome
``unknown`` in the credit note's transaction, under the key ``hc:{credit_note}:refund``; the call is made
after commit (:func:`send_refund`), and its answer recorded in a transaction of its own. A process that
dies in between leaves the row ``unknown``: the billing reconciler (:func:`reconcile_refunds`) re-sends it
under the same key once it is older than the in-flight window, or, once the key may have expired at the
gateway, looks the refund up by its metadata before sending again. Never a second key for one refund.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Q, Sum

from billing import gateway as gw
from billing.events import credit_note_event, invoice_event
from billing.gateway_accounts import gateway_for
from billing.lock_objects import customer_locked, refund_qs_select_for_update, subscription_and_invoice_locked
from billing.models import CreditNote, CreditNoteLineItem, Invoice, InvoiceLineItem, PaymentAttempt, Refund
from billing.queries import next_credit_note_number
from billing.representations import refund_data
from billing.services.ledger import credit_note_entry_locked
from billing.services.payments import (
    PaymentInFlight,
    act_on_paid_locked,
    billing_time,
    in_flight_window,
    invoice_clock_id,
    is_open,
    key_safe_window,
    pending_poll_interval,
    settle_without_charge_locked,
)
from billing.tax import tax_on
from dunning import services as dunning_services
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError, business_rule_codes
from hardcount.fencing import NO_FENCE, Fence
from hardcount.times import database_now

log = logging.getLogger("billing.credit_notes")

# 422s for schema-valid bodies refused by the invoice's state or its other credit notes.
BUSINESS_RULE_CODES = business_rule_codes(
    "credit_note_amount_too_large",
    "credit_note_amounts_mismatch",
    "credit_note_lines_or_amount",
    "credit_note_line_invalid",
    "refund_not_possible",
    "credit_note_not_open_invoice_amounts",
)


class CreditNoteStateError(StateConflictError):
    """409: the invoice's or the credit note's state does not allow the operation."""

    default_code = "credit_note_unexpected_state"


class RefundFailed(StateConflictError):
    """402: the gateway refused the credit note's refund; the credit note was voided (nothing of it stands)."""

    status_code = 402
    default_code = "refund_failed"


@dataclass(frozen=True)
class LineInput:
    """One requested line: credit ``amount`` minor units (before tax) of an invoice line, or ``quantity`` of
    its units (the line's amount per unit, less its discount, times ``quantity``); a line is credited up to what was
    billed for it, its amount less its discount."""

    invoice_line_item: str
    amount: int | None = None
    quantity: int | None = None
    description: str = ""


@dataclass
class Draft:
    """A credit note computed from a request against one invoice, not written (``preview`` renders it)."""

    invoice: Invoice
    type: str
    subtotal: int
    tax: int
    total: int
    pre_payment_amount: int = 0
    refund_amount: int = 0
    credit_amount: int = 0
    out_of_band_amount: int = 0
    reason: str = ""
    memo: str = ""
    lines: list[tuple[InvoiceLineItem, int, int | None, str]] = field(default_factory=list)


def _issued(invoice: Invoice):
    return CreditNote.objects.filter(invoice=invoice, status=CreditNote.ISSUED)


def build_draft(
    invoice: Invoice,
    *,
    lines: list[LineInput] | None = None,
    amount: int | None = None,
    refund_amount: int | None = None,
    credit_amount: int | None = None,
    out_of_band_amount: int | None = None,
    reason: str = "",
    memo: str = "",
) -> Draft:
    """The credit note a request makes on ``invoice`` (its non-void credit notes read now: lock the invoice
    first to rely on the answer). Minor units of the invoice's currency throughout.

    ``lines`` (each line's pre-tax amount, taxed at the invoice's rate, :func:`billing.tax.tax_on`) or
    ``amount`` (the credit note's total, tax included), one of them. Raises :class:`CreditNoteStateError`
    (409: the invoice is not ``open`` or ``paid``) and :class:`InvalidRequestError` (422: both or neither of
    lines and amount; a line not of the invoice or credited past its amount; a total past what the invoice
    has left to credit; on an open invoice, any of refund/credit/out-of-band or a total past ``amount_due``;
    on a paid one, parts that do not add up to the total or a refund past what was charged and not refunded).
    """
    if invoice.status not in (Invoice.OPEN, Invoice.PAID):
        raise CreditNoteStateError(
            f"Invoice {invoice.id} is {invoice.status}; credit notes are issued only on open or paid invoices."
        )
    if (lines is None) == (amount is None) or (lines is not None and not lines):
        raise InvalidRequestError(
            "Give either lines or amount.", code="credit_note_lines_or_amount", param="lines" if lines else "amount"
        )
    chosen: list[tuple[InvoiceLineItem, int, int | None, str]] = []
    if lines is not None:
        subtotal, chosen = _line_amounts(invoice, lines)
        tax = tax_on(subtotal, invoice.tax_rate_bps) if invoice.tax else 0
    else:
        subtotal, tax = amount, 0
    total = subtotal + tax
    if total <= 0:
        raise InvalidRequestError("A credit note's total must be positive.", code="credit_note_line_invalid")
    credited = _issued(invoice).aggregate(total=Sum("total"))["total"] or 0
    if credited + total > invoice.total:
        raise InvalidRequestError(
            f"The credit note's total {total} exceeds what invoice {invoice.id} has left to credit "
            f"({invoice.total - credited} of its total {invoice.total}).",
            code="credit_note_amount_too_large",
            param="amount" if amount is not None else "lines",
        )
    draft = Draft(invoice, "", subtotal, tax, total, reason=reason, memo=memo, lines=chosen)
    parts = (refund_amount, credit_amount, out_of_band_amount)
    if invoice.status == Invoice.OPEN:
        if any(p for p in parts):
            raise InvalidRequestError(
                "An open invoice's credit note reduces its amount_due: refund_amount, credit_amount and "
                "out_of_band_amount apply to paid invoices only.",
                code="credit_note_not_open_invoice_amounts",
                param="refund_amount",
            )
        if total > invoice.amount_due:
            raise InvalidRequestError(
                f"The credit note's total {total} exceeds the invoice's amount_due {invoice.amount_due}.",
                code="credit_note_amount_too_large",
                param="amount" if amount is not None else "lines",
            )
        draft.type, draft.pre_payment_amount = CreditNote.PRE_PAYMENT, total
        return draft
    draft.type = CreditNote.POST_PAYMENT
    if all(p is None for p in parts):
        # Stripe's default for a paid invoice's credit note: the customer's balance.
        credit_amount = total
    draft.refund_amount, draft.credit_amount, draft.out_of_band_amount = (
        p or 0
        for p in (
            refund_amount,
            credit_amount,
            out_of_band_amount,
        )
    )
    if draft.refund_amount + draft.credit_amount + draft.out_of_band_amount != total:
        raise InvalidRequestError(
            f"refund_amount + credit_amount + out_of_band_amount must equal the credit note's total {total}.",
            code="credit_note_amounts_mismatch",
            param="refund_amount",
        )
    if draft.refund_amount:
        refunded = _issued(invoice).aggregate(total=Sum("refund_amount"))["total"] or 0
        if not invoice.payment_intent_id or invoice.amount_paid <= 0:
            raise InvalidRequestError(
                f"Invoice {invoice.id} was not paid by a charge: there is nothing to refund.",
                code="refund_not_possible",
                param="refund_amount",
            )
        if refunded + draft.refund_amount > invoice.amount_paid:
            raise InvalidRequestError(
                f"refund_amount {draft.refund_amount} exceeds what is left to refund of the charge "
                f"({invoice.amount_paid - refunded}).",
                code="credit_note_amount_too_large",
                param="refund_amount",
            )
    return draft


def _line_amounts(invoice: Invoice, lines: list[LineInput]) -> tuple[int, list]:
    by_id = {line.id: line for line in invoice.lines.all()}
    already = dict(
        CreditNoteLineItem.objects.filter(credit_note__invoice=invoice, credit_note__status=CreditNote.ISSUED)
        .values("invoice_line_item_id")
        .annotate(total=Sum("amount"))
        .values_list("invoice_line_item_id", "total")
    )
    chosen, subtotal, seen = [], 0, set()
    for index, wanted in enumerate(lines):
        param = f"lines[{index}]"
        line = by_id.get(wanted.invoice_line_item)
        if line is None:
            raise InvalidRequestError(
                f"No line {wanted.invoice_line_item!r} on invoice {invoice.id}.",
                code="credit_note_line_invalid",
                param=f"{param}.invoice_line_item",
            )
        if line.id in seen or (wanted.amount is None) == (wanted.quantity is None):
            raise InvalidRequestError(
                "Each line names a different invoice line, with either amount or quantity.",
                code="credit_note_line_invalid",
                param=param,
            )
        seen.add(line.id)
        # What was billed for the line: its amount less its share of the invoice's discount.
        paid = line.amount - line.discount_amount
        if wanted.quantity is not None:
            if wanted.quantity > line.quantity or paid % line.quantity:
                raise InvalidRequestError(
                    f"quantity must be at most the line's {line.quantity}, of a line with a whole unit amount.",
                    code="credit_note_line_invalid",
                    param=f"{param}.quantity",
                )
            amount = paid // line.quantity * wanted.quantity
        else:
            amount = wanted.amount
        left = paid - already.get(line.id, 0)
        if amount <= 0 or amount > left:
            raise InvalidRequestError(
                f"Line {line.id} has {max(left, 0)} left to credit; {amount} asked.",
                code="credit_note_line_invalid",
                param=param,
            )
        subtotal += amount
        chosen.append((line, amount, wanted.quantity, wanted.description or line.description))
    return subtotal, chosen


def _locked_invoice(invoice_id: str, *, tenant_id: str, livemode: bool):
    found = (
        Invoice.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=invoice_id).only("subscription_id").first()
    )
    if found is None:
        raise NotFoundError(f"No such invoice: '{invoice_id}'.", param="invoice")
    sub, invoice = subscription_and_invoice_locked(invoice_id, subscription_id=found.subscription_id)
    return sub, invoice


def preview_credit_note(invoice_id: str, *, tenant_id: str, livemode: bool, **request) -> Draft:
    """The credit note :func:`create_credit_note` would issue now (nothing written, nothing locked).

    ``request``: :func:`build_draft`'s keywords. Raises what it raises, and :class:`NotFoundError`.
    """
    invoice = Invoice.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=invoice_id).first()
    if invoice is None:
        raise NotFoundError(f"No such invoice: '{invoice_id}'.", param="invoice")
    return build_draft(invoice, **request)


def create_credit_note(
    invoice_id: str, *, tenant_id: str, livemode: bool, created_by: str = "api", request_key: str = "", **request
) -> CreditNote:
    """Issue a credit note on the caller's invoice and emit ``credit_note.created``; then send its refund.

    ``request``: :func:`build_draft`'s keywords. On an open invoice ``amount_due`` drops by the total (at
    zero the invoice is paid, as Stripe marks it; ``invoice.paid``); on a paid one the ``credit_amount``
    goes to the customer's balance and the ``refund_amount`` to the card, through the tenant's gateway
    account, after commit. ``created_by``: ``api`` or the operator (``admin:<username>``). ``request_key``: the
    API request's ``Idempotency-Key``; when a credit note was already issued under it (the request ran, then
    died before it answered, and its retry runs again) that one is answered, its refund finished under its
    own key if its sender died, and nothing new is issued (docs/decisions/0212). Raises
    :class:`NotFoundError`, :func:`build_draft`'s errors, :class:`PaymentInFlight` (409: a payment of the
    open invoice has no definite outcome yet; its re-send would charge the old amount) and
    :class:`RefundFailed` (402: the gateway refused the refund; the credit note is then void).
    """
    with transaction.atomic(durable=True):
        sub, invoice = _locked_invoice(invoice_id, tenant_id=tenant_id, livemode=livemode)
        earlier = _issued_under(request_key, tenant_id=tenant_id, livemode=livemode)
        if earlier is None:
            note, refund = _issue_locked(
                sub, invoice, build_draft(invoice, **request), created_by=created_by, request_key=request_key
            )
    if earlier is not None:
        note, refund = earlier, Refund.objects.filter(credit_note=earlier).first()
        if refund is not None and _claim_stale(refund.id):
            send_refund(refund.id)
    elif refund is not None:
        send_refund(refund.id)
    if refund is not None:
        refund.refresh_from_db()
        if refund.outcome == Refund.ERROR:
            raise RefundFailed(
                f"The gateway refused the refund of credit note {note.id}; the credit note is void: "
                f"{refund.error_message}",
                param="refund_amount",
            )
    return CreditNote.objects.get(pk=note.pk)


def _issued_under(request_key: str, *, tenant_id: str, livemode: bool) -> CreditNote | None:
    """The credit note an API request with ``request_key`` issued already, if any ("": none)."""
    if not request_key:
        return None
    return CreditNote.objects.filter(tenant_id=tenant_id, livemode=livemode, request_key=request_key).first()


def _issue_locked(
    sub, invoice: Invoice, draft: Draft, *, created_by: str, request_key: str
) -> tuple[CreditNote, Refund | None]:
    """Write the credit note of ``draft`` on ``invoice`` (locked, after ``sub``), its lines, what it moves and its
    refund row (outcome ``unknown``, not sent); emits ``credit_note.created``. Returns the note and the refund."""
    if invoice.status == Invoice.OPEN:
        latest = invoice.payment_attempts.order_by("-attempt_number").first()
        if latest is not None and (latest.outcome == PaymentAttempt.UNKNOWN or is_open(latest)):
            raise PaymentInFlight(
                f"A payment of invoice {invoice.id} has no definite outcome yet; try again once it is resolved."
            )
    now = billing_time(invoice_clock_id(invoice, sub))
    note = CreditNote(
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        invoice=invoice,
        customer_id=invoice.customer_id,
        type=draft.type,
        reason=draft.reason,
        memo=draft.memo,
        currency=invoice.currency,
        subtotal=draft.subtotal,
        tax=draft.tax,
        total=draft.total,
        pre_payment_amount=draft.pre_payment_amount,
        refund_amount=draft.refund_amount,
        credit_amount=draft.credit_amount,
        out_of_band_amount=draft.out_of_band_amount,
        created_by=created_by[:200],
        request_key=request_key,
        created_at=now,
    )
    if draft.credit_amount:
        note.credit_entry = credit_note_entry_locked(
            customer_locked(invoice.customer_id),
            amount=draft.credit_amount,
            invoice=invoice,
            at=now,
            description=f"credit note on invoice {invoice.number or invoice.id}",
        )
    if draft.type == CreditNote.PRE_PAYMENT:
        invoice.pre_payment_credit_notes_amount += draft.total
        invoice.amount_due -= draft.total
        invoice.save(update_fields=["pre_payment_credit_notes_amount", "amount_due"])
        if invoice.amount_due == 0:
            # Nothing left to pay: paid, as Stripe marks it, with the settled-without-charge record a zero
            # amount gets; its dunning ends and its period advances as for any payment.
            settle_without_charge_locked(invoice, customer_locked(invoice.customer_id), now=now)
            if invoice.attempt_count:
                dunning_services.stop_dunning(invoice, ended_at=now, recovered=True)
            act_on_paid_locked(sub, invoice, now=now)
    else:
        invoice.post_payment_credit_notes_amount += draft.total
        invoice.save(update_fields=["post_payment_credit_notes_amount"])
    # The counter last (billing.lock_objects): after the customer's row the ledger and a settle took.
    note.number = f"CN-{next_credit_note_number(invoice.tenant_id, invoice.livemode):06d}"
    note.save(force_insert=True)
    CreditNoteLineItem.objects.bulk_create(
        CreditNoteLineItem(
            credit_note=note, invoice_line_item=line, amount=amount, quantity=quantity, description=text[:500]
        )
        for line, amount, quantity, text in draft.lines
    )
    refund = None
    if draft.refund_amount:
        refund = Refund.objects.create(
            tenant_id=invoice.tenant_id,
            livemode=invoice.livemode,
            credit_note=note,
            invoice=invoice,
            amount=draft.refund_amount,
            currency=invoice.currency,
            payment_intent_id=invoice.payment_intent_id,
            idempotency_key=gw.refund_key(note.id),
            started_at=database_now(),
        )
    credit_note_event(note, "credit_note.created", created_at=now)
    return note, refund


def void_credit_note(credit_note_id: str, *, tenant_id: str, livemode: bool) -> CreditNote:
    """Void an issued credit note and emit ``credit_note.voided``: its effect is reversed where it can be.

    A pre-payment credit note's amount goes back on its still-open invoice's ``amount_due``; a credit to
    the balance is taken back (the balance must still hold it). A credit note with a refund cannot be
    voided (a refund sent cannot be unsent; Stripe refuses the same). Raises :class:`NotFoundError`,
    :class:`CreditNoteStateError` (409: void already; with a refund; the invoice no longer open; the
    credit already used) and :class:`PaymentInFlight` (409: a payment of the invoice is in flight).
    """
    found = CreditNote.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=credit_note_id).first()
    if found is None:
        raise NotFoundError(f"No such credit note: '{credit_note_id}'.", param="id")
    with transaction.atomic(durable=True):
        sub, invoice = _locked_invoice(found.invoice_id, tenant_id=tenant_id, livemode=livemode)
        note = CreditNote.objects.select_for_update(of=("self",)).get(pk=found.pk)
        if note.status != CreditNote.ISSUED:
            raise CreditNoteStateError(f"Credit note {note.id} is void already.")
        if note.refund_amount:
            raise CreditNoteStateError(
                f"Credit note {note.id} refunded {note.refund_amount} to the card; a refund cannot be unsent, so "
                "it cannot be voided.",
                code="credit_note_has_refund",
            )
        if note.pre_payment_amount:
            if invoice.status != Invoice.OPEN:
                raise CreditNoteStateError(
                    f"Invoice {invoice.id} is {invoice.status}: the amount this credit note took off it cannot "
                    "go back on it.",
                )
            latest = invoice.payment_attempts.order_by("-attempt_number").first()
            if latest is not None and (latest.outcome == PaymentAttempt.UNKNOWN or is_open(latest)):
                raise PaymentInFlight(f"A payment of invoice {invoice.id} has no definite outcome yet.")
        customer = customer_locked(invoice.customer_id) if note.credit_amount else None
        if customer is not None and customer.credit_balance < note.credit_amount:
            raise CreditNoteStateError(
                f"The customer's balance ({customer.credit_balance}) no longer holds the {note.credit_amount} "
                "this credit note credited: it was applied to an invoice.",
                code="credit_already_applied",
            )
        now = billing_time(invoice_clock_id(invoice, sub))
        _reverse_locked(note, invoice, customer, now=now)
    return note


def _reverse_locked(note: CreditNote, invoice: Invoice, customer, *, now) -> None:
    """Void ``note`` and undo its amounts on the locked ``invoice`` (and the locked ``customer``'s balance)."""
    if note.pre_payment_amount:
        invoice.pre_payment_credit_notes_amount -= note.total
        invoice.amount_due += note.pre_payment_amount
        invoice.save(update_fields=["pre_payment_credit_notes_amount", "amount_due"])
    else:
        invoice.post_payment_credit_notes_amount -= note.total
        invoice.save(update_fields=["post_payment_credit_notes_amount"])
    if note.credit_amount:
        credit_note_entry_locked(
            customer,
            amount=-note.credit_amount,
            invoice=invoice,
            at=now,
            description=f"credit note {note.number} voided",
        )
    note.status, note.voided_at = CreditNote.VOID, now
    note.save(update_fields=["status", "voided_at"])
    credit_note_event(note, "credit_note.voided", created_at=now)


# --- refunds --------------------------------------------------------------------------------------------------------


def _refund_request(refund: Refund) -> gw.RefundRequest:
    return gw.RefundRequest(
        refund_id=refund.id,
        credit_note_id=refund.credit_note_id,
        invoice_id=refund.invoice_id,
        payment_intent_id=refund.payment_intent_id,
        amount=refund.amount,
        idempotency_key=refund.idempotency_key,
        tenant_id=refund.tenant_id,
        livemode=refund.livemode,
    )


def send_refund(refund_id: str, *, look_up_only: bool = False) -> Refund:
    """Send (or re-send, or look up) one refund whose outcome is ``unknown`` or ``pending``; record the answer.

    No transaction may be open. Under its own key while young; once the key may have expired
    (:func:`billing.services.payments.key_safe_window` after ``first_sent_at``), and always for a
    ``pending`` refund or ``look_up_only``, the gateway's refunds of the PaymentIntent are searched by
    metadata first, and it is sent (under the same key) only when none is found. Returns the refund.
    """
    refund = Refund.objects.get(pk=refund_id)
    if refund.outcome not in (Refund.UNKNOWN, Refund.PENDING):
        return refund
    req = _refund_request(refund)
    key_old = refund.first_sent_at <= database_now() - key_safe_window()
    look_up = look_up_only or key_old or refund.outcome == Refund.PENDING
    try:
        gateway = gateway_for(refund.tenant_id, refund.livemode)
        result = gateway.find_refund(req) if look_up else None
        if result is None and refund.outcome == Refund.UNKNOWN and not look_up_only:
            result = gateway.refund(req)
    except Exception as exc:  # the gateway or a library surprise: the refund stays open for the reconciler
        log.warning("refund %s: %s: %s", refund_id, type(exc).__name__, exc)
        result = gw.RefundResult(gw.UNKNOWN, error_message=f"{type(exc).__name__}: {exc}")
    if result is None:
        result = gw.RefundResult(gw.UNKNOWN, error_message="not found at the gateway")
    return record_refund(refund_id, result)


def record_refund(refund_id: str, result: gw.RefundResult) -> Refund:
    """Record what the gateway said of a refund, once, under its invoice's and its own row locks.

    A definite outcome (``succeeded``, ``failed``) is never replaced by ``pending`` or ``unknown``; the
    first ``succeeded`` emits ``invoice.refunded``. A refusal (``error``, a final 4xx) voids the credit
    note, its amounts reversed, as if Stripe had refused the credit note itself.
    """
    invoice_id = Refund.objects.values_list("invoice_id", flat=True).get(pk=refund_id)
    subscription_id = Invoice.objects.values_list("subscription_id", flat=True).get(pk=invoice_id)
    with transaction.atomic():
        sub, invoice = subscription_and_invoice_locked(invoice_id, subscription_id=subscription_id)
        refund = refund_qs_select_for_update().get(pk=refund_id)
        definite = (Refund.SUCCEEDED, Refund.FAILED, Refund.ERROR)
        now = billing_time(invoice_clock_id(invoice, sub))
        if result.gateway_refund_id and not refund.gateway_refund_id:
            refund.gateway_refund_id = result.gateway_refund_id
        refund.error_message = result.error_message[:2000]
        refund.http_status = result.http_status
        if refund.outcome in definite and result.outcome not in (gw.SUCCEEDED, gw.FAILED):
            refund.save(update_fields=["gateway_refund_id"])
            return refund
        previous = refund.outcome
        refund.outcome = result.outcome
        if result.status:
            refund.status = result.status
        if result.outcome != gw.UNKNOWN:
            refund.completed_at = database_now()
        refund.save()
        if refund.outcome == Refund.SUCCEEDED and previous in (Refund.UNKNOWN, Refund.PENDING):
            invoice_event(
                invoice,
                "invoice.refunded",
                created_at=now,
                extra={"refund": refund_data(refund), "credit_note": refund.credit_note_id},
            )
        elif refund.outcome == Refund.ERROR and previous != Refund.ERROR:
            note = CreditNote.objects.select_for_update(of=("self",)).get(pk=refund.credit_note_id)
            if note.status == CreditNote.ISSUED:
                customer = customer_locked(invoice.customer_id) if note.credit_amount else None
                _reverse_locked(note, invoice, customer, now=now)
        return refund


def _stale() -> Q:
    """Refunds whose sender is presumed dead: ``unknown`` past the in-flight window, ``pending`` past the poll."""
    now = database_now()
    return Q(outcome=Refund.UNKNOWN, started_at__lt=now - in_flight_window()) | Q(
        outcome=Refund.PENDING, started_at__lt=now - pending_poll_interval()
    )


def _claim_stale(refund_id: str) -> bool:
    """Take a stale refund to (re-)send it; False when it is not stale, or another caller took it first.

    Taken by moving ``started_at``: a second caller's UPDATE waits for the first's row lock, then re-reads the
    row, no longer stale, and takes nothing; so one refund is sent by one of them at a time."""
    return bool(Refund.objects.filter(_stale(), pk=refund_id).update(started_at=database_now()))


def reconcile_refunds(*, livemode: bool, fence: Fence = NO_FENCE, limit: int = 200) -> dict[str, int]:
    """The billing reconciler's refund pass for one mode: refunds left ``unknown`` longer than the in-flight
    window (their sender died, or timed out) are re-sent under their key (or looked up first, once the key
    may have expired); ``pending`` ones are looked up once per pending poll interval.

    Returns ``{"refunds_resolved": n, "refunds_unresolved": m}``.
    """
    counts = {"refunds_resolved": 0, "refunds_unresolved": 0}
    for refund_id in (
        Refund.objects.filter(_stale(), livemode=livemode).order_by("started_at").values_list("id", flat=True)[:limit]
    ):
        if not fence.alive():
            break
        if not _claim_stale(refund_id):
            continue
        refund = send_refund(refund_id)
        counts["refunds_resolved" if refund.outcome != Refund.UNKNOWN else "refunds_unresolved"] += 1
    return counts


def refund_from_gateway(refund_obj: dict, *, tenant_id: str | None, livemode: bool) -> Refund | None:
    """Record a gateway refund object (an inbound ``refund.*`` event's, re-checked by the caller) on the Hardcount
    refund it belongs to (by id, else by ``hardcount_refund`` metadata), within ``tenant_id`` (None: any tenant
    the platform account serves). Returns the refund, or None when it is none of ours."""
    metadata = refund_obj.get("metadata") if isinstance(refund_obj.get("metadata"), dict) else {}
    refunds = Refund.objects.filter(livemode=livemode)
    if tenant_id is not None:
        refunds = refunds.filter(tenant_id=tenant_id)
    gateway_id = refund_obj.get("id") if isinstance(refund_obj.get("id"), str) else ""
    refund = refunds.filter(gateway_refund_id=gateway_id).first() if gateway_id else None
    if refund is None and isinstance(metadata.get(gw.REFUND_METADATA_KEY), str):
        refund = refunds.filter(pk=metadata[gw.REFUND_METADATA_KEY], gateway_refund_id__in=["", gateway_id]).first()
    if refund is None:
        return None
    return record_refund(refund.id, gw.classify_refund(refund_obj))


def refunds_to_check(invoice: Invoice) -> list[str]:
    """Ids of the invoice's refunds without a definite outcome (a ``charge.refunded`` makes them worth a look)."""
    return list(
        Refund.objects.filter(invoice=invoice, outcome__in=[Refund.UNKNOWN, Refund.PENDING]).values_list(
            "id", flat=True
        )
    )


__all__ = [
    "CreditNoteStateError",
    "Draft",
    "LineInput",
    "RefundFailed",
    "build_draft",
    "create_credit_note",
    "preview_credit_note",
    "reconcile_refunds",
    "record_refund",
    "refund_from_gateway",
    "send_refund",
    "void_credit_note",
]
