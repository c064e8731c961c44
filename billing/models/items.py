"""Subscription items (what a subscription bills each period) and pending invoice items (one-off amounts).

Shapes follow Stripe's (https://docs.stripe.com/api/subscription_items,
https://docs.stripe.com/api/invoiceitems); docs/decisions/0140-subscription-items.md and
0142-pending-invoice-items.md.
"""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class SubscriptionItem(TenantScoped):
    """One price at a quantity on a subscription: each period bills ``quantity × price.amount`` minor units.

    Every item of a subscription shares its currency and billing interval (checked when items are
    written, :mod:`billing.services.changes`); a price appears at most once per subscription, as in
    Stripe. ``quantity`` ≥ 1 (a CHECK constraint).
    """

    id = id_field("subscription_item")
    subscription = models.ForeignKey("billing.Subscription", on_delete=models.CASCADE, related_name="items")
    price = models.ForeignKey("billing.Price", on_delete=models.PROTECT, related_name="+")
    quantity = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(default=timezone.now)
    # A metered item's usage before this instant is not its own to bill (null: no bound): it was billed by a
    # change that re-priced the item, or the item was added then (docs/decisions/0170).
    usage_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(quantity__gte=1), name="subscription_item_quantity_positive"),
            # Deferred: a change may swap two items' prices in one transaction.
            models.UniqueConstraint(
                fields=["subscription", "price"],
                name="subscription_item_one_per_price",
                deferrable=models.Deferrable.DEFERRED,
            ),
        ]

    def __str__(self) -> str:
        return self.id


class InvoiceItem(TenantScoped):
    """A pending amount for a customer's next invoice (that subscription's, when ``subscription`` is set).

    ``amount`` is signed minor units of ``currency`` (negative: a credit). ``invoice`` is set
    once, when an invoice sweeps the item, under the item's row lock and only while it is null;
    the invoice line made from it points back to it through a UNIQUE column, so an item is billed
    at most once whatever races for it. ``proration`` items come from a subscription change
    (:mod:`billing.services.changes`) and cover ``[period_start, period_end)``; their amount is
    ``proration_full_amount × proration_remaining_s / proration_period_s`` rounded once
    (:func:`billing.services.proration.prorate`), its inputs recorded on the item.
    """

    id = id_field("invoice_item")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="invoice_items")
    subscription = models.ForeignKey(
        "billing.Subscription", null=True, blank=True, on_delete=models.PROTECT, related_name="invoice_items"
    )
    invoice = models.ForeignKey(
        "billing.Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="invoice_items"
    )
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    description = models.CharField(max_length=500, blank=True, default="")
    price = models.ForeignKey("billing.Price", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    quantity = models.PositiveIntegerField(default=1)
    proration = models.BooleanField(default=False)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    # A proration's inputs (docs/decisions/0146): ``amount = prorate(proration_full_amount,
    # proration_remaining_s, proration_period_s)``, recorded so the doctor can recompute it; null otherwise.
    proration_full_amount = models.BigIntegerField(null=True, blank=True)
    proration_remaining_s = models.BigIntegerField(null=True, blank=True)
    proration_period_s = models.BigIntegerField(null=True, blank=True)
    # The billing time it was created at (the wall clock, or the customer's test clock).
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            # The sweep: a customer's items not yet on an invoice.
            models.Index(
                fields=["customer", "created_at"],
                name="invoice_item_pending_idx",
                condition=models.Q(invoice__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return self.id
