"""Customers and prices."""

from django.db import models
from django.db.models.functions import Upper

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class Customer(TenantScoped):
    """A tenant's customer.

    ``credit_balance`` is the ledger's running balance in minor units of ``currency``:
    positive is credit owed to the customer (applied to the next invoices), negative is
    an amount the customer owes (e.g. a below-minimum invoice carried forward, as Stripe
    does). It changes only through ledger writes, which lock this row
    (``SELECT … FOR UPDATE``). ``currency`` is fixed by the first ledger entry or
    subscription.
    """

    id = id_field("customer")
    email = models.EmailField(max_length=254)
    name = models.CharField(max_length=200, blank=True, default="")
    external_id = models.CharField(max_length=200, blank=True, default="")
    # Stripe PaymentMethod id (pm_…) charged off-session for this customer's invoices.
    default_payment_method = models.CharField(max_length=255, blank=True, default="")
    # Stripe Customer id (cus_… at the gateway), created lazily on first charge.
    gateway_customer_id = models.CharField(max_length=255, blank=True, default="")
    # The payment method last attached to the gateway customer; a different default is
    # attached before it is first charged.
    gateway_payment_method = models.CharField(max_length=255, blank=True, default="")
    credit_balance = models.BigIntegerField(default=0)
    currency = models.CharField(max_length=3, blank=True, default="")
    test_clock = models.ForeignKey(
        "billing.TestClock", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    # The customer's current discount (docs/reference/discounts.md); its history is in billing.Discount.
    discount = models.ForeignKey("billing.Discount", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    metadata = models.JSONField(default=dict, blank=True)
    # ``{meter id: ISO instant}``: this customer's usage of the meter before the instant has been billed by a
    # change or an immediate cancel; later events timestamped before it are refused (docs/decisions/0170).
    usage_billed_until = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "livemode", "email"], name="customer_email_idx"),
            models.Index(fields=["tenant", "livemode", "external_id"], name="customer_external_idx"),
            # The operators' admin searches customers across tenants (docs/decisions/0110): by email in
            # any case (``email__iexact`` is ``UPPER(email) = UPPER(…)``), external id and gateway id.
            models.Index(Upper("email"), name="customer_email_upper_idx"),
            models.Index(fields=["external_id"], name="customer_external_id_idx"),
            models.Index(fields=["gateway_customer_id"], name="customer_gateway_id_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.email} ({self.id})"


class Price(TenantScoped):
    """A recurring price: ``amount`` minor units of ``currency`` every ``interval_count`` ``interval``s."""

    DAY, WEEK, MONTH, YEAR = "day", "week", "month", "year"
    INTERVAL_CHOICES = [(DAY, DAY), (WEEK, WEEK), (MONTH, MONTH), (YEAR, YEAR)]
    LICENSED, METERED = "licensed", "metered"
    PER_UNIT, TIERED = "per_unit", "tiered"
    GRADUATED, VOLUME = "graduated", "volume"

    id = id_field("price")
    nickname = models.CharField(max_length=200, blank=True, default="")
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    interval = models.CharField(max_length=8, choices=INTERVAL_CHOICES)
    interval_count = models.PositiveIntegerField(default=1)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Usage-based prices (Stripe's ``recurring.usage_type``, ``billing_scheme``, ``tiers``,
    # ``transform_quantity``; docs/decisions/0166): a metered price bills its meter's quantity of the
    # period that ended, in arrears; ``amount`` is then the per-unit amount (``per_unit``), 0 when tiered.
    usage_type = models.CharField(max_length=8, default=LICENSED, choices=[(LICENSED, LICENSED), (METERED, METERED)])
    meter = models.ForeignKey("billing.Meter", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    billing_scheme = models.CharField(max_length=8, default=PER_UNIT, choices=[(PER_UNIT, PER_UNIT), (TIERED, TIERED)])
    tiers_mode = models.CharField(max_length=10, blank=True, default="")
    # ``[{"up_to": int | None (the last, "inf"), "unit_amount": int, "flat_amount": int}]``, ascending.
    tiers = models.JSONField(null=True, blank=True)
    transform_divide_by = models.PositiveIntegerField(null=True, blank=True)
    transform_round = models.CharField(max_length=4, blank=True, default="")

    @property
    def is_metered(self) -> bool:
        """True for a usage-based price (billed in arrears from its meter)."""
        return self.usage_type == self.METERED

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(usage_type="licensed", meter__isnull=True)
                | models.Q(usage_type="metered", meter__isnull=False),
                name="price_metered_has_meter",
            ),
            models.CheckConstraint(condition=models.Q(amount__gte=0), name="price_amount_nonnegative"),
            models.CheckConstraint(condition=models.Q(interval_count__gte=1), name="price_interval_count_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.amount} {self.currency} / {self.interval_count} {self.interval} ({self.id})"
