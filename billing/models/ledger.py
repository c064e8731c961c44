"""The customer credit ledger: append-only entries with the balance after each."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class LedgerEntry(TenantScoped):
    """One change to a customer's credit balance; rows are never updated or deleted.

    ``amount`` is signed minor units of ``currency``: positive grants credit, negative
    consumes it (applied to an invoice) or records a debit (a below-minimum amount
    carried forward). ``balance_after`` equals the customer's ``credit_balance`` right
    after this entry; every write locks the customer row first (``SELECT … FOR UPDATE``).
    """

    GRANT, APPLIED, CARRIED_DEBIT, ADJUSTMENT = "grant", "applied_to_invoice", "carried_debit", "adjustment"
    # The unused time of a subscription canceled with ``prorate`` (docs/decisions/0141).
    PRORATION_CREDIT = "proration_credit"
    # A credit note's ``credit_amount`` (positive), or its reversal when the credit note is voided (negative).
    CREDIT_NOTE = "credit_note"
    REASON_CHOICES = [(s, s) for s in (GRANT, APPLIED, CARRIED_DEBIT, ADJUSTMENT, PRORATION_CREDIT, CREDIT_NOTE)]

    id = id_field("ledger_entry")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="ledger_entries")
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    balance_after = models.BigIntegerField()
    reason = models.CharField(max_length=32, choices=REASON_CHOICES)
    description = models.CharField(max_length=500, blank=True, default="")
    invoice = models.ForeignKey(
        "billing.Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="ledger_entries"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["customer", "created_at"], name="ledger_customer_idx")]
        verbose_name_plural = "ledger entries"
