"""Which Stripe account a tenant's charges go to, and which account an inbound Stripe webhook came from.

Two questions every gateway call and every inbound event asks:

- :func:`gateway_for` — the :class:`~billing.gateway.Gateway` bound to the account that charges
  ``tenant_id``'s customers in ``livemode``: the tenant's :class:`~billing.models.GatewayAccount`
  for that mode (its own secret key, or the platform key with its Connect account id as
  ``Stripe-Account``), else the platform default, ``settings.STRIPE_API_KEY``;
- :func:`webhook_account` — the account behind ``/stripe/webhooks/<slug>``: its signing secret
  and the tenant whose invoices its events may touch.

The platform default account's slug is :data:`PLATFORM_SLUG`; its webhook signing secret is
``settings.STRIPE_WEBHOOK_SECRET``. Setting and removing a tenant's account (:func:`set_account`,
:func:`delete_account`) are the API's and ``manage.py gateway_account``'s;
docs/decisions/0132-gateway-accounts.md says why it looks this way.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from billing import gateway as gw
from billing import vault
from billing.models import GatewayAccount
from hardcount import audit, tenancy
from hardcount.errors import InvalidRequestError, business_rule_codes, storable_text
from hardcount.times import iso

PLATFORM_SLUG = "platform"

# Stripe's key shapes (https://docs.stripe.com/keys): secret sk_, restricted rk_, then the mode.
SECRET_KEY_PATTERN = r"^(sk|rk)_(test|live)_[0-9A-Za-z]{16,247}$"  # noqa: S105 (a shape, not a secret)
CONNECT_ACCOUNT_PATTERN = r"^acct_[0-9A-Za-z]{8,64}$"
WEBHOOK_SECRET_PATTERN = r"^whsec_[0-9A-Za-z+/=_-]{16,255}$"  # noqa: S105

KEY_MODE_MISMATCH, CREDENTIALS_CHOICE, PLATFORM_MODE_MISMATCH = (
    "gateway_key_mode_mismatch",
    "gateway_credentials_choice",
    "gateway_platform_mode_mismatch",
)
ERROR_CODES = business_rule_codes(KEY_MODE_MISMATCH, CREDENTIALS_CHOICE, PLATFORM_MODE_MISMATCH)
# Every change of an account is in the audit log (API and manage.py gateway_account), never a secret.
AUDIT_SET, AUDIT_DELETED = "gateway_account.set", "gateway_account.deleted"
AUDIT_ACTIONS = audit.actions(AUDIT_SET, AUDIT_DELETED)


@dataclass(frozen=True)
class WebhookAccount:
    """The account an inbound Stripe webhook URL belongs to.

    ``slug`` is the URL's last segment; ``signing_secret`` the ``whsec_…`` secret of that
    account's Stripe webhook endpoint; ``tenant_id`` the one tenant whose invoices its events may
    touch (None: the platform account, whose events may touch only invoices of tenants without an
    account of their own in ``livemode``).
    """

    slug: str
    signing_secret: str
    tenant_id: str | None
    livemode: bool


def _platform_livemode() -> bool:
    return settings.STRIPE_API_KEY.startswith(("sk_live_", "rk_live_"))


def webhook_account(slug: str) -> WebhookAccount | None:
    """The account whose webhook URL ends in ``slug``, or None when there is none (a 404).

    Raises :class:`billing.vault.SecretUnreadable` when the account's signing secret decrypts under
    no configured key (answer as for an unverifiable signature; the message names no secret).
    """
    if slug == PLATFORM_SLUG:
        if not settings.STRIPE_WEBHOOK_SECRET:
            return None
        return WebhookAccount(
            slug=PLATFORM_SLUG,
            signing_secret=settings.STRIPE_WEBHOOK_SECRET,
            tenant_id=None,
            livemode=_platform_livemode(),
        )
    if not slug or len(slug) > 64 or not storable_text(slug):
        return None  # a NUL (or a lone surrogate) names no stored account, and the query could not send it
    with tenancy.cross_tenant():
        account = GatewayAccount.objects.filter(slug=slug).first()
    if account is None or not account.webhook_secret:
        return None
    return WebhookAccount(
        slug=account.slug,
        signing_secret=vault.decrypt(account.webhook_secret),
        tenant_id=account.tenant_id,
        livemode=account.livemode,
    )


# (tenant_id, livemode) -> (read at, (account id, updated_at) or None, gateway): an answer younger than
# ACCOUNT_CACHE_S is reused without a query (a charge's close costs no statement for it); an older one
# is read again, and a row unchanged since keeps its client (no decryption). Set and delete drop the
# entry at once in their own process; another process follows within ACCOUNT_CACHE_S.
ACCOUNT_CACHE_S = 5.0
_bound: dict[tuple[str, bool], tuple[float, tuple[str, datetime] | None, gw.Gateway | None]] = {}
_bound_lock = threading.Lock()


def account_of(tenant_id: str, livemode: bool) -> GatewayAccount | None:
    """The tenant's own account in ``livemode``, or None (the platform default charges it). Read across
    tenants (the caller names the tenant)."""
    with tenancy.cross_tenant():
        return GatewayAccount.objects.filter(tenant_id=tenant_id, livemode=livemode).first()


def every_account(using: str = "default") -> list[GatewayAccount]:
    """Every tenant's own account, of every mode (the doctor compares each tenant in its own)."""
    return list(GatewayAccount.objects.using(using).order_by("pk"))


