"""Coupons and the discounts that apply them to a customer or a subscription (Stripe's shapes).

docs/reference/discounts.md; docs/decisions/0152-coupons-and-discounts.md, 0153, 0154, 0155.
"""

from django.db import models

from billing.models.choices import WordChoices
from hardcount.ids import id_field
from hardcount.models import TenantScoped


class CouponDuration(WordChoices):
    """How long a discount of the coupon lasts (Stripe's ``duration``): ``once`` (one invoice), ``repeating``
    (``duration_in_months`` of calendar time from the discount's start) or ``forever``."""

    ONCE = "once"
    REPEATING = "repeating"
    FOREVER = "forever"


class Coupon(TenantScoped):
    """A reusable discount: ``percent_off`` (0 < p ≤ 100, two decimals) or ``amount_off`` minor units of
    ``currency`` (exactly one, a CHECK), for ``duration``.

    ``times_redeemed`` counts the discounts made of it; it never passes ``max_redemptions`` (a CHECK,
    behind the conditional increment of :func:`billing.services.discounts.redeem_locked`). A deleted
    coupon (``deleted_at``) is gone from the API and cannot be redeemed; its discounts keep applying,
    as Stripe's do.
    """

    Duration = CouponDuration

    id = id_field("coupon")
    name = models.CharField(max_length=40, blank=True, default="")
    percent_off = models.DecimalField(max_digits=5, decimal_places=2, null=True, blank=True)
    amount_off = models.BigIntegerField(null=True, blank=True)
    currency = models.CharField(max_length=3, blank=True, default="")
    duration = models.CharField(max_length=12, choices=Duration.choices)
    duration_in_months = models.PositiveIntegerField(null=True, blank=True)
    max_redemptions = models.PositiveIntegerField(null=True, blank=True)
    redeem_by = models.DateTimeField(null=True, blank=True)
    times_redeemed = models.PositiveIntegerField(default=0)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(percent_off__gt=0, percent_off__lte=100, amount_off__isnull=True, currency="")
                    | models.Q(percent_off__isnull=True, amount_off__gt=0) & ~models.Q(currency="")
                ),
                name="coupon_percent_xor_amount",
            ),
            models.CheckConstraint(
                condition=models.Q(duration="repeating", duration_in_months__gte=1)
                | (~models.Q(duration="repeating") & models.Q(duration_in_months__isnull=True)),
                name="coupon_repeating_has_months",
            ),
            models.CheckConstraint(
                condition=models.Q(max_redemptions__isnull=True)
                | models.Q(times_redeemed__lte=models.F("max_redemptions")),
                name="coupon_redemptions_within_max",
            ),
        ]
        indexes = [models.Index(fields=["tenant", "livemode", "id"], name="coupon_scope_idx")]

    def __str__(self) -> str:
        return self.name or self.id

    def valid_at(self, at) -> bool:
        """Stripe's ``valid``: not deleted, not redeemed ``max_redemptions`` times, ``redeem_by`` not passed at
        ``at``."""
        return (
            self.deleted_at is None
            and (self.max_redemptions is None or self.times_redeemed < self.max_redemptions)
            and (self.redeem_by is None or self.redeem_by > at)
        )


class Discount(TenantScoped):
    """A coupon applied to a customer (``subscription`` null) or to one of its subscriptions.

    It covers the invoices whose period starts in ``[start, end)`` (``end`` null: no end; deleting it
    sets ``deleted_at`` and brings ``end`` forward, docs/decisions/0154). A ``once`` discount covers
    one invoice only: ``invoice`` is the one it went on, set by the invoice that took it. The
    customer's and the subscription's current discounts are pointed at by ``Customer.discount`` /
    ``Subscription.discount``.
    """

    id = id_field("discount")
    coupon = models.ForeignKey(Coupon, on_delete=models.PROTECT, related_name="discounts")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="+")
    subscription = models.ForeignKey(
        "billing.Subscription", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    start = models.DateTimeField()
    end = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    invoice = models.ForeignKey("billing.Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["customer", "start"], name="discount_customer_idx"),
            models.Index(fields=["subscription", "start"], name="discount_subscription_idx"),
        ]

    def __str__(self) -> str:
        return self.id
