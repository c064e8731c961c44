"""An invoice's lines: one per subscription item for the period, one per pending invoice item swept in.

The per-close path (:mod:`billing.services.close`) and the page close (:mod:`billing.services.page`)
build lines here, the page close for a whole page from one query over the items
(:func:`items_by_subscription`). docs/decisions/0140-subscription-items.md,
0142-pending-invoice-items.md.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from django.db import connection
from django.db.models import Q

from billing.models import Invoice, InvoiceItem, InvoiceLineItem, Price, Subscription, SubscriptionItem


def items_by_subscription(subscription_ids) -> dict[str, list[SubscriptionItem]]:
    """The items of each subscription of ``subscription_ids``, with their prices, oldest first: one query."""
    found: dict[str, list[SubscriptionItem]] = defaultdict(list)
    rows = (
        SubscriptionItem.objects.filter(subscription_id__in=list(subscription_ids))
        .select_related("price")
        .order_by("subscription_id", "created_at", "id")
    )
    for item in rows:
        found[item.subscription_id].append(item)
    return found


def period_description(price: Price, quantity: int, start: datetime, end: datetime) -> str:
    """``"3 × Pro (Jan 1, 2027 – Feb 1, 2027)"``: quantity, the price's nickname, the period in UTC dates."""
    name = price.nickname or "Subscription"
    return f"{quantity} × {name} ({_day(start)} – {_day(end)})"


def _day(at: datetime) -> str:
    return f"{at:%b} {at.day}, {at.year}"


def period_lines(
    sub: Subscription, items: list[SubscriptionItem], start: datetime, end: datetime
) -> list[InvoiceLineItem]:
    """The unsaved lines of ``sub``'s period ``[start, end)``: ``quantity × price.amount`` minor units per item
    billed in advance (a metered item's usage is billed in arrears, :mod:`billing.services.usage`).

    Raises ``ValueError`` for a subscription without items (every writer gives it one at least).
    """
    if not items:
        raise ValueError(f"subscription {sub.id} has no items")
    return [
        InvoiceLineItem(
            description=period_description(item.price, item.quantity, start, end),
            price_id=item.price_id,
            quantity=item.quantity,
            amount=item.quantity * item.price.amount,
            currency=item.price.currency,
            period_start=start,
            period_end=end,
            subscription_item=item.id,
        )
        for item in items
        if not item.price.is_metered
    ]


def item_line(item: InvoiceItem) -> InvoiceLineItem:
    """The unsaved line of a pending invoice item (its signed ``amount``, its own period)."""
    return InvoiceLineItem(
        description=item.description,
        price_id=item.price_id,
        quantity=item.quantity,
        amount=item.amount,
        currency=item.currency,
        period_start=item.period_start,
        period_end=item.period_end,
        invoice_item=item,
        proration=item.proration,
    )


def pending_for(sub: Subscription, currency: str) -> Q:
    """The pending invoice items an invoice of ``sub`` takes: its customer's, in ``currency``, not yet on an
    invoice, and either of this subscription or of none."""
    return Q(customer_id=sub.customer_id, currency=currency, invoice__isnull=True) & (
        Q(subscription_id=sub.id) | Q(subscription__isnull=True)
    )


def sweep_pending_locked(invoice: Invoice, sub: Subscription) -> list[InvoiceLineItem]:
    """Take ``sub``'s pending invoice items onto ``invoice`` (a draft this transaction wrote): their lines, saved.

    Each item is locked (``FOR UPDATE`` of the item, after the invoice in the lock order) and its
    ``invoice_id`` set only while still null, so an item another sweep took meanwhile is passed over;
    the line's UNIQUE ``invoice_item_id`` is the last guard. Adds the lines' amounts to the invoice's
    ``subtotal`` and ``total`` in memory (``amount_due`` = the total, 0 at least) (the caller saves them).
    """
    candidates = list(
        InvoiceItem.objects.select_for_update(of=("self",))
        .filter(pending_for(sub, invoice.currency))
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    if not candidates:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE billing_invoiceitem SET invoice_id = %s WHERE id = ANY(%s) AND invoice_id IS NULL RETURNING id",
            [invoice.id, candidates],
        )
        taken = sorted(row[0] for row in cursor.fetchall())
    lines = []
    for item in InvoiceItem.objects.filter(pk__in=taken).order_by("created_at", "id"):
        line = item_line(item)
        line.invoice_id = invoice.id
        lines.append(line)
    InvoiceLineItem.objects.bulk_create(lines)
    added = sum(line.amount for line in lines)
    invoice.subtotal += added
    invoice.total += added
    invoice.amount_due = max(invoice.total, 0)  # a draft's; finalising applies the balance (and a negative total)
    return lines


def customers_with_pending(customer_ids) -> set[str]:
    """Which of ``customer_ids`` have pending invoice items (one query): their closes take the per-close path."""
    return set(
        InvoiceItem.objects.filter(customer_id__in=list(customer_ids), invoice__isnull=True)
        .values_list("customer_id", flat=True)
        .distinct()
    )
