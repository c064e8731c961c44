"""Meters and their usage events (Stripe's Billing Meters, https://docs.stripe.com/billing/subscriptions/usage-based/meters).

A meter names the ``event_name`` its events carry and how a period's events become one quantity
(``formula``); a metered price (:class:`billing.models.Price` with ``usage_type=metered``) bills
that quantity. Storage and idempotency: docs/decisions/0164-meter-events-storage-and-idempotency.md.
"""

from django.db import models

from billing.models.choices import WordChoices
from hardcount.ids import id_field
from hardcount.models import TenantScoped


class Formula(WordChoices):
    """How a meter aggregates a period's events: ``sum`` / ``max`` / ``last`` of their values, ``count`` of
    them (Stripe's ``default_aggregation.formula``), or ``unique_count`` of one payload property (Lago's)."""

    SUM = "sum"
    COUNT = "count"
    MAX = "max"
    LAST = "last"
    UNIQUE_COUNT = "unique_count"


class Meter(TenantScoped):
    """A tenant's meter: events named ``event_name`` of one customer, aggregated by ``formula`` per period.

    ``customer_key`` is the payload key holding the customer's id (Stripe's
    ``customer_mapping.event_payload_key``), ``value_key`` the key holding the event's value (Stripe's
    ``value_settings.event_payload_key``; for ``unique_count`` the property counted). One meter per
    ``event_name`` in a tenant and mode (a UNIQUE constraint), so an event belongs to one meter.
    """

    Formula = Formula

    id = id_field("meter")
    display_name = models.CharField(max_length=250)
    event_name = models.CharField(max_length=100)
    formula = models.CharField(max_length=16, choices=Formula.choices)
    customer_key = models.CharField(max_length=100, default="stripe_customer_id")
    value_key = models.CharField(max_length=100, default="value")
    status = models.CharField(max_length=16, default="active")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "livemode", "event_name"], name="meter_one_per_event_name"),
        ]

    def __str__(self) -> str:
        return f"{self.display_name} ({self.id})"


class MeterEvent(models.Model):
    """One usage event: ``value`` (an integer; null for ``count`` and ``unique_count`` meters) for ``customer``
    at ``timestamp``, the billing time of the usage (UTC).

    Written only by one set-wise statement (:func:`billing.queries.insert_meter_events`), read only by
    aggregating SQL (:func:`billing.queries.aggregate_usage`). The primary key is ``(timestamp, id)``
    so the table can be range-partitioned by ``timestamp``; the identifier guard is
    :class:`MeterEventIdentifier`, which a partition key could not be part of (docs/decisions/0164).
    """

    pk = models.CompositePrimaryKey("timestamp", "id")
    id = models.CharField(max_length=40)
    # No index of their own: the usage index below leads with the customer, whose tenant and mode are the event's.
    tenant = models.ForeignKey("hardcount.Tenant", on_delete=models.PROTECT, related_name="+", db_index=False)
    livemode = models.BooleanField()
    event_name = models.CharField(max_length=100)
    customer = models.ForeignKey("billing.Customer", on_delete=models.PROTECT, related_name="+", db_index=False)
    identifier = models.CharField(max_length=100)
    value = models.BigIntegerField(null=True)
    payload = models.JSONField(default=dict)
    timestamp = models.DateTimeField()
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # The aggregation and the summaries: one customer's events of one meter in a time range. ``value`` is
            # carried in the index so a close's sum or max reads no table page (decision 0172); no tenant or mode
            # before the customer, whose own they are (half the size, a fifth faster: decisions 0218, 0222).
            models.Index(
                fields=["customer", "event_name", "timestamp"],
                include=["value"],
                name="meter_event_customer_usage_idx",
            ),
        ]


class MeterEventIdentifier(models.Model):
    """The idempotency guard of meter events: one row per ``(tenant, livemode, identifier)`` ever accepted.

    The primary key is that triple, so a retried event (the same identifier, whatever its timestamp)
    inserts nothing, across connections and concurrent batches: a concurrent insert of the same key
    waits for the first to commit, then does nothing. ``event_id`` and ``event_timestamp`` locate the
    event it admitted (the event table's primary key).
    """

    pk = models.CompositePrimaryKey("tenant", "livemode", "identifier")
    # No foreign key in the database: each guard row is written by the statement that writes its event, whose own
    # key to the tenant is checked, and is pruned long before that event (decision 0215).
    tenant = models.ForeignKey(
        "hardcount.Tenant", on_delete=models.PROTECT, related_name="+", db_index=False, db_constraint=False
    )
    livemode = models.BooleanField()
    # Compared byte by byte: an identifier is opaque, and the primary key's comparisons skip the locale's collation
    # routine (decision 0229). Equality is the same under any deterministic collation.
    identifier = models.CharField(max_length=100, db_collation="C")
    event_id = models.CharField(max_length=40)
    event_timestamp = models.DateTimeField()
    # When the identifier was taken, on the database's clock (never a test clock's): the pruning reads it (0219).
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["created_at"], name="meter_event_guard_created_idx")]
