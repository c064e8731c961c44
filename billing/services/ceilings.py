"""The ceiling on what one line and one invoice may amount to: Stripe's largest PaymentIntent amount.

Stripe refuses a PaymentIntent of more than 99,999,999 minor units (``amount_too_large``,
https://docs.stripe.com/currencies#minimum-and-maximum-charge-amounts), so an invoice whose lines sum
past it could be billed but never charged. A request that would make such a line or invoice is refused
instead, with a 422 ``amount_too_large`` naming its field, and changes nothing: a subscription's
``quantity × unit amount`` (each licensed item's line), and its next invoice's subtotal (those lines plus
the pending invoice items it would sweep), at most :data:`hardcount.money.MAX_AMOUNT`. The checks run
inside the request's transaction after its writes, so a refusal rolls the whole request back.
Metered usage is billed by its own rules (:mod:`billing.services.usage`). docs/decisions/0198.
"""

from __future__ import annotations

from django.db.models import Sum

from billing.models import InvoiceItem, Price, Subscription
from billing.services.items import scheduled_items
from billing.services.lines import pending_for
from hardcount.errors import InvalidRequestError, business_rule_codes
from hardcount.money import MAX_AMOUNT

CODE = "amount_too_large"
BUSINESS_RULE_CODES = business_rule_codes(CODE)


def check_line(price: Price, quantity: int, *, param: str) -> None:
    """Raise :class:`InvalidRequestError` (422 ``amount_too_large`` naming ``param``) when ``quantity × price.amount``
    (minor units; a metered price's is billed by usage and not checked here) exceeds ``MAX_AMOUNT``."""
    if price.is_metered:
        return
    amount = quantity * price.amount
    if amount > MAX_AMOUNT:
        raise InvalidRequestError(
            f"{quantity} × {price.amount} = {amount} {price.currency} would make one invoice line above the "
            f"largest amount a payment can take, {MAX_AMOUNT} minor units.",
            code=CODE,
            param=param,
        )


def next_invoice_subtotal(sub: Subscription) -> int:
    """The subtotal (signed minor units) of ``sub``'s next cycle invoice as its close would bill it now, usage left
    out: each licensed item's ``quantity × amount`` (a scheduled change's items, if any) plus the pending items
    it would sweep."""
    lines = sum(item.quantity * item.price.amount for item in scheduled_items(sub) if not item.price.is_metered)
    pending = InvoiceItem.objects.filter(pending_for(sub, sub.price.currency)).aggregate(total=Sum("amount"))["total"]
    return lines + (pending or 0)


def check_next_invoice(sub: Subscription, *, param: str) -> None:
    """Raise :class:`InvalidRequestError` (422 ``amount_too_large`` naming ``param``) when ``sub``'s next invoice
    (:func:`next_invoice_subtotal`, read in the caller's transaction, its writes included) exceeds ``MAX_AMOUNT``."""
    check_total(next_invoice_subtotal(sub), sub.price.currency, param=param)


def check_total(subtotal: int, currency: str, *, param: str, what: str = "The next invoice") -> None:
    """Raise :class:`InvalidRequestError` (422 ``amount_too_large`` naming ``param``) when ``subtotal`` minor units
    of ``currency`` exceeds ``MAX_AMOUNT``."""
    if subtotal > MAX_AMOUNT:
        raise InvalidRequestError(
            f"{what} would come to {subtotal} {currency}, above the largest amount a payment can take, "
            f"{MAX_AMOUNT} minor units.",
            code=CODE,
            param=param,
        )


def check_customer_pending(customer_id: str, currency: str, subscription: Subscription | None, *, param: str) -> None:
    """After a pending item of ``customer_id`` was written: raise (as :func:`check_total`) when an invoice that would
    sweep it exceeds ``MAX_AMOUNT``: ``subscription``'s next one, or, for an item of no subscription, the next one of
    each of the customer's subscriptions in ``currency`` (any of them may sweep it), or its pending items alone."""
    if subscription is not None:
        subs = [subscription]
    else:
        subs = list(
            Subscription.objects.select_related("price")
            .filter(customer_id=customer_id, price__currency=currency)
            .exclude(status=Subscription.CANCELED)
        )
    for sub in subs:
        check_next_invoice(sub, param=param)
    if not subs:
        pending = InvoiceItem.objects.filter(
            customer_id=customer_id, currency=currency, invoice__isnull=True, subscription__isnull=True
        ).aggregate(total=Sum("amount"))["total"]
        check_total(pending or 0, currency, param=param, what="The customer's pending invoice items")


__all__ = [
    "BUSINESS_RULE_CODES",
    "CODE",
    "check_customer_pending",
    "check_line",
    "check_next_invoice",
    "check_total",
    "next_invoice_subtotal",
]
