"""Inbound Stripe events: one row per event a Stripe account's webhook delivered, so each is acted on once."""

from django.db import models
from django.db.models.functions import Now

from hardcount.models import Tenant


class StripeEvent(models.Model):
    """One Stripe event received at ``/stripe/webhooks/<account>`` (docs/reference/payments.md#inbound-stripe-webhooks).

    UNIQUE ``(account, event_id)``: Stripe delivers an event at least once, and a redelivery finds
    its row and changes nothing. ``tenant`` and ``invoice`` are those the event was matched to
    (null when it matched none: an unknown PaymentIntent, an ignored type); a platform account's
    events span tenants, so the row's tenant is the matched invoice's, never the account's.
    ``result`` says what the event came to (:data:`RESULTS`); ``data`` is the event's
    ``data.object`` as delivered, the record of refunds and disputes until they are modelled.
    """

    APPLIED, NO_CHANGE, IGNORED, NO_INVOICE = "applied", "no_change", "ignored", "no_invoice"
    RESULTS = (APPLIED, NO_CHANGE, IGNORED, NO_INVOICE)

    id = models.BigAutoField(primary_key=True)
    account = models.CharField(max_length=100)
    event_id = models.CharField(max_length=255)
    type = models.CharField(max_length=100)
    livemode = models.BooleanField()
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    invoice = models.ForeignKey("billing.Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    payment_intent_id = models.CharField(max_length=255, blank=True, default="")
    result = models.CharField(max_length=16, choices=[(r, r) for r in RESULTS])
    detail = models.TextField(blank=True, default="")
    data = models.JSONField(default=dict)
    # Stripe's ``created`` of the event (its clock), and when it reached us (the database's).
    stripe_created_at = models.DateTimeField(null=True, blank=True)
    received_at = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["account", "event_id"], name="stripe_event_once_per_account"),
        ]
        indexes = [models.Index(fields=["invoice"], name="stripe_event_invoice_idx")]
