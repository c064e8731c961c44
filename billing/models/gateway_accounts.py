"""A tenant's own Stripe account, per mode: where its customers are charged."""

from __future__ import annotations

import secrets

from django.db import models

from hardcount.ids import id_field
from hardcount.models import TenantScoped


def new_slug() -> str:
    """A public, unguessable slug for the account's inbound webhook URL (``/stripe/webhooks/<slug>``)."""
    return secrets.token_urlsafe(18)


class GatewayAccount(TenantScoped):
    """The Stripe account that charges one tenant's customers in one mode (unique per tenant and mode).

    Either ``secret_key`` (encrypted: a Fernet token from :mod:`billing.vault`, of an ``sk_…`` or
    ``rk_…`` key of the account's mode) or ``connect_account`` (an ``acct_…`` id, charged with the
    platform key and the ``Stripe-Account`` header; not a secret). ``key_hint`` is the masked key
    shown by the API (``sk_test_…abcd``). ``webhook_secret`` is the encrypted ``whsec_…`` of the
    account's Stripe webhook endpoint, which posts to ``/stripe/webhooks/<slug>``.
    """

    id = id_field("gateway_account")
    secret_key = models.TextField(blank=True, default="")
    key_hint = models.CharField(max_length=40, blank=True, default="")
    connect_account = models.CharField(max_length=64, blank=True, default="")
    webhook_secret = models.TextField(blank=True, default="")
    slug = models.CharField(max_length=64, unique=True, default=new_slug)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "livemode"], name="gateway_account_one_per_tenant_mode"),
            models.CheckConstraint(
                condition=(models.Q(secret_key="") & ~models.Q(connect_account=""))
                | (~models.Q(secret_key="") & models.Q(connect_account="")),
                name="gateway_account_key_or_connect",
            ),
        ]

    def __str__(self) -> str:
        return self.id
