"""Subscriptions and their billing-failure state."""

from django.db import models

from billing.models.choices import WordChoices
from hardcount.ids import id_field
from hardcount.models import TenantScoped


class SubscriptionStatus(WordChoices):
    """A subscription's status (as Stripe's): ``trialing``, ``active``, ``past_due``, ``unpaid``, ``canceled``."""

    TRIALING = "trialing"
    ACTIVE = "active"
    PAST_DUE = "past_due"
    UNPAID = "unpaid"
    CANCELED = "canceled"


class PauseBehavior(WordChoices):
    """What becomes of the invoice of a period that comes due while collection is paused (Stripe's
    ``pause_collection.behavior``, https://docs.stripe.com/billing/subscriptions/pause-payment):
    ``void``, ``mark_uncollectible``, ``keep_as_draft`` (docs/decisions/0144-pausing-collection.md)."""

    VOID = "void"
    MARK_UNCOLLECTIBLE = "mark_uncollectible"
    KEEP_AS_DRAFT = "keep_as_draft"


# Statuses the drain bills: a past_due subscription keeps being invoiced, as in Stripe
# (docs/decisions/0053-billable-statuses.md). The due predicate (billing.queries) and the
# due-scan index below both take it from here.
BILLABLE_STATUSES = (SubscriptionStatus.TRIALING, SubscriptionStatus.ACTIVE, SubscriptionStatus.PAST_DUE)


class Subscription(TenantScoped):
    """A customer's subscription to one price, billed in advance.

    Billing periods are ``billing_cycle_anchor + n × interval`` (see
    :mod:`billing.periods`); ``periods_billed`` is the n of the first period not yet
    invoiced, whose start is ``next_billing_at``. The failure state
    (docs/reference/domain.md#billing-failure-state):
    ``billing_failure_count`` failures in a row, the subscription waits until
    ``next_billing_attempt_at``; ``billing_parked_at`` is set by the eighth failure and
    only an operator's retry-billing clears it.
    """

    Status = SubscriptionStatus
    BILLABLE_STATUSES = BILLABLE_STATUSES
    # The members under the names code compares with.
    TRIALING, ACTIVE, PAST_DUE = Status.TRIALING, Status.ACTIVE, Status.PAST_DUE
    UNPAID, CANCELED = Status.UNPAID, Status.CANCELED
    PauseBehavior = PauseBehavior

    id = id_field("subscription")
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="subscriptions")
    price = models.ForeignKey("billing.Price", on_delete=models.PROTECT, related_name="subscriptions")
    status = models.CharField(max_length=16, choices=Status.choices)
    billing_cycle_anchor = models.DateTimeField()
    trial_end = models.DateTimeField(null=True, blank=True)
    current_period_start = models.DateTimeField(null=True, blank=True)
    current_period_end = models.DateTimeField(null=True, blank=True)
    periods_billed = models.PositiveIntegerField(default=0)
    next_billing_at = models.DateTimeField(null=True, blank=True)
    test_clock = models.ForeignKey(
        "billing.TestClock", null=True, blank=True, on_delete=models.PROTECT, related_name="subscriptions"
    )
    cancel_at_period_end = models.BooleanField(default=False)
    canceled_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    billing_failure_count = models.PositiveSmallIntegerField(default=0)
    next_billing_attempt_at = models.DateTimeField(null=True, blank=True)
    billing_parked_at = models.DateTimeField(null=True, blank=True)
    last_billing_error = models.TextField(blank=True, default="")
    # Paused collection (docs/decisions/0144): "" when collection runs; else the behavior for the
    # periods that start before ``pause_collection_resumes_at`` (null: until resumed by hand).
    pause_collection_behavior = models.CharField(max_length=24, blank=True, default="", choices=PauseBehavior.choices)
    pause_collection_resumes_at = models.DateTimeField(null=True, blank=True)
    # The subscription's current discount, which beats the customer's (docs/reference/discounts.md).
    discount = models.ForeignKey("billing.Discount", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # The billing run that attempted it last and left it due (a BillingRun id; no foreign key, which would
    # lock the run's row at every mark): that run's claims pass over it (docs/decisions/0187).
    claimed_by_run = models.CharField(max_length=40, null=True, blank=True, editable=False)

    # -- Item changes (docs/decisions/0140, 0141) --------------------------------------
    # A change with effective_at=period_end: the items the next cycle invoice bills,
    # ``[{"id": "si_…" or None, "price": "price_…", "quantity": n}]``, applied by the close of that period.
    scheduled_items = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [
            # The due scan: wall-clock subscriptions, not parked, in a billable status; in the claim's
            # (next_billing_at, id) order, so a claim starts where the run's last one stopped.
            models.Index(
                fields=["livemode", "next_billing_at", "id"],
                name="subscription_due_idx",
                condition=models.Q(
                    billing_parked_at__isnull=True,
                    test_clock__isnull=True,
                    status__in=list(BILLABLE_STATUSES),
                ),
            ),
            models.Index(fields=["tenant", "livemode", "status"], name="subscription_status_idx"),
            models.Index(
                fields=["next_billing_attempt_at"],
                name="subscription_waiting_idx",
                condition=models.Q(next_billing_attempt_at__isnull=False),
            ),
            models.Index(
                fields=["billing_parked_at"],
                name="subscription_parked_idx",
                condition=models.Q(billing_parked_at__isnull=False),
            ),
            models.Index(
                fields=["pause_collection_resumes_at"],
                name="subscription_paused_idx",
                condition=~models.Q(pause_collection_behavior=""),
            ),
            # The admin's status filter, newest first (docs/decisions/0110).
            models.Index(fields=["status", "id"], name="subscription_admin_status_idx"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def billing_state(self) -> str:
        """``parked``, ``waiting`` (a failure is pending its ladder step), ``paused`` (collection paused) or ``ok``."""
        if self.billing_parked_at is not None:
            return "parked"
        if self.next_billing_attempt_at is not None:
            return "waiting"
        if self.pause_collection_behavior:
            return "paused"
        return "ok"

    @property
    def pause_collection(self) -> dict | None:
        """Stripe's ``pause_collection``: ``{"behavior", "resumes_at"}`` while paused, else None."""
        if not self.pause_collection_behavior:
            return None
        return {"behavior": self.pause_collection_behavior, "resumes_at": self.pause_collection_resumes_at}


# ``Subscription.billing_state`` as queryset filters (the API's ``?billing_state=`` and the admin's
# filter): parked wins over waiting, waiting over paused, as in the property.
_NOT_FAILING = models.Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=True)
BILLING_STATE_FILTERS = {
    "ok": _NOT_FAILING & models.Q(pause_collection_behavior=""),
    "waiting": models.Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=False),
    "parked": models.Q(billing_parked_at__isnull=False),
    "paused": _NOT_FAILING & ~models.Q(pause_collection_behavior=""),
}
