"""Changing a subscription's items: add, remove, re-price or re-quantify, with Stripe's proration behaviours.

``POST /v1/subscriptions/{id}`` with ``items`` follows Stripe's "Change subscription price" and
"Prorations" (https://docs.stripe.com/billing/subscriptions/change-price,
https://docs.stripe.com/billing/subscriptions/prorations):

- ``create_prorations`` (default): a credit line for the unused time of what is removed or
  reduced, a charge line for the remaining time of what is added, as pending invoice items of the
  subscription, billed by its next invoice;
- ``always_invoice``: the same lines on an invoice of their own (``billing_reason``
  ``subscription_update``), finalised and charged at once through the per-invoice charge path of
  ``POST /v1/invoices/{id}/pay``; its ``change_key`` (UNIQUE) is derived from the change, so one
  change makes one invoice;
- ``none``: the new items apply from now, nothing is prorated.

``billing_cycle_anchor: "now"`` restarts the billing cycle at the change's instant instead
(:func:`restart_cycle`, Stripe's "Changing the billing cycle anchor"): the unused time credited, a full
period from now invoiced as a period invoice and charged by the close. docs/decisions/0147.

The prorated period is the billing period containing the change's instant, and only once it has
been invoiced: before the first invoice (or in a trial) the next invoice bills the new items whole.
A change locks the subscription ``FOR UPDATE`` (first in the lock order of
:mod:`billing.lock_objects`) and re-reads it, so a close of the same subscription runs wholly before
or after it. docs/decisions/0140, 0141, 0142.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import NoReturn

from django.db import connection, transaction

from billing.events import invoice_event, ledger_entry_event
from billing.lock_objects import callers_subscription_locked, customer_locked
from billing.models import Invoice, InvoiceItem, InvoiceLineItem, Price, Subscription, SubscriptionItem
from billing.models.subscriptions import PauseBehavior
from billing.periods import period_bounds
from billing.queries import materialise_invoice, usage_hold_locked
from billing.representations import iso, scheduled_change_data, subscription_data, subscription_item_data
from billing.services import ceilings
from billing.services.catalog import billing_now, check_items_agree
from billing.services.catalog import cancel_subscription as catalog_cancel
from billing.services.close import (
    apply_tax,
    close_subscription_period,
    finalize_or_pend_locked,
    materialise_period_invoice,
    tax_quote,
)
from billing.services.discounts import KEEP, apply_discount, discount_for, set_subscription_discount_locked
from billing.services.invoices import InvoiceStateError, pay_invoice
from billing.services.items import ItemAfter, scheduled_items, write_items_locked
from billing.services.ledger import credit_proration_locked, set_balance_applied
from billing.services.lines import item_line, pending_for, period_description
from billing.services.pausing import collection_paused, settle_paused_draft_locked
from billing.services.payments import OutcomeKind, PaymentInFlight
from billing.services.proration import prorate, remaining_share, whole_seconds
from billing.services.usage import final_usage_invoice_locked, usage_lines_for, usage_until_locked
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError, business_rule_codes
from outbox.services import emit_for

CREATE_PRORATIONS, ALWAYS_INVOICE, NONE = "create_prorations", "always_invoice", "none"
PRORATION_BEHAVIORS = (CREATE_PRORATIONS, ALWAYS_INVOICE, NONE)

BUSINESS_RULE_CODES = business_rule_codes(
    "item_mismatch",
    "item_duplicate_price",
    "items_empty",
    "proration_date_out_of_range",
    "prorate_conflict",
    "billing_cycle_anchor_conflict",
    "billing_cycle_anchor_unavailable",
    "effective_at_conflict",
)

# ``billing_cycle_anchor`` of an update (Stripe's): keep the cycle, or restart it at the change's instant.
ANCHOR_UNCHANGED, ANCHOR_NOW = "unchanged", "now"
# How long a restart's answer waits for its period's close when another transaction holds the subscription.
RESTART_CLOSE_WAIT_S = 5.0


@dataclass
class ProrationLine:
    """One proration: signed ``amount`` minor units for ``quantity × price`` over ``[period_start, period_end)``,
    ``prorate(full_amount, remaining_s, period_s)`` (its inputs kept for the item that records it)."""

    description: str
    price: Price
    quantity: int
    amount: int
    period_start: datetime
    period_end: datetime
    full_amount: int = 0
    remaining_s: int = 0
    period_s: int = 0


@dataclass
class ChangePlan:
    """What a change does, computed without writing: the items before and after, the prorated period (None:
    nothing to prorate) and the proration lines, at instant ``at`` (whole seconds)."""

    subscription: Subscription
    at: datetime
    before: list[SubscriptionItem]
    after: list[ItemAfter]
    period: tuple[datetime, datetime] | None
    prorations: list[ProrationLine] = field(default_factory=list)


def _day(at: datetime) -> str:
    return f"{at:%b} {at.day}, {at.year}"


def invoiced_period(sub: Subscription, at: datetime) -> tuple[datetime, datetime] | None:
    """The billing period of ``sub`` that contains ``at`` if it has been invoiced (a non-void cycle invoice), else None.

    Billing is in advance, so that invoice has billed the period's items already: a change inside it
    is prorated over it. Before the anchor (a trial) or in a period not yet invoiced there is none.
    """
    price = sub.price
    if at < sub.billing_cycle_anchor:
        return None
    n = max(sub.periods_billed - 1, 0)
    while True:
        start, end = period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, n)
        if at < end:
            break
        n += 1
        if n > sub.periods_billed:
            return None
    invoiced = (
        Invoice.objects.filter(subscription_id=sub.id, period_start=start, billing_reason=Invoice.CYCLE)
        .exclude(status=Invoice.VOID)
        .exists()
    )
    return (start, end) if invoiced else None


def _resolve(sub: Subscription, before: list[SubscriptionItem], requested: list[dict]) -> list[ItemAfter]:
    """The items after applying ``requested`` (Stripe's ``items`` of an update) to ``before``."""
    by_id = {item.id: item for item in before}
    changes: dict[str, dict] = {}
    added: list[tuple[int, dict]] = []
    for index, entry in enumerate(requested):
        item_id = entry.get("id")
        if item_id is None:
            if entry.get("deleted"):
                raise InvalidRequestError(
                    "deleted needs the id of the item to remove.", code="parameter_missing", param=f"items[{index}][id]"
                )
            if not entry.get("price"):
                raise InvalidRequestError(
                    "A new item needs a price.", code="parameter_missing", param=f"items[{index}][price]"
                )
            added.append((index, entry))
            continue
        if item_id not in by_id:
            raise NotFoundError(f"No such item of this subscription: '{item_id}'.", param=f"items[{index}][id]")
        if item_id in changes:
            raise InvalidRequestError(
                f"Item '{item_id}' is given twice.", code="item_duplicate_price", param=f"items[{index}][id]"
            )
        changes[item_id] = {**entry, "index": index}

    prices = _prices(sub, [e["price"] for e in changes.values() if e.get("price")] + [e["price"] for _, e in added])
    after, origin = [], []
    for item in before:
        entry = changes.get(item.id)
        if entry is None:
            after.append(ItemAfter(item.id, item.price, item.quantity))
            origin.append(None)
        elif not entry.get("deleted"):
            price = prices[entry["price"]] if entry.get("price") else item.price
            after.append(ItemAfter(item.id, price, entry.get("quantity") or item.quantity))
            origin.append(entry["index"])
    for index, entry in added:
        after.append(ItemAfter(None, prices[entry["price"]], entry.get("quantity") or 1))
        origin.append(index)
    if not after:
        raise InvalidRequestError(
            "A subscription keeps one item at least; cancel it instead.", code="items_empty", param="items"
        )
    _check_terms(sub, after, origin)
    return after


def _prices(sub: Subscription, ids: list[str]) -> dict[str, Price]:
    found = {p.id: p for p in Price.objects.filter(tenant_id=sub.tenant_id, livemode=sub.livemode, pk__in=ids)}
    for price_id in ids:
        if price_id not in found:
            raise NotFoundError(f"No such price: '{price_id}'.", param="items")
        if not found[price_id].active:
            raise InvalidRequestError(f"Price '{price_id}' is not active.", code="price_inactive", param="items")
    return found


def _check_terms(sub: Subscription, after: list[ItemAfter], origin: list[int | None]) -> None:
    """Every item keeps the subscription's currency and interval, prices distinct (naming the request's item)."""
    current = sub.price
    for item, index in zip(after, origin, strict=True):
        price = item.price
        if (price.currency, price.interval, price.interval_count) != (
            current.currency,
            current.interval,
            current.interval_count,
        ):
            raise InvalidRequestError(
                f"Item {index} (price '{price.id}', {price.currency} every {price.interval_count} {price.interval}) "
                f"differs from the subscription's {current.currency} every {current.interval_count} "
                f"{current.interval}: all items share one currency and billing interval.",
                code="item_mismatch",
                param=f"items[{index}]",
            )
    for item, index in zip(after, origin, strict=True):
        param = f"items[{index}][quantity]" if index is not None else "items"
        ceilings.check_line(item.price, item.quantity, param=param)
    try:
        check_items_agree([item.price for item in after])
    except InvalidRequestError as exc:
        position = int(exc.param.strip("items[]"))
        exc.param = f"items[{origin[position]}]" if origin[position] is not None else "items"
        raise


def _prorations(plan: ChangePlan) -> list[ProrationLine]:
    """Credit the unused time of every item removed or changed, charge the remaining time of every item added or
    changed (each line rounded once, :func:`billing.services.proration.prorate`)."""
    if plan.period is None:
        return []
    start, end = plan.period
    remaining_s, period_s = remaining_share(start, end, plan.at)
    if remaining_s == 0:
        return []
    after_by_id = {item.id: item for item in plan.after if item.id}
    lines = []

    def line(words: str, price: Price, quantity: int, sign: int) -> None:
        # A metered item is billed in arrears by its usage: nothing of it is prorated (as Stripe).
        full = sign * quantity * (0 if price.is_metered else price.amount)
        name = price.nickname or "Subscription"
        lines.append(
            ProrationLine(
                f"{words} {quantity} × {name} after {_day(plan.at)}",
                price,
                quantity,
                prorate(full, remaining_s, period_s),
                plan.at,
                end,
                full,
                remaining_s,
                period_s,
            )
        )

    for item in plan.before:
        kept = after_by_id.get(item.id)
        if kept is not None and (kept.price.id, kept.quantity) == (item.price_id, item.quantity):
            continue
        line("Unused time on", item.price, item.quantity, -1)
        if kept is not None:
            line("Remaining time on", kept.price, kept.quantity, 1)
    for item in plan.after:
        if item.id is None:
            line("Remaining time on", item.price, item.quantity, 1)
    return lines


def plan_change(
    sub: Subscription,
    requested: list[dict] | None,
    *,
    proration_behavior: str = CREATE_PRORATIONS,
    proration_date: int | None = None,
) -> ChangePlan:
    """Compute a change of ``sub`` (its price loaded) without writing anything.

    ``requested``: Stripe's update ``items`` (``{"id", "price", "quantity", "deleted"}``; None: no
    change of items). ``proration_date`` (unix seconds) fixes the instant prorated for (a preview's),
    which must lie in the same invoiced period as now. Raises :class:`InvalidRequestError` and
    :class:`NotFoundError` naming the field.
    """
    now = whole_seconds(billing_now(sub.test_clock))
    before = list(sub.items.select_related("price").order_by("created_at", "id"))
    at = now
    period = invoiced_period(sub, now)
    if proration_date is not None:
        at = datetime.fromtimestamp(proration_date, UTC)
        if period is not None and not (period[0] <= at <= now):
            raise InvalidRequestError(
                "proration_date must lie in the current billing period and not after now.",
                code="proration_date_out_of_range",
                param="proration_date",
            )
    after = (
        _resolve(sub, before, requested)
        if requested is not None
        else [ItemAfter(i.id, i.price, i.quantity) for i in before]
    )
    plan = ChangePlan(sub, at, before, after, period)
    if proration_behavior != NONE:
        plan.prorations = _prorations(plan)
    return plan


PERIOD_END = "period_end"


def change_key(plan: ChangePlan) -> str:
    """The identity of a change invoiced at once: its subscription, instant and resulting items, hashed."""
    body = json.dumps([plan.subscription.id, plan.at.isoformat(), [(i.id, i.price.id, i.quantity) for i in plan.after]])
    return f"{plan.subscription.id}:change:{hashlib.sha256(body.encode()).hexdigest()[:32]}"


def change_subscription(
    *,
    tenant_id: str,
    livemode: bool,
    subscription_id: str,
    items: list[dict] | None,
    proration_behavior: str = CREATE_PRORATIONS,
    proration_date: int | None = None,
    effective_at: str = "immediately",
    billing_cycle_anchor: str = ANCHOR_UNCHANGED,
    coupon: object = KEEP,
    coupon_param: str = "coupon",
    request_key: str | None = None,
) -> tuple[Subscription, Invoice | None]:
    """Apply a change of items to a subscription; returns it and, for ``always_invoice``, its invoice (charged).

    ``billing_cycle_anchor="now"`` restarts the billing cycle at the change's instant instead
    (:func:`restart_cycle`; its invoice is returned).

    Writes the items, the proration items (pending, or on the change's own invoice) and
    ``subscription.updated`` with ``previous_attributes.items``, in one transaction under the
    subscription's row lock; then charges an ``always_invoice`` invoice
    (:func:`billing.services.invoices.pay_invoice`). ``effective_at="period_end"`` prorates nothing and
    stores the items on the subscription (``scheduled_items``) for the next cycle invoice, whose close
    applies them (:func:`billing.services.items.apply_scheduled_locked`); a later change replaces a scheduled one.
    ``coupon`` (a coupon id, or None to delete the discount; :data:`~billing.services.discounts.KEEP`: leave it)
    is applied first, in the same transaction (``coupon_param`` names it in a refusal). ``request_key``: the
    request's ``Idempotency-Key``, if any; an ``always_invoice`` change run again under it after its first run
    died having committed (the idempotency layer lets a dead request's key be taken over) charges the first
    run's invoice if it was not charged and changes nothing again (:func:`request_change_key`,
    docs/decisions/0196). Raises :class:`NotFoundError`,
    :class:`InvalidRequestError` (see :func:`plan_change`, and a coupon that cannot be redeemed) and
    :class:`StateConflictError` (a canceled subscription).
    """
    if billing_cycle_anchor == ANCHOR_NOW:
        if coupon is not KEEP:
            _refuse_restart(
                "Send a discount and a restart of the billing cycle as separate requests.",
                code="billing_cycle_anchor_conflict",
            )
        return restart_cycle(
            tenant_id=tenant_id,
            livemode=livemode,
            subscription_id=subscription_id,
            items=items,
            proration_behavior=proration_behavior,
            proration_date=proration_date,
            effective_at=effective_at,
            request_key=request_key,
        )
    if effective_at == PERIOD_END:
        _refuse_period_end_conflicts(proration_behavior, proration_date)
    if request_key is not None and proration_behavior == ALWAYS_INVOICE:
        with transaction.atomic():
            sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
            earlier = _earlier_change_invoice(sub, request_key, items)
        if earlier is not None:
            return _finish_earlier_change(sub, earlier)
    with transaction.atomic():
        sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
        if sub.status == Subscription.CANCELED:
            raise StateConflictError(f"Subscription '{sub.id}' is canceled.", code="subscription_canceled")
        if coupon is not KEEP and items is not None and effective_at != PERIOD_END and _has_metered(sub):
            # The usage billed below takes the ingest lock, which must come before the discount's customer lock.
            usage_hold_locked()
        if coupon is not KEEP:
            set_subscription_discount_locked(sub, coupon, at=billing_now(sub.test_clock), param=coupon_param)
        if effective_at == PERIOD_END:
            plan = plan_change(sub, items, proration_behavior=NONE)
            previous_schedule = sub.scheduled_items
            sub.scheduled_items = [
                {"id": item.id, "price": item.price.id, "quantity": item.quantity} for item in plan.after
            ]
            sub.save(update_fields=["scheduled_items", "updated_at"])
            ceilings.check_next_invoice(sub, param="items")
            data = subscription_data(sub)
            data["previous_attributes"] = {"scheduled_change": scheduled_change_data(sub, previous_schedule)}
            emit_for(sub, "subscription.updated", data, created_at=billing_now(sub.test_clock))
            return sub, None
        if sub.scheduled_items is not None:  # an immediate change replaces a scheduled one
            sub.scheduled_items = None
            sub.save(update_fields=["scheduled_items", "updated_at"])
        plan = plan_change(sub, items, proration_behavior=proration_behavior, proration_date=proration_date)
        now = billing_now(sub.test_clock)
        cut = whole_seconds(now)
        previous = [subscription_item_data(item) for item in plan.before]
        usage_items = _write_usage_until(sub, _usage_ended(plan), cut, now)
        write_items_locked(sub, plan, now, usage_since=cut)
        proration_items = _write_prorations(sub, plan, now) + usage_items
        invoice = None
        if proration_behavior == ALWAYS_INVOICE and proration_items:
            invoice = _invoice_now(sub, plan, proration_items, now, request_key=request_key)
        # Refused after the writes, in their transaction: the whole change rolls back (docs/decisions/0198).
        ceilings.check_next_invoice(sub, param="items")
        data = subscription_data(sub)
        if data["items"]["data"] != previous:
            data["previous_attributes"] = {"items": {"object": "list", "data": previous}}
            emit_for(sub, "subscription.updated", data, created_at=now)
    if invoice is not None and invoice.status == Invoice.OPEN:
        try:
            invoice, _attempt, _outcome = pay_invoice(invoice.id, tenant_id=tenant_id, livemode=livemode)
        except (InvoiceStateError, PaymentInFlight):
            # The reconciler took it first (on a test clock it need not wait): one charge is being made, or made.
            invoice.refresh_from_db()
    sub.refresh_from_db()
    return sub, invoice


def request_change_key(subscription_id: str, request_key: str) -> str:
    """The ``change_key`` of the invoice of a change requested under ``Idempotency-Key`` ``request_key``."""
    digest = hashlib.sha256(json.dumps([subscription_id, request_key]).encode()).hexdigest()[:32]
    return f"{subscription_id}:request:{digest}"


def _earlier_change_invoice(sub: Subscription, request_key: str, items: list[dict] | None) -> Invoice | None:
    """The invoice an earlier run of this request (same ``Idempotency-Key``, which the idempotency layer lets run
    again only once that run died mid-way) made, when the change it asks for is what the subscription has now and
    that invoice's period is not over; else None (the request is new, or the state moved on since: run it)."""
    if not _in_effect(sub, items):
        return None
    return (
        Invoice.objects.filter(
            subscription_id=sub.id,
            change_key=request_change_key(sub.id, request_key),
            period_end__gt=whole_seconds(billing_now(sub.test_clock)),
        )
        .exclude(status=Invoice.VOID)
        .first()
    )


def _in_effect(sub: Subscription, requested: list[dict] | None) -> bool:
    """Whether ``sub``'s items are already what ``requested`` (an update's ``items``) asks for: each named item has
    the price and quantity asked (a deleted one is gone), each new item's price is there at the quantity asked.
    (Re-planning would not do: a new item asked for again is a duplicate price.)"""
    current = {item.id: item for item in sub.items.all()}
    by_price = {item.price_id: item for item in current.values()}
    for entry in requested or []:
        if entry.get("id") is None:
            item = by_price.get(entry.get("price"))
            if item is None or item.quantity != (entry.get("quantity") or 1):
                return False
            continue
        item = current.get(entry["id"])
        if entry.get("deleted"):
            if item is not None:
                return False
            continue
        if item is None or (entry.get("price") or item.price_id) != item.price_id:
            return False
        if (entry.get("quantity") or item.quantity) != item.quantity:
            return False
    return True


def _finish_earlier_change(sub: Subscription, invoice: Invoice) -> tuple[Subscription, Invoice]:
    """Answer a retried change whose first run committed and died: charge its invoice if that run never reached
    the charge (open, no attempt), else leave it as it stands (charged, or in flight: the reconciler's). Nothing is
    changed again and nothing emitted. docs/decisions/0196."""
    if invoice.status == Invoice.OPEN and not invoice.payment_attempts.exists():
        try:
            invoice, _attempt, _outcome = pay_invoice(invoice.id, tenant_id=sub.tenant_id, livemode=sub.livemode)
        except (InvoiceStateError, PaymentInFlight):
            invoice.refresh_from_db()  # the reconciler took it meanwhile: one charge is being made, or made
    sub.refresh_from_db()
    return sub, invoice


def _refuse_period_end_conflicts(proration_behavior: str, proration_date: int | None) -> None:
    """``effective_at=period_end`` prorates nothing and invoices nothing now: a ``proration_date`` or ``always_invoice``
    asks for what it cannot do, so the request is refused (422 ``effective_at_conflict`` naming that parameter)
    rather than half-honoured. docs/decisions/0197."""
    if proration_date is not None:
        raise InvalidRequestError(
            "effective_at=period_end prorates nothing; proration_date cannot be given with it.",
            code="effective_at_conflict",
            param="proration_date",
        )
    if proration_behavior == ALWAYS_INVOICE:
        raise InvalidRequestError(
            "effective_at=period_end invoices nothing now; proration_behavior=always_invoice cannot be given with it.",
            code="effective_at_conflict",
            param="proration_behavior",
        )


def _has_metered(sub: Subscription) -> bool:
    return sub.items.filter(price__usage_type=Price.METERED).exists()


def _usage_ended(plan: ChangePlan) -> list[SubscriptionItem]:
    """The metered items whose usage the change ends: removed, or given another price."""
    after = {item.id: item for item in plan.after if item.id}
    return [
        item
        for item in plan.before
        if item.price.is_metered and (item.id not in after or after[item.id].price.id != item.price_id)
    ]


def _write_usage_until(
    sub: Subscription, items: list[SubscriptionItem], at: datetime, now: datetime
) -> list[InvoiceItem]:
    """The usage of ``items`` up to ``at`` (:func:`billing.services.usage.usage_until_locked`) as pending invoice
    items of ``sub``, billed by its next invoice (or the change's own, ``always_invoice``). docs/decisions/0170."""
    pending = [
        InvoiceItem(
            tenant_id=sub.tenant_id,
            livemode=sub.livemode,
            customer_id=sub.customer_id,
            subscription=sub,
            amount=line.amount,
            currency=line.currency,
            description=line.description,
            price_id=line.price_id,
            quantity=line.quantity,
            proration=False,
            period_start=line.period_start,
            period_end=line.period_end,
            created_at=now,
        )
        for line in usage_until_locked(sub, items, at)
    ]
    InvoiceItem.objects.bulk_create(pending)
    return pending


def _refuse_restart(
    message: str, *, code: str = "billing_cycle_anchor_unavailable", param: str = "billing_cycle_anchor"
) -> NoReturn:
    raise InvalidRequestError(message, code=code, param=param)


def _restartable_period(sub: Subscription, at: datetime) -> tuple[datetime, datetime]:
    """The current period ``[start, end)`` that a restart at ``at`` cuts short; raises :class:`InvalidRequestError`
    (``billing_cycle_anchor_unavailable``/``_conflict``) when the subscription's state leaves no clear answer."""
    if sub.status == Subscription.TRIALING:
        _refuse_restart("A trialing subscription's cycle starts when its trial ends; end the trial first.")
    if sub.cancel_at_period_end:
        _refuse_restart(
            "The subscription cancels at its period end; a restarted cycle would move that end.",
            code="billing_cycle_anchor_conflict",
        )
    if collection_paused(sub, now=at):
        _refuse_restart("Collection is paused: a restarted cycle's invoice could not be charged now; resume first.")
    if sub.items.filter(price__usage_type=Price.METERED).exists():
        # A metered item's usage is billed in arrears for the period its next invoice follows: a cycle cut short
        # would leave the usage of its last days without a period to be billed for.
        _refuse_restart("The subscription has metered items; their usage is billed by full periods only.")
    period = invoiced_period(sub, at)
    if period is None or sub.next_billing_at != period[1]:
        # Not invoiced yet (the first period, or a close that has not happened or failed): there is no paid
        # cycle to cut short, and the period due would be skipped.
        _refuse_restart("The current billing period has not been invoiced yet; try again once it has been.")
    if period[0] == at:
        _refuse_restart("The billing cycle already starts now.")
    return period


def restart_cycle(
    *,
    tenant_id: str,
    livemode: bool,
    subscription_id: str,
    items: list[dict] | None = None,
    proration_behavior: str = CREATE_PRORATIONS,
    proration_date: int | None = None,
    effective_at: str = "immediately",
    request_key: str | None = None,
) -> tuple[Subscription, Invoice]:
    """``billing_cycle_anchor=now``: restart the subscription's billing cycle at the change's instant; returns it and
    the new period's invoice (charged, or as the close left it: declined, waiting for tax).

    Stripe's "Changing the billing cycle anchor" (https://docs.stripe.com/billing/subscriptions/billing-cycle):
    at ``at`` (now, whole seconds, the test clock's time on a clock) the items become ``items`` (as
    :func:`plan_change`), each item the period ``[start, end)`` billed is credited its unused time
    (``-quantity × amount × (end − at) / (end − start)``, one rounding per line,
    :func:`billing.services.proration.prorate`) as a pending proration item, unless ``proration_behavior`` is
    ``none``; ``always_invoice`` is the same as ``create_prorations`` here, the credit being invoiced at once
    either way. The anchor becomes ``at``, and the new period ``[at, at + interval)`` is invoiced in the same
    transaction through the close's insert (the one-per-period UNIQUE index; the invoice sweeps the credit
    and any other pending item, and records the anchor before in ``previous_billing_cycle_anchor``). After
    commit the close charges it (:func:`billing.services.close.close_subscription_period`); a request killed
    in between leaves the period due, and the next drain closes it. docs/decisions/0147-billing-cycle-anchor-now.md.
    ``request_key`` (the request's ``Idempotency-Key``): a run of the request again after its first run died having
    committed closes that run's period if still due and restarts nothing (docs/decisions/0196).

    Raises :class:`InvalidRequestError` (``billing_cycle_anchor_conflict`` with ``effective_at=period_end``,
    a ``proration_date`` or ``cancel_at_period_end``; ``billing_cycle_anchor_unavailable`` in a trial, while
    collection is paused, before the current period is invoiced or at its very start; as :func:`plan_change`),
    :class:`NotFoundError`, :class:`StateConflictError` (canceled).
    """
    if effective_at == PERIOD_END:
        _refuse_restart(
            "billing_cycle_anchor=now restarts the cycle now; it cannot wait for the period end.",
            code="billing_cycle_anchor_conflict",
            param="effective_at",
        )
    if proration_date is not None:
        _refuse_restart(
            "billing_cycle_anchor=now prorates at the restart itself; proration_date cannot be given.",
            code="billing_cycle_anchor_conflict",
            param="proration_date",
        )
    if request_key is not None:
        with transaction.atomic():
            sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
            earlier = _earlier_restart_invoice(sub, request_key, items)
        if earlier is not None:
            # The first run of this request restarted the cycle and died: close its period if still due, no more.
            return _close_restarted(sub, earlier.id, earlier.period_start, billing_now(sub.test_clock))
    with transaction.atomic():
        sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
        if sub.status == Subscription.CANCELED:
            raise StateConflictError(f"Subscription '{sub.id}' is canceled.", code="subscription_canceled")
        now = billing_now(sub.test_clock)
        at = whole_seconds(now)
        _restartable_period(sub, at)
        plan = plan_change(sub, items, proration_behavior=NONE)
        if proration_behavior != NONE:
            # The whole old cycle ends at ``at``: every item's unused time is credited, kept items too; the new
            # items are billed whole by the new period's invoice, so nothing is charged for the rest.
            plan.prorations = _prorations(replace(plan, after=[]))
        previous_items = [subscription_item_data(item) for item in plan.before]
        previous_anchor = sub.billing_cycle_anchor
        sub.scheduled_items = None  # an immediate change replaces a scheduled one
        write_items_locked(sub, plan, now, usage_since=at)
        _write_prorations(sub, plan, now)
        price = sub.price
        sub.billing_cycle_anchor = at
        sub.periods_billed = 0
        sub.next_billing_at = at
        sub.save(
            update_fields=["billing_cycle_anchor", "periods_billed", "next_billing_at", "scheduled_items", "updated_at"]
        )
        start, end = period_bounds(at, price.interval, price.interval_count, 0)
        ceilings.check_next_invoice(sub, param="items")  # the new period's invoice is that invoice
        keyed = request_change_key(sub.id, request_key) if request_key is not None else None
        if keyed is not None and Invoice.objects.filter(change_key=keyed).exists():
            keyed = None  # the key was used before, for an earlier restart long over: this is a new request
        inserted = materialise_period_invoice(
            sub, start, end, now, previous_billing_cycle_anchor=previous_anchor, change_key=keyed
        )
        if inserted is None:  # only a second restart in this same second gets here
            raise StateConflictError(
                f"The billing cycle of subscription '{sub.id}' was restarted at this instant already.",
                code="billing_cycle_anchor_restarted",
            )
        data = subscription_data(sub)
        data["previous_attributes"] = {"billing_cycle_anchor": iso(previous_anchor)}
        if data["items"]["data"] != previous_items:
            data["previous_attributes"]["items"] = {"object": "list", "data": previous_items}
        emit_for(sub, "subscription.updated", data, created_at=now)
        invoice_id = inserted[0].id
    return _close_restarted(sub, invoice_id, at, now)


def _earlier_restart_invoice(sub: Subscription, request_key: str, items: list[dict] | None) -> Invoice | None:
    """The new period's invoice of an earlier run of this restart request (same ``Idempotency-Key``), when the cycle
    it started is still the subscription's, the items are as it left them and its first period is not over; else
    None."""
    if not _in_effect(sub, items):
        return None
    return (
        Invoice.objects.filter(
            subscription_id=sub.id,
            change_key=request_change_key(sub.id, request_key),
            period_start=sub.billing_cycle_anchor,
            period_end__gt=whole_seconds(billing_now(sub.test_clock)),
        )
        .exclude(status=Invoice.VOID)
        .first()
    )


def _close_restarted(sub: Subscription, invoice_id: str, at: datetime, now: datetime) -> tuple[Subscription, Invoice]:
    """Close the first period of a cycle restarted at ``at`` (its invoice ``invoice_id``) unless closed already;
    the subscription and that invoice as the close left them."""
    # The close skips a subscription another transaction holds (SKIP LOCKED): a concurrent request for the
    # same subscription, refused under the lock a moment later, may hold it just then. Try again while the
    # period is still due and its invoice still a draft, so the answer reports the period charged.
    deadline = time.monotonic() + RESTART_CLOSE_WAIT_S
    while True:
        outcome = close_subscription_period(
            sub.id,
            periods_billed=0,
            run=None,
            as_of=now if sub.test_clock_id else None,
            test_clock_id=sub.test_clock_id,
        )
        if outcome.kind != OutcomeKind.SKIPPED or time.monotonic() >= deadline:
            break
        still_due = Subscription.objects.filter(pk=sub.id, periods_billed=0, next_billing_at=at).exists()
        if not still_due or Invoice.objects.filter(pk=invoice_id).exclude(status=Invoice.DRAFT).exists():
            break
        time.sleep(0.05)
    sub.refresh_from_db()
    return sub, Invoice.objects.get(pk=invoice_id)


def _write_prorations(sub: Subscription, plan: ChangePlan, now: datetime) -> list[InvoiceItem]:
    items = [
        InvoiceItem(
            tenant_id=sub.tenant_id,
            livemode=sub.livemode,
            customer_id=sub.customer_id,
            subscription=sub,
            amount=line.amount,
            currency=line.price.currency,
            description=line.description,
            price=line.price,
            quantity=line.quantity,
            proration=True,
            period_start=line.period_start,
            period_end=line.period_end,
            proration_full_amount=line.full_amount,
            proration_remaining_s=line.remaining_s,
            proration_period_s=line.period_s,
            created_at=now,
        )
        for line in plan.prorations
        if line.amount != 0
    ]
    InvoiceItem.objects.bulk_create(items)
    return items


def _invoice_now(
    sub: Subscription, plan: ChangePlan, items: list[InvoiceItem], now: datetime, *, request_key: str | None = None
) -> Invoice:
    """The change's own invoice of ``items`` (just written), finalised. Raises :class:`StateConflictError` when this
    change (same ``change_key``) was invoiced before.

    Its ``change_key`` is the request's (:func:`request_change_key`) when it came with an ``Idempotency-Key`` not used
    for a change invoice of this subscription before, so a retry of the request finds it; else the change's own."""
    key = change_key(plan)
    if request_key is not None:
        keyed = request_change_key(sub.id, request_key)
        if not Invoice.objects.filter(change_key=keyed).exists():
            key = keyed
    amount = sum(item.amount for item in items)
    invoice = Invoice(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        subscription_id=sub.id,
        status=Invoice.DRAFT,
        billing_reason=Invoice.UPDATE,
        change_key=key,
        currency=sub.price.currency,
        period_start=min([plan.at] + [item.period_start for item in items]),
        period_end=plan.period[1] if plan.period else plan.at,
        subtotal=amount,
        total=amount,
        amount_due=max(amount, 0),
        created_at=now,
    )
    row = {f.column: f.get_db_prep_save(getattr(invoice, f.attname), connection) for f in Invoice._meta.concrete_fields}
    if not materialise_invoice(row):
        # The same change (subscription, instant, items) was invoiced already: roll this one back whole, or its
        # proration items would stay pending and be billed a second time.
        raise StateConflictError(
            f"This change of subscription '{sub.id}' has been invoiced already.", code="change_already_invoiced"
        )
    invoice._state.adding = False
    invoice._state.db = connection.alias
    InvoiceItem.objects.filter(pk__in=[item.pk for item in items], invoice__isnull=True).update(invoice=invoice)
    lines = []
    for item in items:
        line = item_line(item)
        line.invoice_id = invoice.id
        lines.append(line)
    InvoiceLineItem.objects.bulk_create(lines)
    invoice_event(invoice, "invoice.created", lines=lines, created_at=now)
    if collection_paused(sub, now=now):
        # Collection is paused: the change's invoice is settled as the pause's behavior settles a period's (Stripe
        # applies pause_collection to every invoice the subscription makes meanwhile), so nothing charges it.
        settle_paused_draft_locked(invoice, PauseBehavior(sub.pause_collection_behavior), now=now)
        return invoice
    finalize_or_pend_locked(invoice, now=now, lines=lines)
    return invoice


def preview_upcoming(
    *,
    tenant_id: str,
    livemode: bool,
    subscription_id: str,
    items: list[dict] | None = None,
    proration_behavior: str = CREATE_PRORATIONS,
    proration_date: int | None = None,
) -> tuple[Invoice, list[InvoiceLineItem]]:
    """The subscription's next invoice, unsaved, with its lines: what the next close would bill after the change
    proposed (``items``, ``proration_behavior``, ``proration_date`` as for :func:`change_subscription`).

    The next period's items (after the proposed change, or a scheduled one), the pending invoice items
    it would sweep and the proposed prorations; tax and the customer's balance as finalising would
    apply them. With ``always_invoice`` it is the change's own invoice (the prorations alone). Writes
    nothing: it runs in a transaction that is rolled back. Raises as :func:`plan_change` does, and
    :class:`StateConflictError` (``no_upcoming_invoice``) for a canceled subscription.
    """
    with transaction.atomic():
        sub = (
            Subscription.objects.select_related("price", "test_clock", "customer")
            .filter(tenant_id=tenant_id, livemode=livemode, pk=subscription_id)
            .first()
        )
        if sub is None:
            raise NotFoundError(f"No such subscription: '{subscription_id}'.", param="subscription")
        if sub.status == Subscription.CANCELED or sub.next_billing_at is None:
            raise StateConflictError(
                f"Subscription '{sub.id}' has no upcoming invoice: it is canceled.", code="no_upcoming_invoice"
            )
        plan = plan_change(sub, items, proration_behavior=proration_behavior, proration_date=proration_date)
        now = billing_now(sub.test_clock)
        prorations = [
            InvoiceLineItem(
                description=line.description,
                price_id=line.price.id,
                quantity=line.quantity,
                amount=line.amount,
                currency=line.price.currency,
                period_start=line.period_start,
                period_end=line.period_end,
                proration=True,
            )
            for line in plan.prorations
            if line.amount != 0
        ]
        price = sub.price
        if items is not None:
            # The change previewed would be refused if its next invoice could not be charged: so is its preview.
            pending = InvoiceItem.objects.filter(pending_for(sub, price.currency))
            ceilings.check_total(
                sum(i.quantity * i.price.amount for i in plan.after if not i.price.is_metered)
                + sum(item.amount for item in pending)
                + (sum(line.amount for line in prorations) if proration_behavior == CREATE_PRORATIONS else 0),
                price.currency,
                param="items",
            )
        if proration_behavior == ALWAYS_INVOICE and prorations:
            lines = prorations
            start, end = plan.at, plan.period[1]
            reason = Invoice.UPDATE
        else:
            start, end = period_bounds(
                sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed
            )
            after = scheduled_items(sub) if items is None else plan.after
            lines = [
                InvoiceLineItem(
                    description=period_description(item.price, item.quantity, start, end),
                    price_id=item.price.id,
                    quantity=item.quantity,
                    amount=item.quantity * item.price.amount,
                    currency=item.price.currency,
                    period_start=start,
                    period_end=end,
                    subscription_item=item.id or "",
                )
                for item in after
                if not item.price.is_metered
            ]
            # The usage of the period under way so far, as its close would bill it (docs/decisions/0166).
            current = list(sub.items.select_related("price").order_by("created_at", "id"))
            lines += usage_lines_for([(sub, current)]).get(sub.id, [])
            pending = InvoiceItem.objects.filter(pending_for(sub, price.currency)).order_by("created_at", "id")
            lines += [item_line(item) for item in pending] + prorations
            reason = Invoice.CYCLE
        amount = sum(line.amount for line in lines)
        invoice = Invoice(
            tenant_id=sub.tenant_id,
            livemode=sub.livemode,
            customer_id=sub.customer_id,
            subscription_id=sub.id,
            status=Invoice.DRAFT,
            billing_reason=reason,
            currency=price.currency,
            period_start=start,
            period_end=end,
            subtotal=amount,
            total=amount,
            amount_due=max(amount, 0),
            created_at=now,
        )
        apply_discount(invoice, lines, discount_for(invoice))
        quote = tax_quote(invoice)
        if quote is not None:
            apply_tax(invoice, quote)
        else:
            invoice.tax_status = Invoice.TAX_PENDING
        set_balance_applied(sub.customer, invoice)
        transaction.set_rollback(True)
    return invoice, lines


def _paid_share(
    credits: list[ProrationLine], sub: Subscription, period: tuple[datetime, datetime] | None
) -> list[ProrationLine]:
    """``credits`` for what was paid: each credit of an item whose line on the period's invoice was discounted is
    recomputed from that line's amount less its discount (docs/reference/discounts.md), rounded once as before."""
    if not credits or period is None:
        return credits
    paid = {
        (line.price_id, line.quantity): line.amount - line.discount_amount
        for line in InvoiceLineItem.objects.filter(
            invoice__subscription_id=sub.id,
            invoice__period_start=period[0],
            invoice__billing_reason=Invoice.CYCLE,
            proration=False,
        ).exclude(invoice__status=Invoice.VOID)
        if line.price_id and line.discount_amount
    }
    for line in credits:
        net = paid.get((line.price.id, line.quantity))
        if net is not None:
            line.full_amount = -net
            line.amount = prorate(line.full_amount, line.remaining_s, line.period_s)
    return credits


def cancel_subscription(
    *, tenant_id: str, livemode: bool, subscription_id: str, at_period_end: bool = False, prorate: bool = False
) -> Subscription:
    """Cancel as :func:`billing.services.catalog.cancel_subscription`; with ``prorate`` (now only), also credit the
    unused time of the invoiced current period to the customer's balance.

    One ledger entry per item, reason ``proration_credit``, each ``quantity × amount × remaining / period``
    rounded once (:func:`billing.services.proration.prorate`), emitted as ``customer.credit_granted``; for an
    item the period's invoice discounted, of what was paid (its line's amount less its discount).
    A cancel now (with or without ``prorate``) also bills the metered items' usage not billed yet, up to the
    cancel's instant, on a final invoice finalised in the same transaction and charged by the reconciler
    (:func:`billing.services.usage.usage_until_locked`, docs/decisions/0170). Raises as the cancel does, and
    :class:`InvalidRequestError` for ``prorate`` with ``at_period_end`` (nothing is unused at the period's end).
    """
    if at_period_end:
        if prorate:
            raise InvalidRequestError(
                "prorate applies to a cancellation now, not at period end.", code="prorate_conflict", param="prorate"
            )
        return catalog_cancel(
            tenant_id=tenant_id, livemode=livemode, subscription_id=subscription_id, at_period_end=True
        )
    with transaction.atomic():
        sub = callers_subscription_locked(tenant_id, livemode, subscription_id)
        now = billing_now(sub.test_clock)
        plan = ChangePlan(sub, whole_seconds(now), [], [], None)
        usage = []
        if sub.status != Subscription.CANCELED:
            plan.before = list(sub.items.select_related("price").order_by("created_at", "id"))
            plan.period = invoiced_period(sub, plan.at)
            # Before any customer row is locked (the ingest lock's order, billing.queries.usage_barrier).
            usage = usage_until_locked(sub, plan.before, plan.at)
        credits = (
            _paid_share([line for line in _prorations(plan) if line.amount < 0], sub, plan.period) if prorate else []
        )
        canceled = catalog_cancel(tenant_id=tenant_id, livemode=livemode, subscription_id=subscription_id)
        if usage:
            window = (min(line.period_start for line in usage), plan.at)
            final_usage_invoice_locked(canceled, usage, window, now, finalize=finalize_or_pend_locked)
        if credits:
            customer = customer_locked(sub.customer_id)
            for line in credits:
                entry = credit_proration_locked(
                    customer,
                    amount=-line.amount,
                    currency=line.price.currency,
                    at=plan.at,
                    description=f"{line.description} (canceled {sub.id})",
                )
                ledger_entry_event(entry, "customer.credit_granted", created_at=plan.at)
    return canceled
