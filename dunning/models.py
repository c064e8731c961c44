"""Dunning: retry schedules for declined invoices, and their runs (docs/reference/dunning.md)."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped

# Retry 1, 3, 5 and 7 days after the first decline (docs/reference/dunning.md#schedule).
DEFAULT_RETRY_DAYS = (1, 3, 5, 7)


def default_retry_days() -> list[int]:
    """A fresh list of :data:`DEFAULT_RETRY_DAYS` (a callable default: a shared list would be mutated)."""
    return list(DEFAULT_RETRY_DAYS)


class DunningSettings(TenantScoped):
    """A tenant's dunning policy per mode: retry ``retry_days`` after the first decline,
    then apply ``final_action`` (``unpaid`` or ``canceled``) to the subscription.

    No row means the defaults (:data:`DEFAULT_RETRY_DAYS`, ``unpaid``).
    """

    class FinalAction(models.TextChoices):
        """What the subscription becomes when a run is exhausted (labels are the stored values)."""

        UNPAID = "unpaid", "unpaid"
        CANCELED = "canceled", "canceled"

    UNPAID, CANCELED = FinalAction.UNPAID, FinalAction.CANCELED

    retry_days = models.JSONField(default=default_retry_days)
    final_action = models.CharField(max_length=16, choices=FinalAction.choices, default=UNPAID)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "dunning settings"
        constraints = [models.UniqueConstraint(fields=["tenant", "livemode"], name="dunning_settings_unique")]


class DunningRun(TenantScoped):
    """Retries of one declined invoice (docs/decisions/0070).

    Retry k (1 ≤ k ≤ n = len(``retry_days``)) is due at ``schedule_anchor_at + retry_days[k-1]``
    days; the anchor is the first decline, moved only when a new payment method revives a run
    whose next retry time has passed. ``retries_done`` counts the scheduled retries started;
    ``attempt_started_at`` is set while the latest retry has no definite outcome yet (declined or
    succeeded), so a retry that crashed or met a gateway error is resumed without using up
    another scheduled retry. ``next_attempt_at`` is when the dunning loop next acts on the run:
    a retry, or the end state (exhaustion). A hard decline sets ``waiting_for_payment_method``:
    no charge until the customer's payment method changes, and exhaustion at the last retry's
    time if it never does. ``test_clock`` is the invoice's clock (its runs are due by the clock).
    """

    class Status(models.TextChoices):
        """A run's state; only ``active`` runs are ever due (labels are the stored values)."""

        ACTIVE = "active", "active"
        RECOVERED = "recovered", "recovered"
        EXHAUSTED = "exhausted", "exhausted"
        ENDED = "ended", "ended"

    class EndReason(models.TextChoices):
        """Why a run is no longer active (labels are the stored values)."""

        RETRY_SUCCEEDED = "retry_succeeded", "retry_succeeded"  # recovered by one of its retries
        # Recovered by another payment (POST /v1/invoices/{id}/pay, the reconciler).
        PAID = "paid", "paid"
        RETRIES_EXHAUSTED = "retries_exhausted", "retries_exhausted"
        # A hard decline, and no new payment method before the last retry's time.
        NO_NEW_PAYMENT_METHOD = "no_new_payment_method", "no_new_payment_method"
        VOIDED = "voided", "voided"
        SUBSCRIPTION_CANCELED = "subscription_canceled", "subscription_canceled"
        INVOICE_SETTLED = "invoice_settled", "invoice_settled"  # the invoice left `open` some other way

    # The members again under short names, the way billing's models spell states (``Invoice.OPEN``).
    ACTIVE, RECOVERED, EXHAUSTED, ENDED = Status.ACTIVE, Status.RECOVERED, Status.EXHAUSTED, Status.ENDED
    RETRY_SUCCEEDED, PAID, RETRIES_EXHAUSTED = EndReason.RETRY_SUCCEEDED, EndReason.PAID, EndReason.RETRIES_EXHAUSTED
    NO_NEW_PAYMENT_METHOD, VOIDED = EndReason.NO_NEW_PAYMENT_METHOD, EndReason.VOIDED
    SUBSCRIPTION_CANCELED, INVOICE_SETTLED = EndReason.SUBSCRIPTION_CANCELED, EndReason.INVOICE_SETTLED

    id = id_field("dunning_run")
    invoice = models.OneToOneField("billing.Invoice", on_delete=models.PROTECT, related_name="dunning_run")
    test_clock = models.ForeignKey(
        "billing.TestClock", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=ACTIVE)
    end_reason = models.CharField(max_length=32, choices=EndReason.choices, blank=True, default="")
    first_declined_at = models.DateTimeField()
    # The schedule, frozen when the run starts: days after the anchor, strictly increasing.
    retry_days = models.JSONField(default=default_retry_days)
    schedule_anchor_at = models.DateTimeField()
    retries_done = models.PositiveSmallIntegerField(default=0)
    attempt_started_at = models.DateTimeField(null=True, blank=True)
    # Set by a payment-method change: retry at once (docs/decisions/0071).
    retry_requested_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    waiting_for_payment_method = models.BooleanField(default=False)
    last_decline_code = models.CharField(max_length=100, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["next_attempt_at"], name="dunning_due_idx", condition=models.Q(status="active")),
            models.Index(fields=["tenant", "livemode", "status"], name="dunning_run_status_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status="active", ended_at__isnull=True)
                | (~models.Q(status="active") & models.Q(ended_at__isnull=False)),
                name="dunning_run_ended_at_iff_not_active",
            ),
        ]

    def __str__(self) -> str:
        return self.id
