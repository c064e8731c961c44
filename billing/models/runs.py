"""Billing runs (one per drain) and billing attempts (one per subscription attempted)."""

from django.db import models

from billing.models.choices import WordChoices
from hardcount.ids import id_field
from hardcount.models import Tenant


class BillingRun(models.Model):
    """One drain: who triggered it, what it covered, and what it did.

    ``tenant`` is null for a scheduler run over every tenant; ``test_clock`` is set for a
    run driven by a clock's advance. Counts: ``pages`` claimed, subscriptions
    ``attempted``, ``billed`` (an invoice was closed: paid, declined into dunning, or
    waiting on tax) and ``failed`` (the period did not advance), saved after every page. A
    manual run of ``POST /v1/billing/run`` is drained in the background under the leader lease
    named by ``lease_role``.
    """

    class Trigger(WordChoices):
        """Who started the run: the scheduler's tick, an API call, or a test clock's advance."""

        SCHEDULER = "scheduler"
        MANUAL = "manual"
        TEST_CLOCK = "test_clock"

    class Status(WordChoices):
        """``running`` until the drain ends it ``completed`` or ``failed``; ``abandoned`` when its process died."""

        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        ABANDONED = "abandoned"

    # The members under the names code written before the enums compares with.
    SCHEDULER, MANUAL, TEST_CLOCK = Trigger.SCHEDULER, Trigger.MANUAL, Trigger.TEST_CLOCK
    RUNNING, COMPLETED, FAILED, ABANDONED = Status.RUNNING, Status.COMPLETED, Status.FAILED, Status.ABANDONED

    id = id_field("billing_run")
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    livemode = models.BooleanField()
    test_clock = models.ForeignKey(
        "billing.TestClock", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    # The instant the run billed "as of": now() for wall-clock runs, the clock's time otherwise.
    as_of = models.DateTimeField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    pages = models.PositiveIntegerField(default=0)
    attempted = models.PositiveIntegerField(default=0)
    billed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    # Fencing token of the leader lease the run ran under (null for runs their caller drains itself:
    # a retry-billing, a test clock's advance).
    lease_token = models.BigIntegerField(null=True, blank=True)
    # The leader lease a manual run drains under in the background, ``manual:{tenant}:{mode}``
    # (billing/services/manual_runs.py), or a sharded scheduler run's shard lease, ``billing:<index>``
    # (billing/shards.py); blank for every other run (an unsharded scheduler run's is ``billing``).
    lease_role = models.CharField(max_length=100, blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["tenant", "livemode", "started_at"], name="billing_run_tenant_idx")]

    def count(self, outcome: str) -> None:
        """Count one attempted subscription whose close came to ``outcome`` (a :class:`BillingAttempt.Outcome`)."""
        self.attempted += 1
        if outcome in BillingAttempt.COUNTED_AS_BILLED:
            self.billed += 1
        elif outcome == BillingAttempt.Outcome.FAILED:
            self.failed += 1


class BillingAttempt(models.Model):
    """One subscription attempted by one run, with its outcome and failure number."""

    class Outcome(WordChoices):
        """What the attempt came to (the ``kind`` of :class:`billing.services.payments.Outcome`)."""

        BILLED = "billed"
        DECLINED = "declined"
        TAX_PENDING = "tax_pending"
        FAILED = "failed"
        SKIPPED = "skipped"
        # The charge finishes later: its PaymentIntent is processing or requires the customer's action.
        PAYMENT_PENDING = "payment_pending"
        # The invoice is held for an operator (a usage amount beyond what a payment can take): the period advanced.
        HELD = "held"

    # Outcomes a run counts as billed: an invoice was closed (paid, declined into dunning, waiting on tax, held
    # for an operator, or its payment finishing later). A failed attempt counts as failed; a skipped one as neither.
    COUNTED_AS_BILLED = (Outcome.BILLED, Outcome.DECLINED, Outcome.TAX_PENDING, Outcome.PAYMENT_PENDING, Outcome.HELD)
    # The members under the names code written before the enums compares with.
    BILLED, DECLINED, TAX_PENDING = Outcome.BILLED, Outcome.DECLINED, Outcome.TAX_PENDING
    FAILED, SKIPPED = Outcome.FAILED, Outcome.SKIPPED

    id = id_field("billing_attempt")
    run = models.ForeignKey(BillingRun, on_delete=models.CASCADE, related_name="attempts")
    subscription = models.ForeignKey("billing.Subscription", on_delete=models.CASCADE, related_name="billing_attempts")
    invoice = models.ForeignKey("billing.Invoice", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    error = models.TextField(blank=True, default="")
    # The subscription's billing_failure_count after this attempt (0 when it succeeded).
    failure_number = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["subscription", "created_at"], name="billing_attempt_sub_idx")]