def credentials(account: GatewayAccount | None) -> tuple[str, str]:
    """``(api_key, stripe_account)`` that act as ``account`` (None: the platform's key, no Connect id).

    Raises :class:`billing.vault.SecretUnreadable` when the stored key decrypts under no configured key.
    """
    if account is None:
        return settings.STRIPE_API_KEY, ""
    if account.connect_account:
        return settings.STRIPE_API_KEY, account.connect_account
    return vault.decrypt(account.secret_key), ""


def gateway_for(tenant_id: str, livemode: bool) -> gw.Gateway:
    """The gateway that charges ``tenant_id``'s customers in ``livemode``: its own account, else the platform's.

    The answer is kept :data:`ACCOUNT_CACHE_S` seconds per process (a change made elsewhere is
    followed within that time; one made here at once).

    Raises :class:`billing.vault.SecretUnreadable` when the tenant's key cannot be decrypted
    (the charge fails rather than going to another account).
    """
    key = (tenant_id, livemode)
    with _bound_lock:
        cached = _bound.get(key)
    now = time.monotonic()
    if cached is not None and now - cached[0] < ACCOUNT_CACHE_S:
        return cached[2] or gw.get_gateway()
    account = account_of(tenant_id, livemode)
    version = None if account is None else (account.id, account.updated_at)
    if account is None:
        gateway = None
    elif cached is not None and cached[1] == version and cached[2] is not None:
        gateway = cached[2]
    else:
        api_key, stripe_account = credentials(account)
        gateway = gw.gateway_client(api_key=api_key, stripe_account=stripe_account)
    with _bound_lock:
        _bound[key] = (now, version, gateway)
    return gateway or gw.get_gateway()


# Stripe's rate limits per account (https://docs.stripe.com/rate-limits): about 100 requests a second
# in live mode and 25 in test mode. Another gateway (localstripe, the strict dev Stripe) has none of its own.
STRIPE_REQUESTS_PER_S = {True: 100.0, False: 25.0}


def requests_per_s(livemode: bool) -> float:
    """How many requests a second one gateway account takes in ``livemode`` (0.0: no bound).

    ``HARDCOUNT_GATEWAY_REQUESTS_PER_S`` when set (0 for none), else Stripe's own limits
    (:data:`STRIPE_REQUESTS_PER_S`) when the charges go to Stripe itself (``STRIPE_API_BASE``
    unset), else none. Every account of a mode has the same limit: Stripe raises an account's on
    request, and an operator raises the setting with it. The drain's senders keep each account under
    it (:mod:`billing.services.charge_pool`); a 429 still closes the account's gate (decision 0133).
    """
    configured = settings.HARDCOUNT_GATEWAY_REQUESTS_PER_S
    if configured is not None:
        return max(0.0, float(configured))
    return 0.0 if settings.STRIPE_API_BASE else STRIPE_REQUESTS_PER_S[livemode]


def _forget(tenant_id: str, livemode: bool, account: GatewayAccount | None) -> None:
    """Drop the cached client of ``account`` (the one being replaced or removed)."""
    with _bound_lock:
        _bound.pop((tenant_id, livemode), None)
    if account is None:
        return
    if account.connect_account:
        gw.forget_clients(stripe_account=account.connect_account)
        return
    try:
        gw.forget_clients(api_key=vault.decrypt(account.secret_key))
    except vault.SecretUnreadable:
        pass  # never bound to a client in this process: nothing cached to drop


# --- setting and removing -------------------------------------------------------------------------------------------


def mask(secret: str) -> str:
    """``sk_test_…abcd``: the secret's type and mode prefix and its last four characters (never more)."""
    match = re.match(r"^((?:sk|rk)_(?:test|live)_|whsec_)", secret)
    prefix = match.group(1) if match else ""
    return f"{prefix}…{secret[-4:]}" if len(secret) >= len(prefix) + 12 else f"{prefix}…"


