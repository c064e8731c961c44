"""Pending invoice items: one-off amounts (or credits) for a customer's next invoice.

As Stripe's invoice items (https://docs.stripe.com/api/invoiceitems/create): an item waits,
``invoice`` null, until the customer's next invoice (that subscription's, when ``subscription``
is given) sweeps it in (:func:`billing.services.lines.sweep_pending_locked`), exactly once.
docs/decisions/0142-pending-invoice-items.md.
"""

from __future__ import annotations

from django.db import transaction

from billing.events import invoice_item_event
from billing.lock_objects import customer_qs_select_for_update
from billing.models import InvoiceItem, Subscription
from billing.services import ceilings
from billing.services.catalog import billing_now
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError, business_rule_codes
from hardcount.money import MAX_AMOUNT, normalize_currency

BUSINESS_RULE_CODES = business_rule_codes("currency_mismatch")


def create_invoice_item(
    *,
    tenant_id: str,
    livemode: bool,
    customer_id: str,
    amount: int,
    currency: str,
    description: str = "",
    subscription_id: str | None = None,
) -> InvoiceItem:
    """Add a pending item of ``amount`` signed minor units of ``currency`` and emit ``invoiceitem.created``.

    Negative ``amount`` is a credit. The customer's billing currency, once set, must be
    ``currency`` (else it is set now, under the customer's row lock); ``subscription`` must be the
    customer's and not canceled. Dated by the billing time (the customer's test clock, if any).
    Raises :class:`InvalidRequestError` (a zero or out-of-range amount, ``currency_mismatch``, ``amount_too_large``
    when an invoice that would sweep it would exceed ``MAX_AMOUNT``: :mod:`billing.services.ceilings`),
    :class:`NotFoundError` (a customer or subscription not the caller's) and
    :class:`StateConflictError` (a canceled subscription).
    """
    if isinstance(amount, bool) or not isinstance(amount, int) or amount == 0 or abs(amount) > MAX_AMOUNT:
        raise InvalidRequestError(
            f"amount must be a non-zero integer from -{MAX_AMOUNT} to {MAX_AMOUNT} (minor units).",
            code="parameter_out_of_range",
            param="amount",
        )
    try:
        currency = normalize_currency(currency)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), code="currency_unsupported", param="currency") from exc
    with transaction.atomic():
        customer = (
            customer_qs_select_for_update().filter(tenant_id=tenant_id, livemode=livemode, pk=customer_id).first()
        )
        if customer is None:
            raise NotFoundError(f"No such customer: '{customer_id}'.", param="customer")
        if customer.currency and customer.currency != currency:
            raise InvalidRequestError(
                f"The customer is billed in {customer.currency}, not {currency}.",
                code="currency_mismatch",
                param="currency",
            )
        subscription = None
        if subscription_id is not None:
            subscription = Subscription.objects.filter(
                tenant_id=tenant_id, livemode=livemode, pk=subscription_id, customer_id=customer.id
            ).first()
            if subscription is None:
                raise NotFoundError(
                    f"No such subscription of this customer: '{subscription_id}'.", param="subscription"
                )
            if subscription.status == Subscription.CANCELED:
                raise StateConflictError(f"Subscription '{subscription.id}' is canceled.", code="subscription_canceled")
        if not customer.currency:
            customer.currency = currency
            customer.save(update_fields=["currency"])
        now = billing_now(customer.test_clock)
        item = InvoiceItem.objects.create(
            tenant_id=tenant_id,
            livemode=livemode,
            customer=customer,
            subscription=subscription,
            amount=amount,
            currency=currency,
            description=description,
            period_start=now,
            period_end=now,
            created_at=now,
        )
        if amount > 0:
            # The invoice that sweeps it must stay chargeable; refused, the item is rolled back with the request.
            ceilings.check_customer_pending(customer.id, currency, subscription, param="amount")
        invoice_item_event(item, "invoiceitem.created", created_at=now)
    return item
