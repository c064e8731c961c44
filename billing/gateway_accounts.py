"""Which Stripe account a tenant's charges go to, and which account an inbound Stripe webhook came from.

Two questions every gateway call and every inbound event asks:

- :func:`gateway_for` — the :class:`~billing.gateway.Gateway` bound to the account that charges
  ``tenant_id``'s customers in ``livemode`` (the platform default, ``settings.STRIPE_API_KEY``,
  for a tenant without an account of its own);
- :func:`webhook_account` — the account behind ``/stripe/webhooks/<slug>``: its signing secret
  and the tenant whose invoices its events may touch.

The platform default account's slug is :data:`PLATFORM_SLUG`; its webhook signing secret is
``settings.STRIPE_WEBHOOK_SECRET``.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from billing import gateway as gw

PLATFORM_SLUG = "platform"


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
    """The account whose webhook URL ends in ``slug``, or None when there is none (a 404)."""
    if slug == PLATFORM_SLUG and settings.STRIPE_WEBHOOK_SECRET:
        return WebhookAccount(
            slug=PLATFORM_SLUG,
            signing_secret=settings.STRIPE_WEBHOOK_SECRET,
            tenant_id=None,
            livemode=_platform_livemode(),
        )
    return None


def gateway_for(tenant_id: str, livemode: bool) -> gw.Gateway:
    """The gateway that charges ``tenant_id``'s customers in ``livemode`` (today: the platform default)."""
    return gw.get_gateway()
