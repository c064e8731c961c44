"""No admin page shows a secret the service has issued: API keys, their hashes, webhook signing secrets.

A superuser walks every registered model's list, object pages and history after the book went
through billing, dunning and webhooks, with keys issued by the admin, ``ApiKey.issue`` and the
API, an endpoint created through the API under an ``Idempotency-Key``, and one idempotency record
as it was stored before decision 0125 (the secret in clear in its body).
"""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

from django.contrib import admin
from django.contrib.auth.models import Group
from django.urls import reverse
from django.utils import timezone

from billing.models import Invoice, StripeEvent, TestClock
from billing.services import discounts
from billing.services.credit_notes import LineInput, create_credit_note
from billing.services.drain import drain_due
from billing.services.invoice_items import create_invoice_item
from billing.services.ledger import grant_credit
from billing.services.usage import create_meter
from dunning.models import DunningSettings
from hardcount.models import ApiKey, Claim, IdempotencyRecord, RateLimit
from leases.models import LeaderLease
from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
from tests.admin.conftest import operator  # noqa: F401 - the superuser's logged-in client
from tests.api.conftest import Api
from tests.billing.conftest import (  # noqa: F401 - the book and its gateway
    DECLINING_CARD,
    book,
    localstripe_base,
    make_card,
    no_doctor,
    proxy_session,
    stripe_client,
    stripe_proxy,
)
from tests.outbox.conftest import make_endpoint

# Object pages read per model: enough to meet every kind of row the book has.
ROWS_PER_MODEL = 25


def _issue_secrets(book, operator) -> list[str]:  # noqa: F811 - the fixture's client, passed in
    """Fill every table with a row and issue secrets every way the service does; returns the plaintexts."""
    issued: list[str] = []
    tenant = book.tenant()
    make_endpoint(tenant, "https://example.com/hook")
    paying = book.subscribed(tenant)
    book.subscribed(tenant, card=DECLINING_CARD)
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
    coupon = discounts.create_coupon(tenant_id=tenant.id, livemode=False, percent_off=Decimal("10"), duration="once")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=paying.id, coupon_id=coupon.id
    )
    create_meter(tenant_id=tenant.id, livemode=False, display_name="API calls", event_name="api_calls", formula="sum")
    create_invoice_item(
        tenant_id=tenant.id, livemode=False, customer_id=paying.customer_id, amount=-100, currency="usd"
    )
    delivery = Delivery.objects.first()
    DeliveryAttempt.objects.create(delivery=delivery, number=1, outcome="retryable", status_code=503, error="503")
    now = timezone.now()
    LeaderLease.objects.create(role="billing", holder="h:1:ab", token=1, heartbeat_at=now, expires_at=now)
    Claim.objects.create(key="test_clock:clock_x", holder="h:1:ab:thread-1", expires_at=now)
    TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=now - timedelta(days=1))
    DunningSettings.objects.create(tenant=tenant, livemode=False)
    Group.objects.create(name="support")
    RateLimit.objects.create(tenant=tenant, bucket="write", per_s=50, burst=200)

    # Keys: issued directly, and through the admin's add pages (the one page allowed to show them).
    issued += [ApiKey.issue(tenant, livemode=False)[1], ApiKey.issue(tenant, livemode=True)[1]]
    created = operator.post(reverse("admin:hardcount_tenant_add"), {"name": "Initech"})
    issued += [secret for _, secret in created.context["keys"]]
    created = operator.post(reverse("admin:hardcount_apikey_add"), {"tenant": tenant.pk, "mode": "live"})
    issued += [secret for _, secret in created.context["keys"]]

    # Webhook secrets through the API, under an Idempotency-Key (so a record exists), in both modes.
    for key, url in ((issued[0], "https://example.com/test"), (issued[1], "https://example.com/live")):
        body = {"url": url, "enabled_events": ["*"]}
        status, endpoint = Api(key).post("/v1/webhook_endpoints", body, headers={"Idempotency-Key": url})
        assert status == 201, endpoint
        issued.append(endpoint["secret"])
    # A record as stored before decision 0125: the creation response, secret included, in clear.
    legacy = make_endpoint(tenant, "https://example.com/legacy")
    IdempotencyRecord.objects.create(
        tenant=tenant,
        livemode=False,
        key="before-0125",
        request_fingerprint="f" * 64,
        response_status=201,
        response_body=json.dumps({"id": legacy.id, "object": "webhook_endpoint", "secret": legacy.secret}),
        completed_at=now,
    )
    IdempotencyRecord.objects.create(tenant=tenant, livemode=False, key="in-flight", request_fingerprint="f" * 64)
    StripeEvent.objects.create(
        account="platform", event_id="evt_admin", type="charge.refunded", livemode=False, result="no_invoice"
    )
    # A gateway account (live mode: the book's test-mode charges stay on the platform's account).
    from billing.gateway_accounts import set_account

    gateway_key, signing = "sk_live_adminWalk00000000000000001", "whsec_adminWalk00000000000000001"
    account, _ = set_account(tenant_id=tenant.id, livemode=True, secret_key=gateway_key, webhook_secret=signing)
    issued += [gateway_key, signing, account.secret_key, account.webhook_secret]
    return issued


