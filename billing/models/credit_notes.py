"""Credit notes against finalised invoices, their lines, their refunds, and the per-tenant credit-note counter."""

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import Tenant, TenantScoped


class CreditNote(TenantScoped):
    """One credit note (Stripe's ``credit_note``) of ``total`` minor units of its invoice's currency.

    ``total = subtotal + tax`` and ``total = pre_payment_amount + refund_amount + credit_amount +
    out_of_band_amount`` (CHECK constraints): an ``open`` invoice's credit note is all
    ``pre_payment_amount`` (it reduced ``amount_due``); a ``paid`` invoice's splits between a refund to
    the card, the customer's credit balance (``credit_entry``, a ledger entry) and money returned
    outside Hardcount. The sum of an invoice's non-void credit notes never exceeds its ``total``: every
    writer locks the invoice row first (docs/decisions/0156-credit-notes.md).
    """

    ISSUED, VOID = "issued", "void"
    STATUS_CHOICES = [(s, s) for s in (ISSUED, VOID)]
    PRE_PAYMENT, POST_PAYMENT = "pre_payment", "post_payment"
    TYPE_CHOICES = [(s, s) for s in (PRE_PAYMENT, POST_PAYMENT)]
    DUPLICATE, FRAUDULENT, ORDER_CHANGE, PRODUCT_UNSATISFACTORY = (
        "duplicate",
        "fraudulent",
        "order_change",
        "product_unsatisfactory",
    )
    REASONS = (DUPLICATE, FRAUDULENT, ORDER_CHANGE, PRODUCT_UNSATISFACTORY)
    REASON_CHOICES = [(s, s) for s in REASONS]

    id = id_field("credit_note")
    invoice = models.ForeignKey("billing.Invoice", on_delete=models.PROTECT, related_name="credit_notes")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="credit_notes")
    # Gapless per (tenant, mode), from CreditNoteCounter in the creating transaction.
    number = models.CharField(max_length=32)
    status = models.CharField(max_length=8, choices=STATUS_CHOICES, default=ISSUED)
    type = models.CharField(max_length=16, choices=TYPE_CHOICES)
    reason = models.CharField(max_length=32, choices=REASON_CHOICES, blank=True, default="")
    memo = models.CharField(max_length=500, blank=True, default="")
    currency = models.CharField(max_length=3)
    subtotal = models.BigIntegerField()
    tax = models.BigIntegerField(default=0)
    total = models.BigIntegerField()
    pre_payment_amount = models.BigIntegerField(default=0)
    refund_amount = models.BigIntegerField(default=0)
    credit_amount = models.BigIntegerField(default=0)
    out_of_band_amount = models.BigIntegerField(default=0)
    credit_entry = models.OneToOneField(
        "billing.LedgerEntry", null=True, blank=True, on_delete=models.PROTECT, related_name="credit_note"
    )
    # Who issued it: "api", or "admin:<username>" for an operator in the console.
    created_by = models.CharField(max_length=200, blank=True, default="api")
    # The Idempotency-Key of the API request that issued it ("" for none): a retry of that request that runs again
    # (its first try died before it could answer) finds this credit note instead of issuing, and refunding, twice.
    request_key = models.CharField(max_length=255, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    voided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "livemode", "number"], name="credit_note_number_unique"),
            models.UniqueConstraint(
                fields=["tenant", "livemode", "request_key"],
                condition=~models.Q(request_key=""),
                name="credit_note_one_per_request_key",
            ),
            models.CheckConstraint(condition=models.Q(total__gt=0), name="credit_note_total_positive"),
            models.CheckConstraint(
                condition=models.Q(total=models.F("subtotal") + models.F("tax")),
                name="credit_note_total_is_subtotal_plus_tax",
            ),
            models.CheckConstraint(
                condition=models.Q(pre_payment_amount__gte=0)
                & models.Q(refund_amount__gte=0)
                & models.Q(credit_amount__gte=0)
                & models.Q(out_of_band_amount__gte=0),
                name="credit_note_parts_nonnegative",
            ),
            models.CheckConstraint(
                condition=models.Q(
                    total=models.F("pre_payment_amount")
                    + models.F("refund_amount")
                    + models.F("credit_amount")
                    + models.F("out_of_band_amount")
                ),
                name="credit_note_total_is_its_parts",
            ),
        ]
        indexes = [models.Index(fields=["invoice", "status"], name="credit_note_invoice_idx")]

    def __str__(self) -> str:
        return self.number


class CreditNoteLineItem(models.Model):
    """One line of a credit note: ``amount`` minor units (before tax) credited for one invoice line."""

    id = id_field("credit_note_line_item")
    credit_note = models.ForeignKey(CreditNote, on_delete=models.CASCADE, related_name="lines")
    invoice_line_item = models.ForeignKey(
        "billing.InvoiceLineItem", on_delete=models.PROTECT, related_name="credit_note_lines"
    )
    description = models.CharField(max_length=500, blank=True, default="")
    quantity = models.PositiveIntegerField(null=True, blank=True)
    amount = models.BigIntegerField()

    class Meta:
        ordering = ["id"]
        constraints = [models.CheckConstraint(condition=models.Q(amount__gt=0), name="credit_note_line_positive")]


class CreditNoteCounter(models.Model):
    """The last credit-note number issued per (tenant, mode); incremented under a row lock, so gapless."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    livemode = models.BooleanField()
    last_number = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "livemode"], name="credit_note_counter_unique")]


class Refund(TenantScoped):
    """The refund to the card of one credit note's ``refund_amount`` (``amount`` minor units of ``currency``).

    Written with outcome ``unknown`` in the credit note's transaction, before the gateway is called, under
    the key ``hc:{credit_note}:refund`` derived from the credit note: a process that dies mid-call leaves
    the row, and the next try re-sends under the same key, or, once the key may have expired, looks the
    refund up by its ``hardcount_refund`` metadata first (docs/decisions/0157-refunds.md). ``status`` is
    the gateway refund's (``pending``, ``succeeded``, ``failed``, ``canceled``, ``requires_action``; empty
    until it answered); ``gateway_refund_id`` its ``re_…`` id.
    """

    UNKNOWN, SUCCEEDED, PENDING, FAILED, ERROR = "unknown", "succeeded", "pending", "failed", "error"
    OUTCOME_CHOICES = [(s, s) for s in (UNKNOWN, SUCCEEDED, PENDING, FAILED, ERROR)]

    id = id_field("refund")
    credit_note = models.OneToOneField(CreditNote, on_delete=models.PROTECT, related_name="refund")
    invoice = models.ForeignKey("billing.Invoice", on_delete=models.PROTECT, related_name="refunds")
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    payment_intent_id = models.CharField(max_length=255)
    idempotency_key = models.CharField(max_length=255, unique=True)
    gateway_refund_id = models.CharField(max_length=255, blank=True, default="")
    status = models.CharField(max_length=32, blank=True, default="")
    outcome = models.CharField(max_length=16, choices=OUTCOME_CHOICES, default=UNKNOWN)
    error_message = models.TextField(blank=True, default="")
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    # The database's clock at the INSERT: how old the key is at the gateway (a re-send moves started_at only).
    first_sent_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(amount__gt=0), name="refund_amount_positive")]
        indexes = [
            models.Index(
                fields=["started_at"], name="refund_unresolved_idx", condition=models.Q(outcome__in=["unknown"])
            ),
            models.Index(fields=["gateway_refund_id"], name="refund_gateway_id_idx"),
        ]
