"""Invoices, their line items, and the per-tenant gapless invoice number counter."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import Tenant, TenantScoped


class Invoice(TenantScoped):
    """One invoice per (subscription, billing period), plus the invoices of changes invoiced at once.

    The partial UNIQUE index ``invoice_one_per_period`` on ``(subscription_id,
    period_start)`` excluding voided invoices is the hard guard against double billing,
    whatever the application does. Amounts are minor units of ``currency``:
    ``total = subtotal - total_discount + tax``, ``amount_due = total - credit_applied`` (never
    negative); ``total_discount`` is the sum of the lines' ``discount_amount``, of ``discount``
    (docs/reference/discounts.md). Once finalised (``open``) an invoice's amounts are frozen; every charge
    under its PaymentIntent uses ``amount_due``.
    """

    # Why the invoice exists (Stripe's ``billing_reason``): a period of the subscription, or a change
    # invoiced at once (``proration_behavior=always_invoice``), or none (manual).
    CYCLE, UPDATE, MANUAL = "subscription_cycle", "subscription_update", "manual"
    BILLING_REASON_CHOICES = [(s, s) for s in (CYCLE, UPDATE, MANUAL)]
    DRAFT, OPEN, PAID, VOID, UNCOLLECTIBLE = "draft", "open", "paid", "void", "uncollectible"
    STATUS_CHOICES = [(s, s) for s in (DRAFT, OPEN, PAID, VOID, UNCOLLECTIBLE)]
    TAX_NOT_APPLICABLE, TAX_CALCULATED, TAX_PENDING = "not_applicable", "calculated", "pending"
    TAX_STATUS_CHOICES = [(s, s) for s in (TAX_NOT_APPLICABLE, TAX_CALCULATED, TAX_PENDING)]

    id = id_field("invoice")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="invoices")
    subscription = models.ForeignKey(
        "billing.Subscription", null=True, blank=True, on_delete=models.PROTECT, related_name="invoices"
    )
    # Gapless per (tenant, mode), assigned when the invoice is finalised; null while draft.
    number = models.CharField(max_length=32, null=True, blank=True)
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=DRAFT)
    billing_reason = models.CharField(max_length=24, choices=BILLING_REASON_CHOICES, default=CYCLE)
    # A change invoiced at once: the change's own id (``subscription_update`` invoices), UNIQUE, so one
    # change makes one invoice however often it is retried.
    change_key = models.CharField(max_length=80, null=True, blank=True, unique=True)
    # The invoice of the first period of a cycle restarted by ``billing_cycle_anchor=now`` (docs/decisions/0147):
    # the anchor the subscription had before. Null on every other invoice. The periods before this invoice are
    # on that anchor's cycle, so the doctor can still check each against its own cycle.
    previous_billing_cycle_anchor = models.DateTimeField(null=True, blank=True)
    currency = models.CharField(max_length=3)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    subtotal = models.BigIntegerField(default=0)
    # The discount the invoice took (docs/reference/discounts.md) and its amount over all lines.
    discount = models.ForeignKey("billing.Discount", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    total_discount = models.BigIntegerField(default=0)
    tax = models.BigIntegerField(default=0)
    tax_rate_bps = models.PositiveIntegerField(default=0)
    tax_status = models.CharField(max_length=16, choices=TAX_STATUS_CHOICES, default=TAX_NOT_APPLICABLE)
    credit_applied = models.BigIntegerField(default=0)
    total = models.BigIntegerField(default=0)
    amount_due = models.BigIntegerField(default=0)
    amount_paid = models.BigIntegerField(default=0)
    # Stripe's fields: the non-void credit notes issued while open (they reduced amount_due) and after payment.
    pre_payment_credit_notes_amount = models.BigIntegerField(default=0)
    post_payment_credit_notes_amount = models.BigIntegerField(default=0)
    # Stripe PaymentIntent for this invoice: one per invoice, created under a key derived
    # from the invoice id.
    payment_intent_id = models.CharField(max_length=255, blank=True, default="")
    attempt_count = models.PositiveIntegerField(default=0)
    # The billing time the invoice was created at: the wall clock, or its test clock.
    created_at = models.DateTimeField(default=timezone.now)
    finalized_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    marked_uncollectible_at = models.DateTimeField(null=True, blank=True)
    # The hosted invoice page's token is signed over (id, this number): rotating the URL adds one, which
    # revokes every earlier token (billing/hosted.py, docs/decisions/0161).
    hosted_url_version = models.PositiveIntegerField(default=0)
    # Why a draft is held for an operator instead of being finalised and charged: ``amount_too_large`` (a usage
    # line or the total beyond what one PaymentIntent can take, docs/decisions/0217); empty for every other invoice.
    hold_reason = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "period_start"],
                condition=~models.Q(status="void") & models.Q(billing_reason="subscription_cycle"),
                name="invoice_one_per_period",
            ),
            models.UniqueConstraint(fields=["tenant", "livemode", "number"], name="invoice_number_unique"),
            models.CheckConstraint(condition=models.Q(amount_due__gte=0), name="invoice_amount_due_nonnegative"),
            # The hard guard under the credit-note service's locked check (docs/decisions/0156).
            models.CheckConstraint(
                condition=models.Q(pre_payment_credit_notes_amount=0, post_payment_credit_notes_amount=0)
                | models.Q(
                    pre_payment_credit_notes_amount__gte=0,
                    post_payment_credit_notes_amount__gte=0,
                    total__gte=models.F("pre_payment_credit_notes_amount")
                    + models.F("post_payment_credit_notes_amount"),
                ),
                name="invoice_credit_notes_within_total",
            ),
            models.CheckConstraint(
                condition=models.Q(total=models.F("subtotal") - models.F("total_discount") + models.F("tax")),
                name="invoice_total_is_subtotal_less_discount_plus_tax",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "livemode", "status"], name="invoice_status_idx"),
            models.Index(
                fields=["tax_status"], name="invoice_tax_pending_idx", condition=models.Q(tax_status="pending")
            ),
            # The operators' admin (docs/decisions/0110): the status filter newest first, and search by
            # number or PaymentIntent across tenants.
            models.Index(fields=["status", "id"], name="invoice_admin_status_idx"),
            models.Index(fields=["number"], name="invoice_number_idx"),
            models.Index(fields=["payment_intent_id"], name="invoice_payment_intent_idx"),
        ]

    def __str__(self) -> str:
        return self.number or self.id


class InvoiceLineItem(models.Model):
    """One line of an invoice: ``amount`` minor units of the invoice's currency."""

    id = id_field("line_item")
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    description = models.CharField(max_length=500)
    price = models.ForeignKey("billing.Price", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    quantity = models.PositiveIntegerField(default=1)
    amount = models.BigIntegerField()
    # The invoice's discount on this line, same sign as ``amount`` and never larger (docs/decisions/0153).
    discount_amount = models.BigIntegerField(default=0)
    currency = models.CharField(max_length=3)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    # Where the line comes from: a subscription item (its id; items may be deleted later) or a pending
    # invoice item (UNIQUE: an item is on one line at most, docs/decisions/0142).
    subscription_item = models.CharField(max_length=40, blank=True, default="")
    invoice_item = models.OneToOneField(
        "billing.InvoiceItem", null=True, blank=True, on_delete=models.PROTECT, related_name="line"
    )
    proration = models.BooleanField(default=False)

    class Meta:
        ordering = ["id"]  # ids are time-ordered: the order the close wrote the lines in


class InvoiceCounter(models.Model):
    """The last invoice number issued per (tenant, mode). Incremented under a row lock in
    the finalising transaction, so numbers are gapless."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    livemode = models.BooleanField()
    last_number = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "livemode"], name="invoice_counter_unique")]
