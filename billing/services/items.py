"""A subscription's items as a change leaves them, and a change scheduled for the next period.

Shared by :mod:`billing.services.changes` (which writes changes) and :mod:`billing.services.close`
(which applies a scheduled change when it bills the next period). docs/decisions/0140.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace

from billing.models import Price, Subscription, SubscriptionItem
from billing.representations import subscription_data, subscription_item_data
from outbox.services import emit_for


@dataclass
class ItemAfter:
    """One item as the change leaves it: an existing item's id (None: a new item), its price and quantity."""

    id: str | None
    price: Price
    quantity: int


def write_items_locked(sub: Subscription, plan, now: datetime, *, usage_since: datetime | None = None) -> None:
    """Make ``sub``'s items (subscription locked) ``plan.after`` (a :class:`~billing.services.changes.ChangePlan`,
    ``plan.before`` the items now): delete, re-price or re-quantify, create; ``sub.price`` = the first item's.

    ``usage_since``: the instant up to which a change billed the usage of the items it re-prices, which is also
    where a new item's usage starts (set on those items; docs/decisions/0170)."""
    kept = {item.id for item in plan.after if item.id}
    SubscriptionItem.objects.filter(subscription=sub).exclude(pk__in=kept).delete()
    current = {item.id: item for item in plan.before}
    for item in plan.after:
        if item.id is None:
            SubscriptionItem.objects.create(
                tenant_id=sub.tenant_id,
                livemode=sub.livemode,
                subscription=sub,
                price=item.price,
                quantity=item.quantity,
                created_at=now,
                usage_since=usage_since,
            )
        elif current[item.id].price_id != item.price.id:
            fields = {"price": item.price, "quantity": item.quantity}
            if usage_since is not None:
                fields["usage_since"] = usage_since
            SubscriptionItem.objects.filter(pk=item.id).update(**fields)
        elif current[item.id].quantity != item.quantity:
            SubscriptionItem.objects.filter(pk=item.id).update(quantity=item.quantity)
    first = plan.after[0].price
    if sub.price_id != first.id:
        sub.price = first
        sub.save(update_fields=["price", "updated_at"])


def scheduled_items(sub: Subscription) -> list[ItemAfter]:
    """The items the next cycle invoice of ``sub`` bills: its scheduled change's, else its current items."""
    if not sub.scheduled_items:
        return [ItemAfter(i.id, i.price, i.quantity) for i in sub.items.select_related("price").order_by("created_at")]
    prices = Price.objects.in_bulk([entry["price"] for entry in sub.scheduled_items])
    return [ItemAfter(entry["id"], prices[entry["price"]], entry["quantity"]) for entry in sub.scheduled_items]


def apply_scheduled_locked(sub: Subscription, now: datetime, *, usage_since: datetime | None = None) -> bool:
    """Apply ``sub``'s scheduled change (subscription locked, in the close of its next period); True when one was.

    Writes the items, clears the schedule and emits ``subscription.updated`` with the items before.
    ``usage_since``: the boundary the change takes effect at, where the usage of the items it re-prices or
    adds starts (the close bills the usage before it with the items before: docs/decisions/0173).
    """
    if not sub.scheduled_items:
        return False
    before = list(sub.items.select_related("price").order_by("created_at", "id"))
    plan = SimpleNamespace(before=before, after=scheduled_items(sub))
    previous = [subscription_item_data(item) for item in before]
    write_items_locked(sub, plan, now, usage_since=usage_since)
    sub.scheduled_items = None
    sub.save(update_fields=["scheduled_items", "updated_at"])
    data = subscription_data(sub)
    data["previous_attributes"] = {"items": {"object": "list", "data": previous}}
    emit_for(sub, "subscription.updated", data, created_at=now)
    return True
