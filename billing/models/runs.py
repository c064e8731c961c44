"""Billing runs (one per drain) and billing attempts (one per subscription attempted)."""

from django.db import models

from hardcount.ids import id_field
from hardcount.models import Tenant


class BillingRun(models.Model):
    """One drain: who triggered it, what it covered, and what it did.

    ``tenant`` is null for a scheduler run over every tenant; ``test_clock`` is set for a
    run driven by a clock's advance. Counts: ``pages`` claimed, subscriptions
    ``attempted``, ``billed`` (an invoice was closed: paid, declined into dunning, or
    waiting on tax) and ``failed`` (the period did not advance).
    """

    SCHEDULER, MANUAL, TEST_CLOCK = "scheduler", "manual", "test_clock"
    TRIGGER_CHOICES = [(s, s) for s in (SCHEDULER, MANUAL, TEST_CLOCK)]
    RUNNING, COMPLETED, FAILED, ABANDONED = "running", "completed", "failed", "abandoned"
    STATUS_CHOICES = [(s, s) for s in (RUNNING, COMPLETED, FAILED, ABANDONED)]

    id = id_field("billing_run")
    trigger = models.CharField(max_length=16, choices=TRIGGER_CHOICES)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    livemode = models.BooleanField()
    test_clock = models.ForeignKey(
        "billing.TestClock", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=RUNNING)
    # The instant the run billed "as of": now() for wall-clock runs, the clock's time otherwise.
    as_of = models.DateTimeField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    pages = models.PositiveIntegerField(default=0)
    attempted = models.PositiveIntegerField(default=0)
    billed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    # Fencing token of the leader lease the run ran under (null for manual runs).
    lease_token = models.BigIntegerField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "livemode", "started_at"], name="billing_run_tenant_idx")]


class BillingAttempt(models.Model):
    """One subscription attempted by one run, with its outcome and failure number."""

    BILLED, DECLINED, TAX_PENDING, FAILED, SKIPPED = "billed", "declined", "tax_pending", "failed", "skipped"
    OUTCOME_CHOICES = [(s, s) for s in (BILLED, DECLINED, TAX_PENDING, FAILED, SKIPPED)]

    id = id_field("billing_attempt")
    run = models.ForeignKey(BillingRun, on_delete=models.CASCADE, related_name="attempts")
    subscription = models.ForeignKey("billing.Subscription", on_delete=models.CASCADE, related_name="billing_attempts")
    invoice = models.ForeignKey("billing.Invoice", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    outcome = models.CharField(max_length=16, choices=OUTCOME_CHOICES)
    error = models.TextField(blank=True, default="")
    # The subscription's billing_failure_count after this attempt (0 when it succeeded).
    failure_number = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["subscription", "created_at"], name="billing_attempt_sub_idx")]
