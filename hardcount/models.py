"""Tenants, API keys, idempotency records, rate limits, the audit log, claims, and the tenant-scoped base of rows."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.db.models.functions import Now

from hardcount.ids import id_field

LIVE_KEY_PREFIX = "hc_live_"
TEST_KEY_PREFIX = "hc_test_"


class Tenant(models.Model):
    """A company billing its own customers through Hardcount.

    The business fields are what its customers' invoice documents print as the seller
    (docs/reference/invoice-documents.md): ``business_name`` (blank: ``name``), a postal address,
    and ``country`` as an ISO 3166-1 alpha-2 code (``"US"``) or blank. Set through ``/v1/account``.
    """

    id = id_field("tenant")
    name = models.CharField(max_length=200)
    business_name = models.CharField(max_length=200, blank=True, default="")
    address_line1 = models.CharField(max_length=200, blank=True, default="")
    address_line2 = models.CharField(max_length=200, blank=True, default="")
    city = models.CharField(max_length=100, blank=True, default="")
    postal_code = models.CharField(max_length=20, blank=True, default="")
    state = models.CharField(max_length=100, blank=True, default="")
    country = models.CharField(max_length=2, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def display_name(self) -> str:
        """The name a customer's document shows: ``business_name``, else ``name``."""
        return self.business_name or self.name


def hash_api_key(secret: str) -> str:
    """SHA-256 hex of a full API key. Keys carry 192 random bits, so no slow hash is needed."""
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKey(models.Model):
    """A tenant's secret key. Only its hash is stored; the key's prefix decides the mode.

    ``hc_test_…`` keys see test-mode rows only, ``hc_live_…`` keys live-mode rows only.
    """

    id = id_field("api_key")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    livemode = models.BooleanField()
    key_hash = models.CharField(max_length=64, unique=True)
    # First characters of the key, shown to operators so they can tell keys apart.
    key_hint = models.CharField(max_length=24)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.key_hint}… ({'live' if self.livemode else 'test'})"

    @classmethod
    def issue(cls, tenant: Tenant, *, livemode: bool) -> tuple[ApiKey, str]:
        """Create a key for ``tenant``; returns ``(row, secret)``. The secret is never stored."""
        prefix = LIVE_KEY_PREFIX if livemode else TEST_KEY_PREFIX
        secret = prefix + secrets.token_urlsafe(24)
        row = cls.objects.create(tenant=tenant, livemode=livemode, key_hash=hash_api_key(secret), key_hint=secret[:14])
        return row, secret


class TenantScoped(models.Model):
    """Abstract base: every domain row belongs to exactly one tenant and one mode."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+")
    livemode = models.BooleanField()

    class Meta:
        abstract = True


class IdempotencyRecord(models.Model):
    """The first response to a POST carrying an ``Idempotency-Key`` header.

    Keyed by (tenant, mode, key). A replay with the same request fingerprint returns the
    stored response; a different fingerprint under the same key is a 422. While the first
    request is still executing, ``completed_at`` (and the response) are null: the record
    is the in-flight claim that keeps a concurrent duplicate from executing (see
    :mod:`hardcount.idempotency`).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    livemode = models.BooleanField()
    key = models.CharField(max_length=255)
    request_fingerprint = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "livemode", "key"], name="idempotency_record_unique_key")
        ]
        # Retention pruning reads the oldest records first, a batch at a time (docs/decisions/0023).
        indexes = [models.Index(fields=["created_at"], name="idempotency_record_created")]


class RateLimit(models.Model):
    """A tenant's own limit for one bucket (``read``, ``write``, ``billing_run``), replacing the default.

    Applies to each of the tenant's keys on its own: every key has its own bucket of this size
    (:mod:`hardcount.ratelimit`, docs/decisions/0128-api-rate-limits.md).
    """

    # The unique (tenant, bucket) index serves look-ups by tenant: no index of its own.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="rate_limits", db_index=False)
    bucket = models.CharField(max_length=32)
    per_s = models.FloatField(help_text="Tokens added per second (requests per second sustained).")
    burst = models.PositiveIntegerField(help_text="The bucket's size: requests allowed at once after a pause.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "bucket"], name="rate_limit_unique_bucket"),
            models.CheckConstraint(condition=models.Q(per_s__gt=0), name="rate_limit_positive_rate"),
            models.CheckConstraint(condition=models.Q(burst__gte=1), name="rate_limit_burst_at_least_one"),
        ]

    def __str__(self) -> str:
        return f"{self.bucket}: {self.per_s:g}/s, burst {self.burst}"


