"""Coupons, the discounts that apply them, and the discount amounts of an invoice's lines.

Shapes follow Stripe's Coupon and Discount objects (https://docs.stripe.com/api/coupons,
https://docs.stripe.com/api/discounts). The rules this module owns, each written once:

- **Which discount an invoice takes** (:func:`pick`): the subscription's discount beats the
  customer's (Stripe's rule). A discount covers the invoices whose period starts in
  ``[start, end)`` (deleting it brings ``end`` forward); ``repeating`` ends ``duration_in_months`` calendar
  months after its start, so a monthly subscription gets exactly that many cycle invoices and a
  yearly one gets the invoices that start in that time (docs/decisions/0154). ``once`` covers the
  first invoice that takes it.
- **How much each line gets** (:func:`line_discounts`): ``percent_off`` on every line, rounded
  half up once per line (a credit line's discount is negative: the credit shrinks as the charge
  did); ``amount_off`` spread over the positive lines in proportion to their amounts (largest
  remainder, ties by line order), at most the invoice's subtotal, so no line and no invoice goes
  below zero (docs/decisions/0153).
- **Where it sits in the totals**: before tax and before the customer's balance:
  ``total = subtotal - total_discount + tax``; tax is computed on ``subtotal - total_discount``.

The per-close path applies it when a draft is finalised (:func:`apply_discount_locked`, from
:func:`billing.services.close.finalize_or_pend_locked`), the page close in memory for a page
(:func:`discounts_for_page`, :func:`apply_discount`), and the upcoming-invoice preview without
writing anything.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from dateutil.relativedelta import relativedelta
from django.db import transaction
from django.db.models import F, Q

from billing.events import coupon_event, discount_event
from billing.lock_objects import (
    callers_customer_locked,
    callers_subscription_locked,
    customer_qs_select_for_update,
)
from billing.models import Coupon, Customer, Discount, Invoice, InvoiceLineItem, Subscription, TestClock
from hardcount.errors import InvalidRequestError, NotFoundError, business_rule_codes
from hardcount.money import CURRENCY_EXPONENTS, MAX_AMOUNT
from hardcount.times import database_now

BUSINESS_RULE_CODES = business_rule_codes(
    "coupon_terms",
    "coupon_expired",
    "coupon_exhausted",
    "coupon_currency_mismatch",
    "redeem_by_in_past",
    "coupon_or_discounts",
)

# A create or update body that says nothing about discounts (``coupon=KEEP``): the discount stays.
KEEP = object()

# Longest repeating coupon, as Stripe's (https://docs.stripe.com/api/coupons/create): 10 years.
MAX_DURATION_IN_MONTHS = 120


def _now(clock: TestClock | None) -> datetime:
    return clock.frozen_time if clock is not None else database_now()


# ---------------------------------------------------------------------------------------
# Coupons


def create_coupon(
    *,
    tenant_id: str,
    livemode: bool,
    duration: str,
    percent_off: Decimal | None = None,
    amount_off: int | None = None,
    currency: str | None = None,
    duration_in_months: int | None = None,
    max_redemptions: int | None = None,
    redeem_by: datetime | None = None,
    name: str = "",
    metadata: dict[str, str] | None = None,
) -> Coupon:
    """Create a coupon and emit ``coupon.created``.

    Exactly one of ``percent_off`` (0 < p ≤ 100, at most two decimals) and ``amount_off`` (1 ..
    ``MAX_AMOUNT`` minor units of ``currency``, which it requires); ``duration_in_months`` (1..120)
    with ``repeating`` only; ``redeem_by`` in the future (the database's now()). Raises
    :class:`InvalidRequestError` (``coupon_terms`` naming the field, ``redeem_by_in_past``).
    """
    if (percent_off is None) == (amount_off is None):
        raise InvalidRequestError("Give percent_off or amount_off, not both.", code="coupon_terms", param="percent_off")
    if percent_off is not None:
        if not (Decimal(0) < percent_off <= Decimal(100)) or percent_off != percent_off.quantize(Decimal("0.01")):
            raise InvalidRequestError(
                "percent_off must be above 0 and at most 100, with at most two decimals.",
                code="coupon_terms",
                param="percent_off",
            )
        if currency:
            raise InvalidRequestError("currency goes with amount_off only.", code="coupon_terms", param="currency")
    else:
        if not 1 <= amount_off <= MAX_AMOUNT:
            raise InvalidRequestError(
                f"amount_off must be from 1 to {MAX_AMOUNT} (minor units).", code="coupon_terms", param="amount_off"
            )
        if not currency or currency not in CURRENCY_EXPONENTS:
            raise InvalidRequestError("amount_off needs the currency it is in.", code="coupon_terms", param="currency")
    if (duration == Coupon.Duration.REPEATING) != (duration_in_months is not None):
        raise InvalidRequestError(
            "duration_in_months is required with duration=repeating, and only with it.",
            code="coupon_terms",
            param="duration_in_months",
        )
    with transaction.atomic():
        now = database_now()
        if redeem_by is not None and redeem_by <= now:
            raise InvalidRequestError("redeem_by must be in the future.", code="redeem_by_in_past", param="redeem_by")
        coupon = Coupon.objects.create(
            tenant_id=tenant_id,
            livemode=livemode,
            name=name,
            percent_off=percent_off,
            amount_off=amount_off,
            currency=currency or "",
            duration=duration,
            duration_in_months=duration_in_months,
            max_redemptions=max_redemptions,
            redeem_by=redeem_by,
            metadata=metadata or {},
        )
        coupon_event(coupon, "coupon.created")
    return coupon


def delete_coupon(*, tenant_id: str, livemode: bool, coupon_id: str) -> Coupon:
    """Delete a coupon (Stripe's rule: it can no longer be redeemed; discounts made of it keep applying) and
    emit ``coupon.deleted``. Raises :class:`NotFoundError` for an unknown or deleted coupon."""
    with transaction.atomic():
        coupon = (
            Coupon.objects.select_for_update()
            .filter(tenant_id=tenant_id, livemode=livemode, pk=coupon_id, deleted_at__isnull=True)
            .first()
        )
        if coupon is None:
            raise NotFoundError(f"No such coupon: '{coupon_id}'.", param="id")
        coupon.deleted_at = database_now()
        coupon.save(update_fields=["deleted_at"])
        coupon_event(coupon, "coupon.deleted")
    return coupon


def redeem_locked(*, tenant_id: str, livemode: bool, coupon_id: str, currency: str, at: datetime, param: str) -> Coupon:
    """Count one redemption of a coupon (inside the caller's transaction) and return it.

    One conditional ``UPDATE … SET times_redeemed = times_redeemed + 1 WHERE`` still valid at ``at``:
    two racing redemptions of a coupon's last one serialise on its row, and the second re-reads
    the count and matches nothing (the CHECK ``coupon_redemptions_within_max`` is the last guard).
    The row stays locked until the caller commits; take it after the customer and subscription.
    ``currency`` (the object's, "" when not known yet) must equal an ``amount_off`` coupon's.
    Raises :class:`NotFoundError` and :class:`InvalidRequestError` (``coupon_expired``,
    ``coupon_exhausted``, ``coupon_currency_mismatch``), naming ``param``.
    """
    scoped = Coupon.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=coupon_id, deleted_at__isnull=True)
    updated = scoped.filter(
        Q(max_redemptions__isnull=True) | Q(times_redeemed__lt=F("max_redemptions")),
        Q(redeem_by__isnull=True) | Q(redeem_by__gt=at),
    ).update(times_redeemed=F("times_redeemed") + 1)
    coupon = scoped.first()
    if coupon is None:
        raise NotFoundError(f"No such coupon: '{coupon_id}'.", param=param)
    if not updated:
        if coupon.redeem_by is not None and coupon.redeem_by <= at:
            raise InvalidRequestError(
                f"Coupon '{coupon_id}' could be redeemed until {coupon.redeem_by:%Y-%m-%d %H:%M} UTC.",
                code="coupon_expired",
                param=param,
            )
        raise InvalidRequestError(
            f"Coupon '{coupon_id}' has been redeemed {coupon.max_redemptions} times, its maximum.",
            code="coupon_exhausted",
            param=param,
        )
    if coupon.amount_off is not None and currency and coupon.currency != currency:
        raise InvalidRequestError(
            f"Coupon '{coupon_id}' takes {coupon.currency} off; this is billed in {currency}.",
            code="coupon_currency_mismatch",
            param=param,
        )
    return coupon


# ---------------------------------------------------------------------------------------
# Discounts on customers and subscriptions


def _start(next_billing_ats: list[datetime | None], at: datetime) -> datetime:
    """A discount applied at ``at`` starts then, or at the start of the earliest period that is due but not yet
    invoiced (``next_billing_at`` before ``at``: the drain has not reached it), so "the next invoice" takes it, as
    Stripe's next invoice would, and a repeating discount's months are counted from that period's start
    (docs/decisions/0154)."""
    due = [when for when in next_billing_ats if when is not None and when < at]
    return min(due, default=at)


def _new_discount_locked(
    coupon: Coupon, customer: Customer, subscription: Subscription | None, start: datetime
) -> Discount:
    end = None
    if coupon.duration == Coupon.Duration.REPEATING:
        end = start + relativedelta(months=coupon.duration_in_months)
    return Discount.objects.create(
        tenant_id=customer.tenant_id,
        livemode=customer.livemode,
        coupon=coupon,
        customer=customer,
        subscription=subscription,
        start=start,
        end=end,
    )


def _end_locked(discount_id: str | None, *, at: datetime) -> Discount | None:
    """Delete the discount ``discount_id`` (its owner locked) at ``at``; emits ``customer.discount.deleted``.

    It covers no invoice not made yet: its ``end`` comes forward to :func:`_start` of its owner's due periods
    (an invoice due before ``at`` but not yet made goes without it, as the next Stripe invoice would).
    """
    if discount_id is None:
        return None
    discount = Discount.objects.select_related("coupon").get(pk=discount_id)
    stop = _start(_due(discount.customer_id, discount.subscription_id, at), at)
    discount.deleted_at = at
    discount.end = stop if discount.end is None else min(discount.end, stop)
    discount.save(update_fields=["deleted_at", "end"])
    discount_event(discount, "customer.discount.deleted", created_at=at)
    return discount


def _due(customer_id: str, subscription_id: str | None, at: datetime) -> list[datetime]:
    """The ``next_billing_at`` before ``at`` of the subscription (or, for None, every billable subscription of the
    customer): the starts of periods due but not yet invoiced."""
    subs = Subscription.objects.filter(
        customer_id=customer_id, status__in=Subscription.BILLABLE_STATUSES, next_billing_at__lt=at
    )
    if subscription_id is not None:
        subs = subs.filter(pk=subscription_id)
    return list(subs.values_list("next_billing_at", flat=True))


def apply_to_customer_locked(customer: Customer, coupon_id: str, *, at: datetime, param: str = "coupon") -> Discount:
    """Redeem ``coupon_id`` as the customer's discount from ``at`` (customer row locked), replacing the current one.

    Emits ``customer.discount.deleted`` for a replaced discount and ``customer.discount.created``.
    Raises as :func:`redeem_locked`.
    """
    coupon = redeem_locked(
        tenant_id=customer.tenant_id,
        livemode=customer.livemode,
        coupon_id=coupon_id,
        currency=customer.currency,
        at=at,
        param=param,
    )
    _end_locked(customer.discount_id, at=at)
    discount = _new_discount_locked(coupon, customer, None, _start(_due(customer.id, None, at), at))
    customer.discount = discount
    customer.save(update_fields=["discount"])
    discount_event(discount, "customer.discount.created", created_at=at)
    return discount


def apply_to_subscription_locked(
    subscription: Subscription, customer: Customer, coupon_id: str, *, at: datetime, param: str = "coupon"
) -> Discount:
    """Redeem ``coupon_id`` as the subscription's discount (subscription row locked), replacing the current one.

    The discount starts as :func:`_start` says. Events and errors as :func:`apply_to_customer_locked`.
    """
    coupon = redeem_locked(
        tenant_id=subscription.tenant_id,
        livemode=subscription.livemode,
        coupon_id=coupon_id,
        currency=subscription.price.currency,
        at=at,
        param=param,
    )
    start = _start([subscription.next_billing_at] if subscription.status in Subscription.BILLABLE_STATUSES else [], at)
    _end_locked(subscription.discount_id, at=at)
    discount = _new_discount_locked(coupon, customer, subscription, start)
    subscription.discount = discount
    subscription.save(update_fields=["discount", "updated_at"])
    discount_event(discount, "customer.discount.created", created_at=at)
    return discount


def refuse_other_currency(customer: Customer, currency: str, *, param: str) -> None:
    """Refuse billing ``customer`` in ``currency`` while its discount is an ``amount_off`` coupon in another one.

    A customer's ``amount_off`` coupon is accepted while the customer has no currency yet (none to compare
    with); a first subscription in another currency would then never take it. Stripe refuses that
    subscription ("cannot combine currencies on a single customer" with a discount in another currency), and
    so does this: :class:`InvalidRequestError` ``coupon_currency_mismatch`` naming ``param`` (the request's
    ``price`` or ``items``). docs/decisions/0210. Call it with the customer locked.
    """
    if customer.discount_id is None:
        return
    coupon = Discount.objects.select_related("coupon").get(pk=customer.discount_id).coupon
    if coupon.amount_off is not None and coupon.currency != currency:
        raise InvalidRequestError(
            f"The customer's discount takes {coupon.currency} off (coupon '{coupon.id}'); a subscription in "
            f"{currency} would never take it. A customer is billed in one currency: delete the discount first, or "
            f"subscribe in {coupon.currency}.",
            code="coupon_currency_mismatch",
            param=param,
        )


def set_customer_discount(*, tenant_id: str, livemode: bool, customer_id: str, coupon_id: str | None) -> Customer:
    """``POST /v1/customers/{id}`` with ``coupon``/``discounts``: apply ``coupon_id``, or (None) delete the discount.

    One transaction; raises :class:`NotFoundError` (customer, coupon) and as :func:`redeem_locked`.
    """
    with transaction.atomic():
        customer = callers_customer_locked(tenant_id, livemode, customer_id)
        at = _now(customer.test_clock)
        if coupon_id is None:
            end_customer_discount_locked(customer, at=at)
        else:
            apply_to_customer_locked(customer, coupon_id, at=at)
    return customer


def end_customer_discount_locked(customer: Customer, *, at: datetime) -> Discount | None:
    """Delete the customer's discount as of ``at`` (customer row locked); the deleted one, or None."""
    discount = _end_locked(customer.discount_id, at=at)
    if discount is not None:
        customer.discount = None
        customer.save(update_fields=["discount"])
    return discount


def set_subscription_discount(
    *, tenant_id: str, livemode: bool, subscription_id: str, coupon_id: str | None, coupon_param: str = "coupon"
) -> Subscription:
    """As :func:`set_customer_discount`, for a subscription's own discount (``coupon_param`` names it in a refusal)."""
    with transaction.atomic():
        sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
        set_subscription_discount_locked(sub, coupon_id, at=_now(sub.test_clock), param=coupon_param)
    return sub


def set_subscription_discount_locked(
    sub: Subscription, coupon_id: str | None, *, at: datetime, param: str = "coupon"
) -> None:
    """Apply ``coupon_id`` as the subscription's discount, or (None) delete it, inside the caller's transaction
    (subscription row locked, its price loaded; the customer is locked here, after it). Errors name ``param``."""
    if coupon_id is None:
        if _end_locked(sub.discount_id, at=at) is not None:
            sub.discount = None
            sub.save(update_fields=["discount", "updated_at"])
        return
    customer = customer_qs_select_for_update().get(pk=sub.customer_id)
    apply_to_subscription_locked(sub, customer, coupon_id, at=at, param=param)


def delete_customer_discount(*, tenant_id: str, livemode: bool, customer_id: str) -> Discount:
    """``DELETE /v1/customers/{id}/discount``: the deleted discount. :class:`NotFoundError` when there is none."""
    with transaction.atomic():
        customer = callers_customer_locked(tenant_id, livemode, customer_id)
        if customer.discount_id is None:
            raise NotFoundError(f"Customer '{customer_id}' has no discount.", param="id")
        return end_customer_discount_locked(customer, at=_now(customer.test_clock))


def delete_subscription_discount(*, tenant_id: str, livemode: bool, subscription_id: str) -> Discount:
    """``DELETE /v1/subscriptions/{id}/discount``: the deleted discount. :class:`NotFoundError` when there is none."""
    with transaction.atomic():
        sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
        if sub.discount_id is None:
            raise NotFoundError(f"Subscription '{subscription_id}' has no discount.", param="id")
        discount = _end_locked(sub.discount_id, at=_now(sub.test_clock))
        sub.discount = None
        sub.save(update_fields=["discount", "updated_at"])
    return discount


# ---------------------------------------------------------------------------------------
# Invoices


def covers(discount: Discount, period_start: datetime, invoice_id: str | None = None) -> bool:
    """Whether ``discount`` covers an invoice whose period starts at ``period_start`` (``invoice_id``: that
    invoice, for a ``once`` discount it may already have gone on)."""
    if not (discount.start <= period_start and (discount.end is None or period_start < discount.end)):
        return False
    if discount.coupon.duration == Coupon.Duration.ONCE:
        return discount.invoice_id is None or discount.invoice_id == invoice_id
    return True


def pick(
    candidates: list[Discount], subscription_id: str | None, period_start: datetime, invoice_id: str | None = None
) -> Discount | None:
    """The discount of ``candidates`` (the customer's, :func:`_candidates`) an invoice takes: the subscription's
    if one covers it, else the customer's; of several, the latest started."""
    covering = [d for d in candidates if covers(d, period_start, invoice_id)]
    own = [d for d in covering if subscription_id is not None and d.subscription_id == subscription_id]
    general = [d for d in covering if d.subscription_id is None]
    for group in (own, general):
        if group:
            return max(group, key=lambda d: (d.start, d.id))
    return None


def _candidates(customer_ids) -> dict[str, list[Discount]]:
    found: dict[str, list[Discount]] = {}
    for discount in Discount.objects.filter(customer_id__in=list(customer_ids)).select_related("coupon"):
        found.setdefault(discount.customer_id, []).append(discount)
    return found


def discount_for(invoice: Invoice) -> Discount | None:
    """The discount ``invoice`` (saved or not) takes by :func:`pick`; one query."""
    candidates = _candidates([invoice.customer_id]).get(invoice.customer_id, [])
    return pick(candidates, invoice.subscription_id, invoice.period_start, invoice.id)


def discounts_for_page(subs: list[Subscription], starts: dict[str, datetime]) -> dict[str, Discount | None]:
    """For the page close: the discount each subscription's invoice of the period starting at ``starts[sub.id]``
    takes (:func:`pick`), in one query."""
    candidates = _candidates({sub.customer_id for sub in subs})
    return {sub.id: pick(candidates.get(sub.customer_id, []), sub.id, starts[sub.id]) for sub in subs}


def _half_up(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded half up (away from zero for negatives: the sign is kept)."""
    sign = -1 if numerator < 0 else 1
    return sign * ((abs(numerator) * 2 + denominator) // (2 * denominator))


def line_discounts(amounts: list[int], coupon: Coupon, currency: str) -> list[int]:
    """The discount of each line of ``amounts`` (minor units of ``currency``, in line order) under ``coupon``.

    ``percent_off``: ``amount × p / 100`` per line, rounded half up once per line, same sign as the
    line. ``amount_off`` (only in its own currency; another currency gets nothing): at most the sum
    of all lines (never a negative total), spread over the positive lines in proportion to their
    amounts, floors first, the remaining minor units one each to the lines with the largest
    remainders, ties to the earlier line. Every discount has its line's sign and is at most its
    line's amount. docs/decisions/0153.
    """
    if coupon.percent_off is not None:
        hundredths = int(coupon.percent_off * 100)
        return [_half_up(amount * hundredths, 10_000) for amount in amounts]
    if coupon.currency != currency:
        return [0] * len(amounts)
    positive = sum(a for a in amounts if a > 0)
    cap = min(coupon.amount_off, max(sum(amounts), 0))
    if cap <= 0 or positive <= 0:
        return [0] * len(amounts)
    shares = [cap * a // positive if a > 0 else 0 for a in amounts]
    left = cap - sum(shares)
    by_remainder = sorted(
        (i for i, a in enumerate(amounts) if a > 0), key=lambda i: (-(cap * amounts[i] % positive), i)
    )
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def apply_discount(invoice: Invoice, lines: list[InvoiceLineItem], discount: Discount | None) -> None:
    """Set each line's ``discount_amount`` and the invoice's ``discount``, ``total_discount`` and pre-tax
    ``total`` / ``amount_due`` in memory (``lines``: all the invoice's lines; ``discount`` None clears them)."""
    amounts = [line.amount for line in lines]
    shares = line_discounts(amounts, discount.coupon, invoice.currency) if discount else [0] * len(lines)
    for line, share in zip(lines, shares, strict=True):
        line.discount_amount = share
    invoice.total_discount = sum(shares)
    invoice.discount = discount if discount is not None and invoice.total_discount else None
    invoice.total = invoice.subtotal - invoice.total_discount + invoice.tax
    invoice.amount_due = max(invoice.total, 0)


def apply_discount_locked(invoice: Invoice, lines: list[InvoiceLineItem] | None = None) -> list[InvoiceLineItem]:
    """Apply the discount ``invoice`` (a locked draft) takes, writing its lines' ``discount_amount``; its lines.

    A ``once`` discount is claimed for this invoice by a conditional update (taken by another invoice
    meanwhile: none applies). The invoice itself is saved by the caller. ``lines``: all its lines,
    if the caller has them.
    """
    if lines is None:
        lines = list(InvoiceLineItem.objects.filter(invoice_id=invoice.id).order_by("id"))
    before = [line.discount_amount for line in lines]
    discount = discount_for(invoice)
    if discount is not None and discount.coupon.duration == Coupon.Duration.ONCE and discount.invoice_id is None:
        claimed = (
            Discount.objects.filter(pk=discount.pk)
            .filter(Q(invoice__isnull=True) | Q(invoice_id=invoice.id))
            .update(invoice_id=invoice.id)
        )
        if not claimed:
            discount = None
    apply_discount(invoice, lines, discount)
    changed = [line for line, old in zip(lines, before, strict=True) if line.discount_amount != old]
    if changed:
        InvoiceLineItem.objects.bulk_update(changed, ["discount_amount"])
    return lines
