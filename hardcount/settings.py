"""Django settings for Hardcount, read from the environment.

Environment variables (all optional in development):

- ``DATABASE_URL``: ``postgresql://user:pass@host:port/name``. Unset: an embedded
  PostgreSQL (``pgserver``) under ``var/`` is started or reused.
- ``HARDCOUNT_DEVSTACK=0`` is production (the ``Procfile`` sets it): settings then refuse to
  load without ``SECRET_KEY`` and ``HARDCOUNT_ALLOWED_HOSTS`` and turn on the HTTPS protections
  (docs/operations.md#production-settings).
- ``SECRET_KEY``: Django's secret key (a fixed development key when unset, in development only).
- ``STRIPE_API_KEY`` / ``STRIPE_API_BASE``: the gateway; point the base at
  ``localstripe`` in development and tests.
- ``HARDCOUNT_*``: the service's own knobs, each listed below with its default.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

from hardcount.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("HARDCOUNT_VAR_DIR", BASE_DIR / "var"))


def _env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# The development stack (``manage.py serve`` behind ``make run``, ``manage.py seed_demo``, the demo
# credentials, localstripe): the devstack app, installed unless HARDCOUNT_DEVSTACK is off. On by
# default, so development and the tests have it; production sets HARDCOUNT_DEVSTACK=0 (the
# Procfile does) and has none of those commands (docs/decisions/0121-kernel-ops-and-devstack.md).
HARDCOUNT_DEVSTACK = _env_bool("HARDCOUNT_DEVSTACK", True)
# Production is a deployment without the development stack: it has no development defaults for
# secrets or hosts, and serves the admin over HTTPS only (docs/operations.md#production-settings).
HARDCOUNT_PRODUCTION = not HARDCOUNT_DEVSTACK

_DEVELOPMENT_SECRET_KEY = "hardcount-development-key-not-for-production"  # noqa: S105 (development only)
DEBUG = _env_bool("HARDCOUNT_DEBUG", False)
SECRET_KEY = os.environ.get("SECRET_KEY", "")
ALLOWED_HOSTS = [
    h for h in os.environ.get("HARDCOUNT_ALLOWED_HOSTS", "" if HARDCOUNT_PRODUCTION else "*").split(",") if h
]
# Fernet keys (url-safe base64 of 32 bytes, comma-separated) that encrypt the tenants' gateway
# secrets at rest (billing.vault, docs/decisions/0132-gateway-accounts.md): the first encrypts, all
# decrypt, so a rotation prepends a new key, runs `manage.py rotate_gateway_secrets`, then drops the
# old one. Unset in development: a key generated under var/ on first use; production refuses to start.
HARDCOUNT_SECRETS_KEYS = [k.strip() for k in os.environ.get("HARDCOUNT_SECRETS_KEYS", "").split(",") if k.strip()]


def _is_fernet_key(value: str) -> bool:
    import base64
    import binascii

    try:
        return len(base64.urlsafe_b64decode(value.encode("ascii"))) == 32
    except (binascii.Error, ValueError):
        return False


if any(not _is_fernet_key(k) for k in HARDCOUNT_SECRETS_KEYS):
    raise ImproperlyConfigured("HARDCOUNT_SECRETS_KEYS: every key must be a Fernet key (url-safe base64 of 32 bytes)")

if HARDCOUNT_PRODUCTION:
    _refusals = []
    if not SECRET_KEY:
        _refusals.append("SECRET_KEY is not set")
    elif SECRET_KEY == _DEVELOPMENT_SECRET_KEY:
        _refusals.append("SECRET_KEY is the development key")
    if not ALLOWED_HOSTS:
        _refusals.append("HARDCOUNT_ALLOWED_HOSTS is not set (the service's host names, comma-separated)")
    if DEBUG:
        _refusals.append("HARDCOUNT_DEBUG is on")
    if not HARDCOUNT_SECRETS_KEYS:
        _refusals.append("HARDCOUNT_SECRETS_KEYS is not set (the Fernet keys of the gateway secrets)")
    if _refusals:
        raise ImproperlyConfigured(
            "Production settings (HARDCOUNT_DEVSTACK=0) refuse to start: "
            + "; ".join(_refusals)
            + ". See docs/operations.md#production-settings."
        )
else:
    SECRET_KEY = SECRET_KEY or _DEVELOPMENT_SECRET_KEY

INSTALLED_APPS = [
    "django_prometheus",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "hardcount",
    "leases",
    "billing",
    "dunning",
    "outbox",
    "ops",
]

# The devstack app: development only (HARDCOUNT_DEVSTACK above).
if HARDCOUNT_DEVSTACK:
    INSTALLED_APPS.append("devstack")

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "hardcount.limits.RequestLimitsMiddleware",
    "hardcount.logs.RequestContextMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "hardcount.middleware.BodySizeLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "hardcount.urls"
WSGI_APPLICATION = "hardcount.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database_from_url(url: str) -> dict:
    parts = urlparse(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise RuntimeError(f"DATABASE_URL must be a PostgreSQL URL, got scheme {parts.scheme!r}")
    query = dict(q.split("=", 1) for q in parts.query.split("&") if "=" in q)
    return {
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.pop("host", parts.hostname or ""),
        "PORT": str(parts.port or ""),
        "OPTIONS": query,
    }


def _database() -> dict:
    url = os.environ.get("DATABASE_URL")
    if url:
        db = _database_from_url(url)
    else:
        from hardcount.embedded_db import embedded_connection

        conn = embedded_connection(VAR_DIR / "pgdata")
        db = {
            "NAME": conn["name"],
            "USER": conn["user"],
            "PASSWORD": "",
            "HOST": conn["host"],
            "PORT": conn["port"],
            "OPTIONS": {},
        }
    # django-prometheus's PostgreSQL backend plus the per-transaction tenant switch (hardcount.tenancy).
    db["ENGINE"] = "hardcount.db"
    # Nothing may live in the session of a server connection, so a transaction-pooling PgBouncer
    # can sit in front (docs/decisions/0184-pgbouncer-transaction-pooling.md): client-side binding
    # (psycopg's ClientCursor, never a server-side prepared statement: pinned here whatever the
    # URL's query says) and no server-side cursors (Django's .iterator() would declare WITH HOLD ones).
    db["OPTIONS"]["server_side_binding"] = False
    db["OPTIONS"]["prepare_threshold"] = None
    db["DISABLE_SERVER_SIDE_CURSORS"] = True
    # Every session speaks UTC; due-time decisions use the database's now() regardless.
    db["TIME_ZONE"] = None
    db["CONN_MAX_AGE"] = _env_int("HARDCOUNT_CONN_MAX_AGE", 60)
    db["CONN_HEALTH_CHECKS"] = True
    db["TEST"] = {"NAME": os.environ.get("HARDCOUNT_TEST_DB", "test_hardcount")}
    return db


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
# Dates and times on the console's pages read "2026-12-01 14:03 UTC" (hardcount/formats/en/formats.py).
FORMAT_MODULE_PATH = ["hardcount.formats"]
# The locale the console writes amounts in (Babel's name: en_US, de_DE, fr_FR, ja_JP ...): hardcount.admin.money.
HARDCOUNT_CONSOLE_LOCALE = os.environ.get("HARDCOUNT_CONSOLE_LOCALE", "en_US")

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# Operators' console: session security on. In production cookies travel over HTTPS only, plain
# HTTP is redirected to HTTPS (not the health and metrics paths: probes and scrapers speak HTTP
# inside the deployment) and browsers are told to use HTTPS for a year (HSTS); each can be turned
# off for a deployment that must (docs/operations.md#production-settings).
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = 8 * 3600
SESSION_COOKIE_SECURE = _env_bool("HARDCOUNT_SECURE_COOKIES", HARDCOUNT_PRODUCTION)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = _env_bool("HARDCOUNT_SSL_REDIRECT", HARDCOUNT_PRODUCTION)
SECURE_REDIRECT_EXEMPT = [r"^health/(live|ready)$", r"^metrics$"]
SECURE_HSTS_SECONDS = _env_int("HARDCOUNT_HSTS_SECONDS", 365 * 24 * 3600 if HARDCOUNT_PRODUCTION else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("HARDCOUNT_HSTS_INCLUDE_SUBDOMAINS", HARDCOUNT_PRODUCTION)
SECURE_HSTS_PRELOAD = _env_bool("HARDCOUNT_HSTS_PRELOAD", HARDCOUNT_PRODUCTION)
# TLS ends at the proxy in front (gunicorn binds 127.0.0.1 by default): the request was HTTPS when
# this header, which the proxy must set and overwrite, says "https". Empty: no proxy header trusted.
_PROXY_SSL_HEADER = os.environ.get("HARDCOUNT_PROXY_SSL_HEADER", "X-Forwarded-Proto" if HARDCOUNT_PRODUCTION else "")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https") if _PROXY_SSL_HEADER else None
)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# Request bodies above this many bytes are refused with 413 before any parsing.
HARDCOUNT_MAX_BODY_BYTES = _env_int("HARDCOUNT_MAX_BODY_BYTES", 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = HARDCOUNT_MAX_BODY_BYTES

# Request limits, answered with the API's JSON error (hardcount.limits, docs/security.md): the request
# target (path and query), one header field (name and value), the number of header fields. gunicorn's
# own limits (hardcount/gunicorn.conf.py) are higher, so these answer first.
HARDCOUNT_MAX_REQUEST_TARGET_BYTES = _env_int("HARDCOUNT_MAX_REQUEST_TARGET_BYTES", 4096)
HARDCOUNT_MAX_HEADER_BYTES = _env_int("HARDCOUNT_MAX_HEADER_BYTES", 8192)
HARDCOUNT_MAX_HEADERS = _env_int("HARDCOUNT_MAX_HEADERS", 100)

# API rate limits per key (hardcount.ratelimit, docs/decisions/0128-api-rate-limits.md): one token bucket per
# key and bucket name in PostgreSQL, shared by every worker and replica. A bucket holds at most ``burst``
# tokens and refills at ``per_s`` tokens a second; each request takes one or is answered 429 with
# Retry-After. GET, HEAD and OPTIONS are reads, other methods writes; a route of HARDCOUNT_RATE_LIMIT_ROUTES
# ("METHOD /path" as routed) takes from its own bucket instead. A tenant's RateLimit rows
# replace these defaults for its keys (manage.py ratelimit). HARDCOUNT_RATE_LIMIT=0 turns limiting off.
HARDCOUNT_RATE_LIMIT = _env_bool("HARDCOUNT_RATE_LIMIT", True)
HARDCOUNT_RATE_LIMITS = {
    "read": {
        "per_s": _env_float("HARDCOUNT_RATE_LIMIT_READ_PER_S", 100),
        "burst": _env_int("HARDCOUNT_RATE_LIMIT_READ_BURST", 400),
    },
    "write": {
        "per_s": _env_float("HARDCOUNT_RATE_LIMIT_WRITE_PER_S", 50),
        "burst": _env_int("HARDCOUNT_RATE_LIMIT_WRITE_BURST", 200),
    },
    # A billing run drains every due subscription of the tenant: a few a minute is plenty.
    "billing_run": {
        "per_s": _env_float("HARDCOUNT_RATE_LIMIT_BILLING_RUN_PER_S", 0.05),
        "burst": _env_int("HARDCOUNT_RATE_LIMIT_BILLING_RUN_BURST", 5),
    },
}
HARDCOUNT_RATE_LIMIT_ROUTES = {"POST /v1/billing/run": "billing_run"}
for _bucket, _limit in HARDCOUNT_RATE_LIMITS.items():
    if not (_limit["per_s"] > 0 and _limit["burst"] >= 1):
        raise RuntimeError(f"Rate limit {_bucket!r} needs per_s > 0 and burst >= 1, got {_limit}")

# Outbound requests made on a tenant's behalf (webhook deliveries) reach public addresses only
# (hardcount.outbound, docs/decisions/0123-outbound-requests-policy.md). These local targets may be
# reached anyway: comma-separated host:port, IPv6 hosts in brackets. Empty by default, as in
# production; make run adds its own webhook receiver, the tests add theirs.
HARDCOUNT_OUTBOUND_ALLOW = [e.strip() for e in os.environ.get("HARDCOUNT_OUTBOUND_ALLOW", "").split(",") if e.strip()]
for _entry in HARDCOUNT_OUTBOUND_ALLOW:
    _host, _, _port = _entry.rpartition(":")
    _port_ok = _port.isascii() and _port.isdigit() and 0 < int(_port) < 65536
    if not _host or not _port_ok or (":" in _host and _host[0] != "["):
        raise RuntimeError(f"HARDCOUNT_OUTBOUND_ALLOW entry {_entry!r} is not host:port (IPv6 hosts in brackets)")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["hardcount.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "hardcount.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Hardcount API",
    "DESCRIPTION": "Subscription billing: customers, prices, subscriptions, invoices, "
    "billing runs, test clocks, webhooks.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # 3.1: full JSON Schema (propertyNames, type unions), so the document can state the API's rules exactly.
    "OAS_VERSION": "3.1.0",
    # Blank strings stay valid, and links from each response to the operations on the resources it names
    # (hardcount/openapi_hooks.py).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "hardcount.openapi_hooks.blank_strings_any_of",
        "hardcount.openapi_hooks.add_resource_links",
    ],
}

# Gateway (Stripe). STRIPE_API_BASE points the real stripe library at localstripe in
# development and tests.
STRIPE_API_KEY = os.environ.get("STRIPE_API_KEY", "sk_test_hardcount_localstripe")
STRIPE_API_BASE = os.environ.get("STRIPE_API_BASE", "")
# The signing secret (whsec_…) of the platform account's Stripe webhook endpoint, which posts to
# /stripe/webhooks/platform (billing/gateway_accounts.py). Empty: that URL answers 404.
STRIPE_WEBHOOK_SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "")
HARDCOUNT_GATEWAY_TIMEOUT_S = _env_float("HARDCOUNT_GATEWAY_TIMEOUT_S", 20.0)
# The platform account's publishable key (pk_…): the hosted invoice page hands it to Stripe.js so the
# customer can complete a payment that requires action (billing/hosted_views.py). Empty: not offered.
STRIPE_PUBLISHABLE_KEY = os.environ.get("STRIPE_PUBLISHABLE_KEY", "")
# Where the hosted invoice page loads Stripe.js from; its origin is the only script origin the page's
# Content-Security-Policy allows (tests point it at a local stub).
HARDCOUNT_STRIPE_JS_URL = os.environ.get("HARDCOUNT_STRIPE_JS_URL", "https://js.stripe.com/v3/")

# Invoice documents (docs/reference/invoice-documents.md): the base of hosted invoice URLs as
# customers reach the service (scheme and host, no trailing path), and the locale amounts are
# written in (a Babel name).
HARDCOUNT_PUBLIC_URL = os.environ.get(
    "HARDCOUNT_PUBLIC_URL", f"http://127.0.0.1:{os.environ.get('HARDCOUNT_PORT', '8000')}"
)
HARDCOUNT_DOCUMENT_LOCALE = os.environ.get("HARDCOUNT_DOCUMENT_LOCALE", "en_US")
# Past this long after a payment attempt's key was first sent, the attempt is resolved by looking
# its PaymentIntent up, never by a re-send: Stripe forgets a key after 24 h (decision 0129).
HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S = _env_float("HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S", 23 * 3600)
if not 0 < HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S < 24 * 3600:
    raise ImproperlyConfigured("HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S must lie between 0 and 86400 (Stripe's 24 h)")
# How often the reconciler retrieves a PaymentIntent that finishes later (processing, requires_action);
# its inbound Stripe events tell first (decision 0134).
HARDCOUNT_PENDING_PAYMENT_POLL_S = _env_float("HARDCOUNT_PENDING_PAYMENT_POLL_S", 300)

# Billing.
HARDCOUNT_BILLING_INTERVAL_S = _env_float("HARDCOUNT_BILLING_INTERVAL_S", 3600)
HARDCOUNT_BILLING_PAGE_SIZE = _env_int("HARDCOUNT_BILLING_PAGE_SIZE", 100)
HARDCOUNT_BILLING_CONCURRENCY = _env_int("HARDCOUNT_BILLING_CONCURRENCY", 8)
# The scheduler's billing splits into this many shards by tenant, each drained under its own lease (billing:0 …;
# one shard keeps the single "billing" lease). docs/decisions/0194-billing-shards.md.
HARDCOUNT_BILLING_SHARDS = _env_int("HARDCOUNT_BILLING_SHARDS", 1)
# The drain's gateway calls in flight at once, on sender threads that hold no database connection
# (billing.services.charge_pool; docs/decisions/0186).
HARDCOUNT_BILLING_CHARGES_IN_FLIGHT = _env_int("HARDCOUNT_BILLING_CHARGES_IN_FLIGHT", 128)
# Drain pages under way at once: the next is claimed and prepared while this one's charges are out (0188).
HARDCOUNT_BILLING_PAGES_IN_FLIGHT = _env_int("HARDCOUNT_BILLING_PAGES_IN_FLIGHT", 3)
# Requests a second one gateway account takes (billing.gateway_accounts.requests_per_s): unset, Stripe's
# limits when charging Stripe itself and none for another gateway; 0 for none.
HARDCOUNT_GATEWAY_REQUESTS_PER_S = (
    _env_float("HARDCOUNT_GATEWAY_REQUESTS_PER_S", 0) if os.environ.get("HARDCOUNT_GATEWAY_REQUESTS_PER_S") else None
)
# The drain's page close (billing.services.page): a page's plain closes share their two transactions.
# 0 closes every subscription on its own (the reference path; docs/decisions/0016).
HARDCOUNT_BILLING_PAGE_CLOSE = os.environ.get("HARDCOUNT_BILLING_PAGE_CLOSE", "1") != "0"
# Usage billing (docs/decisions/0165): a meter event may arrive this many seconds after its time; the
# invoice that bills a period's usage waits as long after the period's end.
HARDCOUNT_USAGE_GRACE_S = _env_int("HARDCOUNT_USAGE_GRACE_S", 3600)
# A close's usage rows sharing one meter (of a sum, count or max formula) and one window, at least this many, are
# aggregated by one grouped statement, which PostgreSQL may run as a parallel scan (docs/decisions/0230).
HARDCOUNT_USAGE_GROUPED_MIN = _env_int("HARDCOUNT_USAGE_GROUPED_MIN", 50)
HARDCOUNT_TAX_PROVIDER = os.environ.get("HARDCOUNT_TAX_PROVIDER", "billing.tax.TableRateTaxProvider")

# Test clocks: parallel closes of one clock's drain (docs/decisions/0080). Read by
# billing.services.clocks, whose own fallback is the same 2: a clock's subscriptions share one
# tenant's gapless invoice counter, so more parallel closes only queue on it.
HARDCOUNT_TEST_CLOCK_CONCURRENCY = _env_int("HARDCOUNT_TEST_CLOCK_CONCURRENCY", 2)

# Dunning.
HARDCOUNT_DUNNING_INTERVAL_S = _env_float("HARDCOUNT_DUNNING_INTERVAL_S", 60)

# Leader leases (docs/reference/roles-and-leases.md).
HARDCOUNT_LEASE_TTL_S = _env_float("HARDCOUNT_LEASE_TTL_S", 10)
HARDCOUNT_LEASE_HEARTBEAT_S = _env_float("HARDCOUNT_LEASE_HEARTBEAT_S", 3)
HARDCOUNT_LEASE_ABANDON_S = _env_float("HARDCOUNT_LEASE_ABANDON_S", 6)
HARDCOUNT_RUN_SCHEDULER = _env_bool("HARDCOUNT_RUN_SCHEDULER", False)
# How often a replica that does not hold a role looks whether its lease is free (seconds).
HARDCOUNT_LEASE_POLL_S = _env_float("HARDCOUNT_LEASE_POLL_S", 0.5)
# A replica already leading k roles of a family (the billing shards) takes a free lease of that family only
# once it has seen it free for k times this long, so a replica leading fewer gets it first (seconds).
HARDCOUNT_LEASE_SPREAD_S = _env_float("HARDCOUNT_LEASE_SPREAD_S", 10)
# A fenced transaction left idle this long (e.g. its process SIGSTOPped) is ended by PostgreSQL,
# so it cannot hold back a successor's takeover.
HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S = _env_float("HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S", 5)
# A claim (hardcount.claims: a test clock's walk, a test-clock invoice's charge) lapses this long
# after its holder's last heartbeat (every third of it): how soon a dead holder's claim is free.
HARDCOUNT_CLAIM_TTL_S = _env_float("HARDCOUNT_CLAIM_TTL_S", 10)
# DATABASE_URL points at a transaction-pooling PgBouncer (docs/operations.md#pgbouncer): no session
# settings at connect (the scheduler's -c options, the webhook executor's timeouts), no LISTEN.
HARDCOUNT_DB_TRANSACTION_POOLING = _env_bool("HARDCOUNT_DB_TRANSACTION_POOLING", False)
# The scheduler's roles: dotted paths of role classes (see hardcount.scheduler). Comma-separated in the env.
HARDCOUNT_ROLES = [
    r.strip()
    for r in os.environ.get(
        "HARDCOUNT_ROLES",
        "billing.loops.BillingRole,billing.loops.DunningRole,outbox.scheduling.OutboxMaintenanceRole,"
        "hardcount.loops.IdempotencyMaintenanceRole,hardcount.loops.PartitionMaintenanceRole",
    ).split(",")
    if r.strip()
]
# Leaderless services started with the runtime in every replica: dotted paths of objects with start()/stop().
HARDCOUNT_SERVICES = [
    s.strip() for s in os.environ.get("HARDCOUNT_SERVICES", "outbox.scheduling.ExecutorService").split(",") if s.strip()
]

# Outbox (docs/reference/webhooks.md): executor workers per replica; a request's total and connect timeouts (the
# lease on a delivery is twice the total); how often an idle executor looks for due work
# (inserts also wake it at once through NOTIFY); the circuit breaker (open after this many
# consecutive failures, for a cool-down doubling per further failure, up to 1 h); retention
# of delivered rows; the maintenance role's interval.
HARDCOUNT_OUTBOX_WORKERS = _env_int("HARDCOUNT_OUTBOX_WORKERS", 8)
HARDCOUNT_DELIVERY_TIMEOUT_S = _env_float("HARDCOUNT_DELIVERY_TIMEOUT_S", 10.0)
HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S = _env_float("HARDCOUNT_DELIVERY_CONNECT_TIMEOUT_S", 5.0)
HARDCOUNT_OUTBOX_POLL_S = _env_float("HARDCOUNT_OUTBOX_POLL_S", 1.0)
# Whether the executor's own writes (claims, outcomes, attempt rows, the reaper's) wait for the WAL flush at
# commit. Off by default: a server crash can then lose the last moments of that bookkeeping, and the deliveries
# it covered are sent again, which at-least-once delivery allows; every other write of the service stays
# synchronous (docs/decisions/0226). Not applied through a transaction pooler (no session settings there).
HARDCOUNT_DELIVERY_SYNCHRONOUS_COMMIT = _env_bool("HARDCOUNT_DELIVERY_SYNCHRONOUS_COMMIT", False)
HARDCOUNT_OUTBOX_BREAKER_THRESHOLD = _env_int("HARDCOUNT_OUTBOX_BREAKER_THRESHOLD", 5)
HARDCOUNT_OUTBOX_BREAKER_COOLDOWN_S = _env_float("HARDCOUNT_OUTBOX_BREAKER_COOLDOWN_S", 60.0)
HARDCOUNT_OUTBOX_RETENTION_DAYS = _env_int("HARDCOUNT_OUTBOX_RETENTION_DAYS", 30)
HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S = _env_float("HARDCOUNT_OUTBOX_MAINTENANCE_INTERVAL_S", 60.0)
# On SIGTERM, requests in flight get this long to finish before they are cancelled (unset: the timeout).
HARDCOUNT_OUTBOX_SHUTDOWN_GRACE_S = (
    _env_float("HARDCOUNT_OUTBOX_SHUTDOWN_GRACE_S", 0) if os.environ.get("HARDCOUNT_OUTBOX_SHUTDOWN_GRACE_S") else None
)

# How executors learn which deliveries to try (docs/reference/webhooks.md#dispatch-through-a-stream,
# docs/decisions/0200): "poll" (the claim query, woken by NOTIFY) or "nats" (writers publish each new
# delivery's id after commit to NATS JetStream at HARDCOUNT_NATS_URL, executors pull them from one durable
# consumer; PostgreSQL stays the source of truth). In "nats" mode each executor also claims, every
# HARDCOUNT_DELIVERY_SWEEP_S, the deliveries due for over HARDCOUNT_DELIVERY_SWEEP_AGE_S that no message
# brought (never published, lost by the stream, re-queued by the reaper, made due early): the safety net.
HARDCOUNT_DELIVERY_DISPATCH = os.environ.get("HARDCOUNT_DELIVERY_DISPATCH", "poll").strip() or "poll"
if HARDCOUNT_DELIVERY_DISPATCH not in ("poll", "nats"):
    raise ImproperlyConfigured(
        f"HARDCOUNT_DELIVERY_DISPATCH must be 'poll' or 'nats', not {HARDCOUNT_DELIVERY_DISPATCH!r}"
    )
HARDCOUNT_NATS_URL = os.environ.get("HARDCOUNT_NATS_URL", "nats://127.0.0.1:4222")
HARDCOUNT_NATS_STREAM = os.environ.get("HARDCOUNT_NATS_STREAM", "HARDCOUNT_DELIVERIES")
HARDCOUNT_NATS_SUBJECT_PREFIX = os.environ.get("HARDCOUNT_NATS_SUBJECT_PREFIX", "hardcount.deliveries")
HARDCOUNT_DELIVERY_SWEEP_S = _env_float("HARDCOUNT_DELIVERY_SWEEP_S", 5.0)
HARDCOUNT_DELIVERY_SWEEP_AGE_S = _env_float("HARDCOUNT_DELIVERY_SWEEP_AGE_S", 5.0)

# Monthly partitions of the history tables (docs/reference/partitions.md, docs/decisions/0177): each
# table's partition key (a time, or a time-ordered id and its prefix) and retention in days (None: kept
# forever). The ``partition_maintenance`` role keeps this month and ``HARDCOUNT_PARTITION_AHEAD_MONTHS``
# more created, and detaches the partitions older than their table's retention, dropping them (or, with
# ``HARDCOUNT_PARTITION_ARCHIVE``, moving them to the ``partition_archive`` schema), every interval.
# Payment attempts and billing attempts are billing history the API serves (docs/reference/domain.md):
# kept unless an operator sets a retention. Meter events must outlive the longest open period (three
# years: billing.services.catalog.MAX_INTERVAL_COUNT, in days) and its usage grace window.
HARDCOUNT_PARTITION_AHEAD_MONTHS = _env_int("HARDCOUNT_PARTITION_AHEAD_MONTHS", 2)
HARDCOUNT_PARTITION_MAINTENANCE_INTERVAL_S = _env_float("HARDCOUNT_PARTITION_MAINTENANCE_INTERVAL_S", 3600.0)
HARDCOUNT_PARTITION_ARCHIVE = _env_bool("HARDCOUNT_PARTITION_ARCHIVE", False)
HARDCOUNT_LONGEST_PERIOD_DAYS = 3 * 366
HARDCOUNT_METER_EVENT_MIN_RETENTION_DAYS = HARDCOUNT_LONGEST_PERIOD_DAYS + -(-HARDCOUNT_USAGE_GRACE_S // 86400)


def _retention_days(name: str, default: int | None) -> int | None:
    """Days from the environment (``0``: kept forever)."""
    days = _env_int(name, default or 0)
    return days or None


HARDCOUNT_PARTITIONED_TABLES = {
    "outbox_event": {
        "key": "id", "kind": "id", "prefix": "evt",
        "retention_days": _retention_days("HARDCOUNT_EVENT_RETENTION_DAYS", 90),
    },
    "outbox_delivery": {
        "key": "id", "kind": "id", "prefix": "whd",
        "retention_days": _retention_days("HARDCOUNT_DELIVERY_RETENTION_DAYS", 90),
    },
    "outbox_deliveryattempt": {
        "key": "delivery_id", "kind": "id", "prefix": "whd",
        "retention_days": _retention_days("HARDCOUNT_DELIVERY_ATTEMPT_RETENTION_DAYS", 400),
    },
    "billing_billingattempt": {
        "key": "id", "kind": "id", "prefix": "batt",
        "retention_days": _retention_days("HARDCOUNT_BILLING_ATTEMPT_RETENTION_DAYS", None),
    },
    "billing_paymentattempt": {
        "key": "invoice_id", "kind": "id", "prefix": "in",
        "retention_days": _retention_days("HARDCOUNT_PAYMENT_ATTEMPT_RETENTION_DAYS", None),
    },
    "billing_meterevent": {
        "key": "timestamp", "kind": "time",
        "retention_days": _retention_days("HARDCOUNT_METER_EVENT_RETENTION_DAYS", 1200),
    },
}  # fmt: skip
_meter_days = HARDCOUNT_PARTITIONED_TABLES["billing_meterevent"]["retention_days"]
if _meter_days is not None and _meter_days < HARDCOUNT_METER_EVENT_MIN_RETENTION_DAYS:
    raise RuntimeError(
        f"HARDCOUNT_METER_EVENT_RETENTION_DAYS must be at least {HARDCOUNT_METER_EVENT_MIN_RETENTION_DAYS} "
        f"(the longest billing period plus the usage grace window), got {_meter_days}"
    )

# Idempotency keys (docs/reference/api.md, docs/decisions/0023): a key's record is kept this many hours after
# its first request, then the key is free again and its record is pruned. At least 24, Stripe's
# documented minimum, which clients retrying on a Stripe-like API rely on. The
# ``idempotency_maintenance`` role prunes expired records every interval, in batches of this
# many rows (each its own short transaction).
HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS = _env_int("HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS", 24)
if HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS < 24:
    raise RuntimeError(
        f"HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS must be at least 24, got {HARDCOUNT_IDEMPOTENCY_RETENTION_HOURS}"
    )
HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S = _env_float("HARDCOUNT_IDEMPOTENCY_PRUNE_INTERVAL_S", 300.0)
HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH = _env_int("HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH", 1000)

# text (default) or json: one JSON object per line with the request, tenant and role (hardcount/logs.py,
# docs/operations.md#logs).
HARDCOUNT_LOG_FORMAT = os.environ.get("HARDCOUNT_LOG_FORMAT", "text").strip().lower()
LOGGING = logging_config(HARDCOUNT_LOG_FORMAT, os.environ.get("HARDCOUNT_LOG_LEVEL", "INFO"))