def validate(*, livemode: bool, secret_key: str = "", connect_account: str = "", webhook_secret: str) -> None:
    """Refuse credentials that cannot charge in ``livemode`` (422, naming the field, never its value).

    Exactly one of ``secret_key`` / ``connect_account``; a key of the other mode (``sk_live_`` in
    test mode, ``sk_test_`` in live mode; ``rk_`` likewise) is refused, as is a live Connect
    account while the platform key is a test key. Shapes: :data:`SECRET_KEY_PATTERN`,
    :data:`CONNECT_ACCOUNT_PATTERN`, :data:`WEBHOOK_SECRET_PATTERN`.
    """
    if bool(secret_key) == bool(connect_account):
        raise InvalidRequestError(
            "Give exactly one of secret_key and connect_account.", code=CREDENTIALS_CHOICE, param="secret_key"
        )
    if secret_key and not re.match(SECRET_KEY_PATTERN, secret_key):
        raise InvalidRequestError("secret_key is not a Stripe secret or restricted key.", param="secret_key")
    if connect_account and not re.match(CONNECT_ACCOUNT_PATTERN, connect_account):
        raise InvalidRequestError("connect_account is not a Stripe account id (acct_…).", param="connect_account")
    if not re.match(WEBHOOK_SECRET_PATTERN, webhook_secret or ""):
        raise InvalidRequestError("webhook_secret is not a Stripe signing secret (whsec_…).", param="webhook_secret")
    mode = "live" if livemode else "test"
    if secret_key and secret_key.split("_")[1] != mode:
        raise InvalidRequestError(
            f"secret_key is a {secret_key.split('_')[1]}-mode key; this API key is in {mode} mode.",
            code=KEY_MODE_MISMATCH,
            param="secret_key",
        )
    if connect_account and livemode and not _platform_livemode():
        raise InvalidRequestError(
            "A live Connect account is charged with the platform's key, which is a test key here.",
            code=PLATFORM_MODE_MISMATCH,
            param="connect_account",
        )


def set_account(
    *, tenant_id: str, livemode: bool, secret_key: str = "", connect_account: str = "", webhook_secret: str
) -> tuple[GatewayAccount, bool]:
    """Set the tenant's account in ``livemode`` (all of it); returns ``(account, created)``.

    Validated by :func:`validate` first (nothing written on a refusal); secrets are stored
    encrypted (:mod:`billing.vault`). An existing account keeps its slug, so the Stripe webhook
    endpoint's URL stays valid. Runs in the caller's transaction when there is one.
    """
    validate(livemode=livemode, secret_key=secret_key, connect_account=connect_account, webhook_secret=webhook_secret)
    with transaction.atomic():
        account = GatewayAccount.objects.select_for_update().filter(tenant_id=tenant_id, livemode=livemode).first()
        created = account is None
        _forget(tenant_id, livemode, account)
        if created:
            account = GatewayAccount(tenant_id=tenant_id, livemode=livemode)
        account.secret_key = vault.encrypt(secret_key)
        account.key_hint = mask(secret_key) if secret_key else ""
        account.connect_account = connect_account
        account.webhook_secret = vault.encrypt(webhook_secret)
        account.save()
    return account, created


def delete_account(*, tenant_id: str, livemode: bool) -> GatewayAccount | None:
    """Remove the tenant's account in ``livemode`` (its charges go to the platform default again); the
    removed row, or None when there was none."""
    with transaction.atomic():
        account = GatewayAccount.objects.select_for_update().filter(tenant_id=tenant_id, livemode=livemode).first()
        if account is None:
            return None
        _forget(tenant_id, livemode, account)
        account_id = account.id
        account.delete()
        account.id = account_id  # delete() clears it; the caller records what was removed
    return account


def describe(account: GatewayAccount) -> str:
    """The account in words for the audit log and the command's output: masked key or Connect id, never a secret."""
    what = f"Connect account {account.connect_account}" if account.connect_account else f"key {account.key_hint}"
    return f"{what}, webhook /stripe/webhooks/{account.slug}, {'live' if account.livemode else 'test'} mode"


def gateway_account_data(account: GatewayAccount) -> dict[str, Any]:
    """The API's shape of an account: the key masked, no webhook secret, the webhook URL's path."""
    return {
        "id": account.id,
        "object": "gateway_account",
        "livemode": account.livemode,
        "secret_key": account.key_hint or None,
        "connect_account": account.connect_account or None,
        "webhook_secret_set": bool(account.webhook_secret),
        "slug": account.slug,
        "webhook_path": f"/stripe/webhooks/{account.slug}",
        "created": iso(account.created_at),
        "updated": iso(account.updated_at),
    }


def rotate_secrets() -> int:
    """Re-encrypt every account's secrets under the first of ``HARDCOUNT_SECRETS_KEYS``; returns the rows rewritten.

    Each row is locked and rewritten in its own transaction, so the command can run beside the
    service. Raises :class:`billing.vault.SecretUnreadable` for a row no configured key decrypts.
    """
    done = 0
    for account_id in GatewayAccount.objects.order_by("pk").values_list("pk", flat=True):
        with transaction.atomic():
            account = GatewayAccount.objects.select_for_update().filter(pk=account_id).first()
            if account is None:
                continue
            # update(): the secrets change form, not content, so updated_at (the clients' cache version) stays.
            GatewayAccount.objects.filter(pk=account_id).update(
                secret_key=vault.rotate(account.secret_key), webhook_secret=vault.rotate(account.webhook_secret)
            )
            done += 1
    return done