def _forbidden(issued: list[str]) -> set[str]:
    """Every secret and hash in the database, and the random part of each (a page could drop the prefix)."""
    values = set(issued)
    values |= set(ApiKey.objects.values_list("key_hash", flat=True))
    values |= set(WebhookEndpoint.objects.values_list("secret", flat=True))
    for prefix in ("hc_test_", "hc_live_", "whsec_"):
        values |= {v.removeprefix(prefix) for v in values if v.startswith(prefix)}
    return values


def test_no_admin_page_shows_a_secret_or_a_key_hash(book, no_doctor, operator):  # noqa: F811 - fixtures
    # no_doctor: a few rows below (a delivery attempt, a lease, a clock) are written straight to the tables.
    issued = _issue_secrets(book, operator)
    # 7, and a gateway account's key, signing secret and their two Fernet tokens.
    assert len(issued) == 7 + 4
    forbidden = _forbidden(issued)
    assert len(forbidden) >= 2 * 7 + 4

    pages = [reverse("admin:index")]
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        pages.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        if model_admin.has_add_permission(_request_of(operator)):
            pages.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_add"))
        rows = list(model._default_manager.order_by("-pk").values_list("pk", flat=True)[:ROWS_PER_MODEL])
        assert rows, f"no {opts.label} row: the walk would not see its object page"
        for pk in rows:
            pages.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk]))
            pages.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_history", args=[pk]))

    leaks = []
    for url in pages:
        response = operator.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        leaks += [(url, value[:12] + "…") for value in forbidden if value in html]
    assert leaks == []
    assert len(pages) > 3 * len(admin.site._registry)


def test_the_idempotency_record_page_shows_the_body_with_its_secret_masked(db, operator):  # noqa: F811
    from hardcount.models import Tenant

    tenant = Tenant.objects.create(name="Acme")
    _, key = ApiKey.issue(tenant, livemode=False)
    status, endpoint = Api(key).post(
        "/v1/webhook_endpoints",
        {"url": "https://example.com/h", "enabled_events": ["*"]},
        headers={"Idempotency-Key": "k"},
    )
    assert status == 201
    record = IdempotencyRecord.objects.get()
    page = operator.get(reverse("admin:hardcount_idempotencyrecord_change", args=[record.pk])).content.decode()
    assert endpoint["id"] in page  # the body is shown …
    assert "[secret: not stored]" in page  # … with the marker where the secret was
    assert endpoint["secret"] not in page


def _request_of(client):
    """A request carrying the client's logged-in user, for asking an admin its permissions."""
    from django.contrib.auth.models import User
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = User.objects.get(pk=client.session["_auth_user_id"])
    return request
