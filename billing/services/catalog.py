"""Customers, prices and subscriptions: create, and cancel subscriptions.

Each function owns one transaction, validates what needs the database (references,
currencies, times relative to "now"), writes the change and emits its event with
:mod:`billing.events` in the same transaction. Lookups are always scoped to
``(tenant_id, livemode)``: an id of another tenant or mode raises
:class:`~hardcount.errors.NotFoundError` exactly like an id that never existed.

"Now" is the billing time: PostgreSQL's ``now()`` for wall-clock objects, the test clock's
``frozen_time`` for objects on a test clock (one clock authority: docs/reference/roles-and-leases.md#one-clock).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction

from billing.events import customer_event, price_event, subscription_event
from billing.lock_objects import customer_qs_select_for_update, subscription_qs_select_for_update
from billing.models import Customer, Price, Subscription, SubscriptionItem, TestClock
from billing.periods import INTERVALS, period_start
from billing.representations import iso, subscription_data
from billing.services import ceilings, discounts
from billing.services.usage import validate_usage_terms
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError, business_rule_codes
from hardcount.money import CURRENCY_EXPONENTS, MAX_AMOUNT
from hardcount.times import database_now
from outbox.services import emit_for

# Codes of the 422s this module raises for requests whose every field is well-formed on its own
# (cross-field and time-relative rules the OpenAPI document can only describe in prose).
BUSINESS_RULE_CODES = business_rule_codes(
    "test_mode_only",
    "price_inactive",
    "currency_mismatch",
    "interval_count_too_long",
    "trial_conflict",
    "trial_end_out_of_range",
    "billing_cycle_anchor_out_of_range",
    "item_mismatch",
    "item_duplicate_price",
    "price_or_items",
)

# Stripe's limit of items per subscription (https://docs.stripe.com/api/subscriptions/create#create_subscription-items).
MAX_ITEMS = 20

# Longest billing interval accepted: three years, in each interval's unit.
MAX_INTERVAL_COUNT = {"day": 3 * 366, "week": 3 * 52, "month": 3 * 12, "year": 3}
# Longest trial, as Stripe allows: 730 days.
MAX_TRIAL_DAYS = 730
# How far in the past an explicit billing_cycle_anchor may lie (client clock skew, "start of today").
ANCHOR_PAST_TOLERANCE = timedelta(hours=24)


def billing_now(test_clock: TestClock | None) -> datetime:
    """The billing time for an object: the clock's ``frozen_time`` if it has a test clock, else the DB's now()."""
    if test_clock is not None:
        return test_clock.frozen_time
    return database_now()


def _get(queryset, object_id: str, *, tenant_id: str, livemode: bool, param: str, noun: str):
    """The object of ``queryset`` (a manager, or a locking queryset of :mod:`billing.lock_objects`) in the
    tenant and mode; :class:`NotFoundError` naming ``param`` and ``noun`` when there is none."""
    obj = queryset.filter(tenant_id=tenant_id, livemode=livemode, pk=object_id).first()
    if obj is None:
        raise NotFoundError(f"No such {noun}: '{object_id}'.", param=param)
    return obj


def create_customer(
    *,
    tenant_id: str,
    livemode: bool,
    email: str,
    name: str = "",
    external_id: str = "",
    default_payment_method: str = "",
    metadata: dict[str, str] | None = None,
    test_clock_id: str | None = None,
    coupon_id: str | None = None,
    coupon_param: str = "coupon",
) -> Customer:
    """Create a customer and emit ``customer.created``.

    ``test_clock_id`` attaches the customer (and so its subscriptions) to a test clock of
    the same tenant; clocks are test-mode only. ``coupon_id`` is redeemed as the customer's
    discount (:func:`billing.services.discounts.apply_to_customer_locked`; ``coupon_param`` names it in a
    refusal). Raises :class:`InvalidRequestError` for a clock in live mode or a coupon that cannot be redeemed,
    :class:`NotFoundError` for an unknown clock or coupon.
    """
    with transaction.atomic():
        clock = None
        if test_clock_id:
            if livemode:
                raise InvalidRequestError(
                    "Test clocks exist in test mode only; use a test key.", code="test_mode_only", param="test_clock"
                )
            clock = _get(
                TestClock.objects,
                test_clock_id,
                tenant_id=tenant_id,
                livemode=livemode,
                param="test_clock",
                noun="test clock",
            )
        customer = Customer.objects.create(
            tenant_id=tenant_id,
            livemode=livemode,
            email=email,
            name=name,
            external_id=external_id,
            default_payment_method=default_payment_method,
            metadata=metadata or {},
            test_clock=clock,
        )
        now = billing_now(clock)
        customer_event(customer, "customer.created", created_at=now)
        if coupon_id is not None:
            discounts.apply_to_customer_locked(customer, coupon_id, at=now, param=coupon_param)
    return customer


def validate_price_terms(*, amount: int, currency: str, interval: str, interval_count: int) -> None:
    """Raise :class:`InvalidRequestError` unless the terms are billable.

    ``amount`` 0..``MAX_AMOUNT`` minor units; ``currency`` a lower-case code of
    :data:`hardcount.money.CURRENCY_EXPONENTS`; ``interval`` one of day/week/month/year;
    ``interval_count`` 1 up to three years (:data:`MAX_INTERVAL_COUNT`).
    """
    if isinstance(amount, bool) or not isinstance(amount, int) or not 0 <= amount <= MAX_AMOUNT:
        raise InvalidRequestError(
            f"amount must be an integer from 0 to {MAX_AMOUNT} (minor units).",
            code="parameter_out_of_range",
            param="amount",
        )
    if currency not in CURRENCY_EXPONENTS:
        raise InvalidRequestError(f"Unsupported currency: '{currency}'.", code="currency_unsupported", param="currency")
    if interval not in INTERVALS:
        raise InvalidRequestError(f"interval must be one of {', '.join(INTERVALS)}.", param="interval")
    cap = MAX_INTERVAL_COUNT[interval]
    if not 1 <= interval_count <= cap:
        raise InvalidRequestError(
            f"interval_count must be from 1 to {cap} for interval '{interval}' (at most three years).",
            code="interval_count_too_long",
            param="interval_count",
        )


def create_price(
    *,
    tenant_id: str,
    livemode: bool,
    amount: int,
    currency: str,
    interval: str,
    interval_count: int = 1,
    nickname: str = "",
    active: bool = True,
    recurring: dict | None = None,
    billing_scheme: str = Price.PER_UNIT,
    tiers_mode: str = "",
    tiers: list[dict] | None = None,
    transform_quantity: dict | None = None,
) -> Price:
    """Create a recurring price of ``amount`` minor units of ``currency`` and emit ``price.created``.

    Minor units follow the currency's ISO 4217 exponent: 1000 ``usd`` is $10.00, 1000
    ``jpy`` is ¥1,000. A usage-based price: ``recurring={"usage_type": "metered", "meter": id}``, with
    ``billing_scheme``, ``tiers_mode``, ``tiers`` and ``transform_quantity`` as Stripe's
    (:func:`billing.services.usage.validate_usage_terms`). Raises :class:`InvalidRequestError` (see
    :func:`validate_price_terms`).
    """
    validate_price_terms(amount=amount, currency=currency, interval=interval, interval_count=interval_count)
    with transaction.atomic():
        usage = validate_usage_terms(
            tenant_id=tenant_id,
            livemode=livemode,
            amount=amount,
            recurring=recurring,
            billing_scheme=billing_scheme,
            tiers_mode=tiers_mode,
            tiers=tiers,
            transform_quantity=transform_quantity,
        )
        price = Price.objects.create(
            tenant_id=tenant_id,
            livemode=livemode,
            amount=amount,
            currency=currency,
            interval=interval,
            interval_count=interval_count,
            nickname=nickname,
            active=active,
            **usage,
        )
        price_event(price, "price.created")
    return price


def create_subscription(
    *,
    tenant_id: str,
    livemode: bool,
    customer_id: str,
    price_id: str | None = None,
    items: list[dict] | None = None,
    billing_cycle_anchor: datetime | None = None,
    trial_end: datetime | None = None,
    trial_period_days: int | None = None,
    cancel_at_period_end: bool = False,
    metadata: dict[str, str] | None = None,
    coupon_id: str | None = None,
    coupon_param: str = "coupon",
) -> Subscription:
    """Subscribe a customer to prices (``items``: ``[{"price": id, "quantity": n}]``; or ``price_id``, one item
    of quantity 1) and emit ``subscription.created``.

    The subscription takes the customer's test clock, if any, and "now" is then the
    clock's time. Billing is in advance
    (docs/reference/domain.md#billing-in-advance-and-the-first-period): ``next_billing_at`` is the anchor, so
    the next drain bills the first period. The anchor defaults to now; with a trial
    (``trial_end``, or ``trial_period_days`` from now) the anchor is the trial's end, the
    status ``trialing`` and the current period the trial (decision 0004).

    Rules (each an :class:`InvalidRequestError` naming its param): exactly one of ``price_id``
    and ``items``; every price is active, appears once, and shares the first item's currency
    and billing interval (``item_mismatch`` naming the item, docs/decisions/0140); the
    customer's currency, once set, equals the prices' (else it is set now, under the
    customer's row lock); not both ``trial_end`` and ``trial_period_days``; a trial ends
    after now and at most 730 days later; no explicit anchor with a trial; an anchor no
    more than 24 hours before now and no later than one billing interval after now.
    Unknown customer or price: :class:`NotFoundError`. ``coupon_id`` is redeemed as the subscription's
    discount (:func:`billing.services.discounts.apply_to_subscription_locked`; its errors too, naming
    ``coupon_param``). A customer whose discount is an ``amount_off`` coupon in another currency than the
    prices' is refused (``coupon_currency_mismatch``, :func:`billing.services.discounts.refuse_other_currency`).
    """
    with transaction.atomic():
        customer = _get(
            customer_qs_select_for_update(),
            customer_id,
            tenant_id=tenant_id,
            livemode=livemode,
            param="customer",
            noun="customer",
        )
        wanted = resolve_items(tenant_id=tenant_id, livemode=livemode, price_id=price_id, items=items)
        for index, (item_price, quantity) in enumerate(wanted):
            ceilings.check_line(item_price, quantity, param="price" if items is None else f"items[{index}][quantity]")
        price = wanted[0][0]
        if customer.currency and customer.currency != price.currency:
            raise InvalidRequestError(
                f"The customer is billed in {customer.currency}; the price is in {price.currency}.",
                code="currency_mismatch",
                param="price",
            )
        discounts.refuse_other_currency(customer, price.currency, param="price" if items is None else "items")
        clock = customer.test_clock
        now = billing_now(clock)
        trial_end = _resolve_trial(now, trial_end=trial_end, trial_period_days=trial_period_days)
        if trial_end is not None:
            if billing_cycle_anchor is not None:
                raise InvalidRequestError(
                    "billing_cycle_anchor cannot be combined with a trial: the trial's end is the anchor.",
                    code="trial_conflict",
                    param="billing_cycle_anchor",
                )
            anchor = trial_end
        else:
            anchor = now if billing_cycle_anchor is None else billing_cycle_anchor
            _check_anchor(now, anchor, price)

        if not customer.currency:
            customer.currency = price.currency
            customer.save(update_fields=["currency"])
        subscription = Subscription.objects.create(
            tenant_id=tenant_id,
            livemode=livemode,
            customer=customer,
            price=price,
            status=Subscription.TRIALING if trial_end else Subscription.ACTIVE,
            billing_cycle_anchor=anchor,
            trial_end=trial_end,
            current_period_start=now if trial_end else None,
            current_period_end=trial_end,
            next_billing_at=anchor,
            test_clock=clock,
            cancel_at_period_end=cancel_at_period_end,
            metadata=metadata or {},
        )
        SubscriptionItem.objects.bulk_create(
            SubscriptionItem(
                tenant_id=tenant_id,
                livemode=livemode,
                subscription=subscription,
                price=item_price,
                quantity=quantity,
                created_at=now,
            )
            for item_price, quantity in wanted
        )
        # The first invoice sweeps the customer's pending items too: refused whole if it could not be charged.
        ceilings.check_next_invoice(subscription, param="price" if items is None else "items")
        if coupon_id is not None:
            discounts.apply_to_subscription_locked(subscription, customer, coupon_id, at=now, param=coupon_param)
        subscription_event(subscription, "subscription.created", created_at=now)
    return subscription


def resolve_items(
    *, tenant_id: str, livemode: bool, price_id: str | None, items: list[dict] | None
) -> list[tuple[Price, int]]:
    """The ``(price, quantity)`` pairs of a new subscription: ``items`` or the one-item shorthand ``price_id``.

    Raises :class:`InvalidRequestError` (neither or both given, an inactive price, a price given
    twice, an item whose currency or interval differs from the first's: ``item_mismatch`` naming
    ``items[i]``) and :class:`NotFoundError` (an unknown price, naming ``items[i][price]``).
    """
    if (price_id is None) == (items is None):
        raise InvalidRequestError("Give price or items, not both.", code="price_or_items", param="items")
    listed = [{"price": price_id, "quantity": 1}] if items is None else items
    if not 1 <= len(listed) <= MAX_ITEMS:
        raise InvalidRequestError(f"items must hold 1 to {MAX_ITEMS} items.", param="items")
    pairs = []
    for index, item in enumerate(listed):
        param = "price" if items is None else f"items[{index}][price]"
        price = _get(Price.objects, item["price"], tenant_id=tenant_id, livemode=livemode, param=param, noun="price")
        if not price.active:
            raise InvalidRequestError(f"Price '{price.id}' is not active.", code="price_inactive", param=param)
        pairs.append((price, item.get("quantity", 1)))
    check_items_agree([price for price, _ in pairs])
    return pairs


def check_items_agree(prices: list[Price]) -> None:
    """Raise :class:`InvalidRequestError` unless ``prices`` (a subscription's items, in order) are distinct and
    share the first one's currency, ``interval`` and ``interval_count`` (``item_mismatch``, naming ``items[i]``)."""
    first = prices[0]
    seen = set()
    for index, price in enumerate(prices):
        if price.id in seen:
            raise InvalidRequestError(
                f"Price '{price.id}' is on the subscription twice; change its item's quantity instead.",
                code="item_duplicate_price",
                param=f"items[{index}]",
            )
        seen.add(price.id)
        if (price.currency, price.interval, price.interval_count) != (
            first.currency,
            first.interval,
            first.interval_count,
        ):
            raise InvalidRequestError(
                f"Item {index} (price '{price.id}', {price.currency} every {price.interval_count} {price.interval}) "
                f"differs from the subscription's {first.currency} every {first.interval_count} {first.interval}: "
                "all items share one currency and billing interval.",
                code="item_mismatch",
                param=f"items[{index}]",
            )


def _resolve_trial(now: datetime, *, trial_end: datetime | None, trial_period_days: int | None) -> datetime | None:
    if trial_end is not None and trial_period_days is not None:
        raise InvalidRequestError(
            "Give trial_end or trial_period_days, not both.", code="trial_conflict", param="trial_period_days"
        )
    if trial_period_days is not None:
        if not 1 <= trial_period_days <= MAX_TRIAL_DAYS:
            raise InvalidRequestError(
                f"trial_period_days must be from 1 to {MAX_TRIAL_DAYS}.",
                code="trial_end_out_of_range",
                param="trial_period_days",
            )
        return now + timedelta(days=trial_period_days)
    if trial_end is not None:
        if trial_end <= now:
            raise InvalidRequestError(
                "trial_end must be in the future.", code="trial_end_out_of_range", param="trial_end"
            )
        if trial_end > now + timedelta(days=MAX_TRIAL_DAYS):
            raise InvalidRequestError(
                f"trial_end must be at most {MAX_TRIAL_DAYS} days from now.",
                code="trial_end_out_of_range",
                param="trial_end",
            )
    return trial_end


def _check_anchor(now: datetime, anchor: datetime, price: Price) -> None:
    if anchor < now - ANCHOR_PAST_TOLERANCE:
        raise InvalidRequestError(
            "billing_cycle_anchor may be at most 24 hours in the past (backdating is not supported).",
            code="billing_cycle_anchor_out_of_range",
            param="billing_cycle_anchor",
        )
    latest = period_start(now, price.interval, price.interval_count, 1)
    if anchor > latest:
        raise InvalidRequestError(
            "billing_cycle_anchor may be at most one billing interval after now.",
            code="billing_cycle_anchor_out_of_range",
            param="billing_cycle_anchor",
        )


def cancel_subscription(
    *, tenant_id: str, livemode: bool, subscription_id: str, at_period_end: bool = False
) -> Subscription:
    """Cancel a subscription now, or at the end of its current period.

    Now: ``status=canceled``, ``canceled_at`` = ``ended_at`` = now, nothing more is billed
    (``next_billing_at`` cleared), event ``subscription.canceled``. At period end: sets
    ``cancel_at_period_end`` (and ``canceled_at``, when the request was made, as Stripe
    does), event ``subscription.updated``; the drain ends it when the period ends. Asking
    again for an at-period-end cancellation changes nothing and emits nothing.
    Raises :class:`NotFoundError`, or :class:`StateConflictError` when already canceled.
    """
    with transaction.atomic():
        subscription = _locked_live_subscription(tenant_id, livemode, subscription_id)
        now = billing_now(subscription.test_clock)
        if at_period_end:
            _set_cancel_at_period_end_locked(subscription, True, now)
            return subscription
        subscription.status = Subscription.CANCELED
        subscription.canceled_at = now
        subscription.ended_at = now
        subscription.next_billing_at = None
        subscription.save(update_fields=["status", "canceled_at", "ended_at", "next_billing_at", "updated_at"])
        subscription_event(subscription, "subscription.canceled", created_at=now)
    return subscription


def set_cancel_at_period_end(
    *, tenant_id: str, livemode: bool, subscription_id: str, cancel_at_period_end: bool
) -> Subscription:
    """``cancel_at_period_end`` of ``POST /v1/subscriptions/{id}``, as Stripe's: True schedules the cancellation at the
    end of the current period (as :func:`cancel_subscription` with ``at_period_end``), False undoes a scheduled one.

    Under the subscription's row lock (the close that would end it takes the same lock, so it ends the period
    before or after, never half). A change emits ``subscription.updated`` with ``previous_attributes``
    (``cancel_at_period_end``, ``canceled_at``); asking for what is already so changes and emits nothing.
    Raises :class:`NotFoundError`, or :class:`StateConflictError` (``subscription_canceled``) when it has ended.
    docs/decisions/0199.
    """
    with transaction.atomic():
        subscription = _locked_live_subscription(tenant_id, livemode, subscription_id)
        _set_cancel_at_period_end_locked(subscription, cancel_at_period_end, billing_now(subscription.test_clock))
    return subscription


def _locked_live_subscription(tenant_id: str, livemode: bool, subscription_id: str) -> Subscription:
    """The caller's subscription under its row lock; :class:`NotFoundError`, or :class:`StateConflictError`
    (``subscription_canceled``) when it has ended."""
    subscription = _get(
        subscription_qs_select_for_update(),
        subscription_id,
        tenant_id=tenant_id,
        livemode=livemode,
        param="id",
        noun="subscription",
    )
    if subscription.status == Subscription.CANCELED:
        raise StateConflictError(f"Subscription '{subscription.id}' is already canceled.", code="subscription_canceled")
    return subscription


def _set_cancel_at_period_end_locked(subscription: Subscription, value: bool, now: datetime) -> None:
    if subscription.cancel_at_period_end == value:
        return
    previous = {
        "cancel_at_period_end": subscription.cancel_at_period_end,
        "canceled_at": iso(subscription.canceled_at) if subscription.canceled_at else None,
    }
    subscription.cancel_at_period_end = value
    # Stripe sets canceled_at when the cancellation is requested and clears it when it is withdrawn.
    subscription.canceled_at = now if value else None
    subscription.save(update_fields=["cancel_at_period_end", "canceled_at", "updated_at"])
    data = subscription_data(subscription)
    data["previous_attributes"] = previous
    emit_for(subscription, "subscription.updated", data, created_at=now)


__all__ = [
    "BUSINESS_RULE_CODES",
    "MAX_INTERVAL_COUNT",
    "MAX_TRIAL_DAYS",
    "billing_now",
    "cancel_subscription",
    "check_items_agree",
    "create_customer",
    "create_price",
    "create_subscription",
    "database_now",
    "resolve_items",
    "set_cancel_at_period_end",
    "validate_price_terms",
]
