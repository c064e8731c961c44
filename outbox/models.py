"""Events (the transactional outbox), webhook endpoints, deliveries and delivery attempts."""

from django.db import models
from django.utils import timezone

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class Event(TenantScoped):
    """A change that happened, written in the same transaction as the change itself.

    ``created_at`` is the billing time of the change (a test clock's time for objects
    on a clock). ``sequence`` is a global, strictly increasing number; restricted to one
    tenant it orders that tenant's events (it is not gapless per tenant).
    """

    id = id_field("event")
    type = models.CharField(max_length=100)
    data = models.JSONField()
    # Filled by the database from the sequence outbox_event_sequence (migration 0001).
    sequence = models.BigIntegerField(
        unique=True,
        editable=False,
        db_default=models.Func(
            models.Value("outbox_event_sequence"), function="nextval", output_field=models.BigIntegerField()
        ),
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "livemode", "type"], name="event_type_idx"),
            # The operators' admin: events of one type across tenants, newest first (docs/decisions/0110).
            models.Index(fields=["type", "sequence"], name="event_admin_type_idx"),
        ]


class WebhookEndpoint(TenantScoped):
    """A URL that receives the tenant's events of ``enabled_events`` (``*`` or ``prefix.*`` allowed).

    The signing secret is shown once at creation. Circuit-breaker state lives here:
    ``consecutive_failures``, and while open, ``circuit_open_until``.
    """

    id = id_field("webhook_endpoint")
    url = models.URLField(max_length=2000)
    description = models.CharField(max_length=500, blank=True, default="")
    enabled_events = models.JSONField(default=list)
    secret = models.CharField(max_length=128)
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(max_length=200, blank=True, default="")
    consecutive_failures = models.PositiveIntegerField(default=0)
    circuit_open_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True)


class Delivery(models.Model):
    """One event sent to one endpoint: a row of the leaderless claim queue (docs/reference/webhooks.md).

    A worker claims it with ``claimed_by`` and ``claim_expires_at``; every later write
    predicates on ``claimed_by`` still being the worker's own.
    """

    PENDING, RETRYING, SUCCEEDED, FAILED = "pending", "retrying", "succeeded", "failed"
    STATUS_CHOICES = [(s, s) for s in (PENDING, RETRYING, SUCCEEDED, FAILED)]

    id = id_field("delivery")
    # No foreign keys between the partitioned history tables (docs/decisions/0177): each keeps its own
    # retention, and a partition is detached without a scan of the tables that would point into it.
    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="deliveries", db_constraint=False)
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    fire_after = models.DateTimeField(default=timezone.now)
    claimed_by = models.CharField(max_length=200, null=True, blank=True)
    claim_expires_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    # Set on a delivery created by an operator's replay: the delivery it repeats.
    replay_of = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="replays", db_constraint=False
    )

    class Meta:
        verbose_name_plural = "deliveries"
        indexes = [
            models.Index(
                fields=["fire_after"],
                name="delivery_due_idx",
                condition=models.Q(status__in=["pending", "retrying"]),
            ),
            # The reaper's scan: claimed rows of the queue, by lease expiry.
            models.Index(
                fields=["claim_expires_at"],
                name="delivery_claimed_idx",
                condition=models.Q(status__in=["pending", "retrying"], claim_expires_at__isnull=False),
            ),
            # The operators' admin: failed deliveries (the ones to replay), newest first (docs/decisions/0110).
            models.Index(fields=["id"], name="delivery_failed_idx", condition=models.Q(status="failed")),
        ]


class DeliveryAttempt(models.Model):
    """Evidence of one HTTP attempt of a delivery (number 1..8, one row per number).

    ``outcome``: ``succeeded`` (2xx), ``failed`` (a permanent refusal), ``retryable`` (5xx,
    408/409/425/429, timeout, connection error), ``lease_lost`` (the executor holding the
    claim stopped reporting: the request may or may not have reached the receiver), or
    ``canceled`` (the executor shut down mid-request).
    """

    SUCCEEDED, FAILED, RETRYABLE, LEASE_LOST, CANCELED = "succeeded", "failed", "retryable", "lease_lost", "canceled"
    OUTCOME_CHOICES = [(o, o) for o in (SUCCEEDED, FAILED, RETRYABLE, LEASE_LOST, CANCELED)]

    id = id_field("delivery_attempt")
    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_rows", db_constraint=False)
    number = models.PositiveSmallIntegerField()
    outcome = models.CharField(max_length=16, choices=OUTCOME_CHOICES, default=RETRYABLE)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    response_excerpt = models.TextField(blank=True, default="")
    executor = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(number__gte=1, number__lte=8), name="delivery_attempt_number_1_to_8"
            ),
            models.UniqueConstraint(fields=["delivery", "number"], name="delivery_attempt_one_per_number"),
        ]
