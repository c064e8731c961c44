"""Payment attempts: every call to the gateway for an invoice, kept as durable history."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class PaymentAttempt(TenantScoped):
    """One charge attempt of ``amount`` minor units of ``currency`` for an invoice.

    ``attempt_number`` counts the invoice's attempts from 1; the idempotency key under
    which the attempt reached the gateway is derived from the invoice and that number
    (see :mod:`billing.gateway`). ``outcome``: ``succeeded``, ``declined`` (a card
    error, ``decline_code`` set), ``unknown`` (timeout or lost response: resolved later
    by retrieving the PaymentIntent) or ``error`` (the gateway refused or failed).
    ``settled_without_charge`` marks zero-amount and below-minimum invoices settled
    without a call.
    """

    SUCCEEDED, DECLINED, UNKNOWN, ERROR = "succeeded", "declined", "unknown", "error"
    OUTCOME_CHOICES = [(s, s) for s in (SUCCEEDED, DECLINED, UNKNOWN, ERROR)]

    id = id_field("payment_attempt")
    invoice = models.ForeignKey("billing.Invoice", on_delete=models.PROTECT, related_name="payment_attempts")
    attempt_number = models.PositiveIntegerField()
    payment_intent_id = models.CharField(max_length=255, blank=True, default="")
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    payment_method = models.CharField(max_length=255, blank=True, default="")
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    outcome = models.CharField(max_length=16, choices=OUTCOME_CHOICES)
    decline_code = models.CharField(max_length=100, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    # HTTP status of the gateway's answer (None: no answer, or no call). With ``outcome``
    # it decides whether the next try re-sends this attempt under its own key
    # (see :func:`billing.gateway.is_transient_status`).
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    settled_without_charge = models.BooleanField(default=False)
    started_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            # The reconciler's scan for payments whose outcome is still unknown.
            models.Index(
                fields=["started_at"],
                name="payment_attempt_unresolved_idx",
                condition=models.Q(outcome__in=["unknown", "error"]),
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "attempt_number"], name="payment_attempt_number_unique"),
            # At most one successful charge per invoice.
            models.UniqueConstraint(
                fields=["invoice"], condition=models.Q(outcome="succeeded"), name="payment_attempt_one_success"
            ),
        ]
