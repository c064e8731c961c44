"""Dunning: retry schedules for declined invoices, and their runs."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class DunningSettings(TenantScoped):
    """A tenant's dunning policy per mode: retry ``retry_days`` after the first decline,
    then apply ``final_action`` (``unpaid`` or ``canceled``) to the subscription."""

    UNPAID, CANCELED = "unpaid", "canceled"
    FINAL_ACTION_CHOICES = [(UNPAID, UNPAID), (CANCELED, CANCELED)]

    retry_days = models.JSONField(default=list)
    final_action = models.CharField(max_length=16, choices=FINAL_ACTION_CHOICES, default=UNPAID)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "dunning settings"
        constraints = [models.UniqueConstraint(fields=["tenant", "livemode"], name="dunning_settings_unique")]


class DunningRun(TenantScoped):
    """Retries of one declined invoice. ``next_attempt_at`` is when the next retry is due;
    a hard decline sets ``waiting_for_payment_method`` until the customer's method changes."""

    ACTIVE, RECOVERED, EXHAUSTED, ENDED = "active", "recovered", "exhausted", "ended"
    STATUS_CHOICES = [(s, s) for s in (ACTIVE, RECOVERED, EXHAUSTED, ENDED)]

    id = id_field("dunning_run")
    invoice = models.OneToOneField("billing.Invoice", on_delete=models.PROTECT, related_name="dunning_run")
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=ACTIVE)
    first_declined_at = models.DateTimeField()
    retries_done = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    waiting_for_payment_method = models.BooleanField(default=False)
    last_decline_code = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["next_attempt_at"], name="dunning_due_idx", condition=models.Q(status="active"))
        ]