class RateLimitBucket(models.Model):
    """One API key's token bucket for one bucket name; written only by :func:`hardcount.ratelimit.take`.

    ``tokens`` is what was left after the last request (at ``updated_at``, database time);
    ``per_s``/``burst`` are the limits that request was measured against and ``allowed`` its
    outcome. The table is UNLOGGED (migration 0004): losing it in a crash only refills every bucket.
    """

    # "<api key id>:<bucket>": a natural key, so the upsert draws no sequence value per request.
    id = models.CharField(primary_key=True, max_length=80)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="+")
    bucket = models.CharField(max_length=32)
    per_s = models.FloatField()
    burst = models.FloatField()
    tokens = models.FloatField()
    allowed = models.BooleanField()
    updated_at = models.DateTimeField()

    def __str__(self) -> str:
        return self.id


class AuditLogEntry(models.Model):
    """One operator action or credential change: who, when (database time), what, and from where. Append-only.

    Written only through :func:`hardcount.audit.record`. PostgreSQL refuses every UPDATE and
    DELETE of a row (a trigger, migration 0005); :meth:`save` of a stored entry and
    :meth:`delete` raise before asking it. ``tenant_id`` and the actor are plain values, not
    foreign keys: an entry outlives the user, key or tenant it names.
    """

    USER = "user"
    API_KEY = "api_key"
    CLI = "cli"
    ACTOR_TYPES = [(USER, "user"), (API_KEY, "API key"), (CLI, "command line")]

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField(db_default=Now())
    actor_type = models.CharField(max_length=16, choices=ACTOR_TYPES)
    # The user's id, the API key's id, or (for a command) the operating-system user.
    actor_id = models.CharField(max_length=150)
    # The username or the key's hint, as they were at the time.
    actor_label = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=64)
    # ``app_label.model_name`` (``billing.invoice``) and the object's primary key.
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=255, blank=True)
    tenant_id = models.CharField(max_length=40, blank=True)
    message = models.TextField(blank=True)
    # The client's address as the server saw it (REMOTE_ADDR), or ``cli`` for a command.
    remote_addr = models.CharField(max_length=64)

    class Meta:
        verbose_name = "audit log entry"
        verbose_name_plural = "audit log"
        indexes = [
            models.Index(fields=["actor_type", "actor_id"], name="audit_log_actor"),
            models.Index(fields=["object_type", "object_id"], name="audit_log_object"),
            models.Index(fields=["action"], name="audit_log_action"),
            models.Index(fields=["tenant_id"], name="audit_log_tenant"),
            models.Index(fields=["created_at"], name="audit_log_created"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.object_type} {self.object_id}".strip()

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AuditLogImmutable("An audit log entry cannot be changed.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AuditLogImmutable("An audit log entry cannot be deleted.")


class AuditLogImmutable(Exception):
    """Raised by :class:`AuditLogEntry` on an attempt to change or delete a stored entry."""


class Claim(models.Model):
    """A named, expiring hold taken by one thread of one process (:mod:`hardcount.claims`).

    ``key`` names what is held (``test_clock:<id>``, ``charge:<invoice id>``); ``holder`` is the
    taking thread's id; ``expires_at`` (the database's ``now()`` plus the TTL) is pushed forward by
    the holder's heartbeat, so a dead holder's claim lapses by itself. No tenant data, no
    row-level security: the tenant role has no grant on it.
    """

    key = models.CharField(max_length=200, primary_key=True)
    holder = models.CharField(max_length=200)
    taken_at = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.key}: {self.holder}"
