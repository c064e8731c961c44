"""Every model's list and object page renders for a book that went through billing, dunning and webhooks."""

from datetime import timedelta
from decimal import Decimal

from django.urls import reverse
from django.utils import timezone

from billing.gateway_accounts import set_account
from billing.models import Invoice, StripeEvent, TestClock
from billing.services import discounts
from billing.services.credit_notes import LineInput, create_credit_note
from billing.services.drain import drain_due
from billing.services.invoice_items import create_invoice_item
from billing.services.ledger import grant_credit
from billing.services.usage import create_meter
from dunning.models import DunningSettings
from hardcount import audit, ratelimit
from hardcount.models import ApiKey, Claim, IdempotencyRecord, RateLimit
from leases.models import LeaderLease
from outbox.models import Delivery, DeliveryAttempt
from tests.api.test_admin import admin_models
from tests.billing.conftest import DECLINING_CARD
from tests.outbox.conftest import make_endpoint

APPS = ("hardcount", "billing", "dunning", "outbox", "leases")


def test_every_list_and_object_page_renders(book, no_doctor, operator):
    # no_doctor: a few rows below (a delivery attempt, a lease, a claim, a clock) are written straight to the tables.
    tenant = book.tenant()
    make_endpoint(tenant, "https://example.com/hook")
    paying = book.subscribed(tenant)
    book.subscribed(tenant, card=DECLINING_CARD)
    coupon = discounts.create_coupon(tenant_id=tenant.id, livemode=False, percent_off=Decimal("10"), duration="once")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=paying.id, coupon_id=coupon.id
    )
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    paid = Invoice.objects.get(subscription=paying)  # a credit note with a line and a refund: every credit-note row
    create_credit_note(
        paid.id,
        tenant_id=tenant.id,
        livemode=False,
        lines=[LineInput(paid.lines.first().id, amount=100)],
        refund_amount=100,
    )
    grant_credit(paying.customer_id, tenant_id=tenant.id, livemode=False, amount=250, description="goodwill")
    create_invoice_item(
        tenant_id=tenant.id, livemode=False, customer_id=paying.customer_id, amount=-100, currency="usd"
    )
    delivery = Delivery.objects.first()
    DeliveryAttempt.objects.create(delivery=delivery, number=1, outcome="retryable", status_code=503, error="503")
    now = timezone.now()
    LeaderLease.objects.create(role="billing", holder="h:1:ab", token=1, heartbeat_at=now, expires_at=now)
    Claim.objects.create(key="test_clock:clk_admin", holder="h:1:ab:1", expires_at=now)
    TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=now - timedelta(days=1))
    create_meter(tenant_id=tenant.id, livemode=False, display_name="API calls", event_name="api_calls", formula="sum")
    DunningSettings.objects.create(tenant=tenant, livemode=False)
    key, _ = ApiKey.issue(tenant, livemode=False)
    RateLimit.objects.create(tenant=tenant, bucket="read", per_s=10, burst=20)
    ratelimit.take(api_key_id=key.pk, tenant_id=tenant.id, bucket="read")
    audit.record(audit.API_KEY_ISSUED, obj=key, actor=audit.Actor.cli(), message=f"Issued {key}.")
    IdempotencyRecord.objects.create(tenant=tenant, livemode=False, key="k1", request_fingerprint="f" * 64)
    StripeEvent.objects.create(
        account="platform", event_id="evt_admin", type="charge.refunded", livemode=False, result="no_invoice"
    )
    set_account(
        tenant_id=tenant.id,
        livemode=True,
        secret_key="sk_live_pagesTest00000000000000001",
        webhook_secret="whsec_pagesTest00000000000000001",
    )

    for app in APPS:
        for model in admin_models(app):
            opts = model._meta
            listed = operator.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
            assert listed.status_code == 200, opts.label
            row = model.objects.first()
            assert row is not None, f"no {opts.label} row in the book"
            page = operator.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[row.pk]))
            assert page.status_code == 200, opts.label
