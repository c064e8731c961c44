"""The customer credit ledger: append-only entries, each written under the customer's row lock.

Signs (decision 0051): a positive balance is credit the tenant owes the customer, applied to the
next invoices; a negative balance is an amount the customer owes (a below-minimum invoice carried
forward, as Stripe does), added to the next invoice. Every entry stores ``balance_after``, and
every write locks the customer row first (``SELECT … FOR UPDATE``), so ``balance_after`` is the
running sum by construction. Entries are never updated or deleted.

The helpers suffixed ``_locked`` must run inside the caller's transaction, after the caller has
locked the customer with :func:`billing.lock_objects.customer_locked` (in the order of
:mod:`billing.lock_objects`: after the subscription, invoice and payment attempt it needs).
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from billing.events import ledger_entry_event
from billing.lock_objects import customer_qs_select_for_update
from billing.models import Customer, Invoice, LedgerEntry
from billing.services.catalog import billing_now
from hardcount.errors import InvalidRequestError, NotFoundError, business_rule_codes
from hardcount.money import MAX_AMOUNT, normalize_currency

# A 422 for a schema-valid body that depends on the customer's state: currency is optional only once
# the balance has one (the OpenAPI document says so in prose).
BUSINESS_RULE_CODES = business_rule_codes("currency_required")


def _append_locked(
    customer: Customer,
    *,
    amount: int,
    currency: str,
    reason: str,
    at: datetime,
    invoice: Invoice | None = None,
    description: str = "",
) -> LedgerEntry:
    """Append one entry of signed ``amount`` minor units and move the balance (customer row locked)."""
    if customer.currency and customer.currency != currency:
        raise InvalidRequestError(
            f"The customer's balance is in {customer.currency}, not {currency}.",
            code="currency_mismatch",
            param="currency",
        )
    customer.credit_balance += amount
    fields = ["credit_balance"]
    if not customer.currency:
        customer.currency = currency
        fields.append("currency")
    customer.save(update_fields=fields)
    return LedgerEntry.objects.create(
        tenant_id=customer.tenant_id,
        livemode=customer.livemode,
        customer=customer,
        amount=amount,
        currency=currency,
        balance_after=customer.credit_balance,
        reason=reason,
        invoice=invoice,
        description=description,
        created_at=at,
    )


def apply_balance_locked(customer: Customer, invoice: Invoice, *, at: datetime) -> int:
    """Apply the customer's balance to ``invoice`` (its ``total`` known, not yet saved) and return it.

    Credit (positive balance) covers up to the total; a debit (negative balance) is added to
    the invoice whole. Sets ``invoice.credit_applied`` and ``invoice.amount_due``; writes an
    ``applied_to_invoice`` entry of ``-credit_applied``. A balance in another currency is left
    alone (amount_due = total).
    """
    applied = set_balance_applied(customer, invoice)
    record_balance_applied_locked(customer, invoice, at=at)
    return applied


def set_balance_applied(customer: Customer, invoice: Invoice) -> int:
    """The first half of :func:`apply_balance_locked`, in memory only: ``credit_applied`` and ``amount_due``.

    Returns the amount applied (signed minor units of the invoice's currency). Follow it with
    :func:`record_balance_applied_locked` in the same transaction, or discard the invoice.
    """
    applied = 0
    if invoice.total < 0:
        # Credits (a downgrade's prorations) larger than the charges: nothing is due and the rest goes to the
        # customer's balance, as Stripe does (https://docs.stripe.com/billing/customer/balance).
        applied = invoice.total
    elif customer.credit_balance and customer.currency == invoice.currency:
        applied = (
            min(customer.credit_balance, invoice.total) if customer.credit_balance > 0 else customer.credit_balance
        )
    invoice.credit_applied = applied
    invoice.amount_due = invoice.total - applied
    return applied


def record_balance_applied_locked(customer: Customer, invoice: Invoice, *, at: datetime) -> LedgerEntry | None:
    """The ledger side of :func:`set_balance_applied`: the ``applied_to_invoice`` entry of ``-credit_applied``
    (none when nothing was applied), moving the customer's balance (customer row locked)."""
    applied = invoice.credit_applied
    if not applied:
        return None
    return _append_locked(
        customer,
        amount=-applied,
        currency=invoice.currency,
        reason=LedgerEntry.APPLIED,
        at=at,
        invoice=invoice,
        description=(
            "credit applied to "
            if applied > 0
            else "negative total credited to the balance from "
            if invoice.total < 0
            else "balance owed added to "
        )
        + invoice.id,
    )


def carry_debit_locked(customer: Customer, invoice: Invoice, *, at: datetime) -> LedgerEntry:
    """Carry ``invoice.amount_due`` (below the minimum charge) to the balance as a debit."""
    return _append_locked(
        customer,
        amount=-invoice.amount_due,
        currency=invoice.currency,
        reason=LedgerEntry.CARRIED_DEBIT,
        at=at,
        invoice=invoice,
        description=f"below the minimum charge: carried from {invoice.id} to the next invoice",
    )


def return_credit_locked(customer: Customer, invoice: Invoice, *, at: datetime) -> LedgerEntry | None:
    """Undo the balance applied to a voided invoice: ``+credit_applied`` back to the balance."""
    if not invoice.credit_applied:
        return None
    return _append_locked(
        customer,
        amount=invoice.credit_applied,
        currency=invoice.currency,
        reason=LedgerEntry.ADJUSTMENT,
        at=at,
        invoice=invoice,
        description=f"balance returned from voided invoice {invoice.id}",
    )


def credit_proration_locked(customer: Customer, *, amount: int, currency: str, at: datetime, description: str):
    """Credit ``amount`` (> 0) minor units of unused subscription time to the balance (customer row locked),
    reason ``proration_credit``."""
    return _append_locked(
        customer, amount=amount, currency=currency, reason=LedgerEntry.PRORATION_CREDIT, at=at, description=description
    )


def credit_note_entry_locked(
    customer: Customer, *, amount: int, invoice: Invoice, at: datetime, description: str
) -> LedgerEntry:
    """A credit note's effect on the balance (customer row locked): ``+credit_amount`` when issued, its
    negative when voided; reason ``credit_note``, linked to the credit note's invoice, in its currency."""
    return _append_locked(
        customer,
        amount=amount,
        currency=invoice.currency,
        reason=LedgerEntry.CREDIT_NOTE,
        at=at,
        invoice=invoice,
        description=description,
    )


def grant_credit(
    customer_id: str,
    *,
    tenant_id: str,
    livemode: bool,
    amount: int,
    currency: str | None = None,
    description: str = "",
) -> LedgerEntry:
    """Change a customer's balance by ``amount`` minor units and emit ``customer.credit_granted``.

    Positive ``amount`` grants credit (reason ``grant``), negative records a debit (reason
    ``adjustment``). ``currency`` defaults to the customer's; the balance has one currency
    (decision 0051). Credit granted after an invoice was finalised goes to the next invoice:
    finalised invoices are frozen (docs/reference/domain.md#credit-ledger). Raises :class:`NotFoundError` for an unknown
    customer (or one of another tenant or mode) and :class:`InvalidRequestError` for a zero or
    out-of-range amount, an unknown currency, or a currency other than the balance's.
    """
    if isinstance(amount, bool) or not isinstance(amount, int) or amount == 0 or abs(amount) > MAX_AMOUNT:
        raise InvalidRequestError(
            f"amount must be a non-zero integer from -{MAX_AMOUNT} to {MAX_AMOUNT} (minor units).",
            code="parameter_out_of_range",
            param="amount",
        )
    with transaction.atomic():
        customer = (
            customer_qs_select_for_update().filter(tenant_id=tenant_id, livemode=livemode, pk=customer_id).first()
        )
        if customer is None:
            raise NotFoundError(f"No such customer: '{customer_id}'.", param="customer")
        if currency is None:
            if not customer.currency:
                raise InvalidRequestError(
                    "The customer has no balance currency yet: give currency.",
                    code="currency_required",
                    param="currency",
                )
            currency = customer.currency
        try:
            currency = normalize_currency(currency)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), code="currency_unsupported", param="currency") from exc
        at = billing_now(customer.test_clock)
        entry = _append_locked(
            customer,
            amount=amount,
            currency=currency,
            reason=LedgerEntry.GRANT if amount > 0 else LedgerEntry.ADJUSTMENT,
            at=at,
            description=description,
        )
        ledger_entry_event(entry, "customer.credit_granted", created_at=at)
    return entry
