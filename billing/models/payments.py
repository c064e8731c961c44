"""Payment attempts: every call to the gateway for an invoice, kept as durable history."""

from django.db import models
from django.db.models.functions import Now
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
    without a call. ``first_sent_at`` is when the attempt's key was first sent (the
    database's clock at the reservation's INSERT; null for attempts reserved before it was recorded) and
    ``payment_intent_status`` the status its PaymentIntent last answered: together they
    decide whether an open attempt may be re-sent under its key or must be looked up
    (docs/reference/billing.md#idempotency-keys-expire).
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
    # Stripe forgets a key 24 hours after its first use: past a safe window the attempt is never
    # re-sent under it (billing.services.payments.must_look_up). The database's clock, set by the
    # INSERT, so a re-send (which moves started_at) cannot make the key look younger.
    first_sent_at = models.DateTimeField(null=True, blank=True, db_default=Now())
    payment_intent_status = models.CharField(max_length=32, blank=True, default="")
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
