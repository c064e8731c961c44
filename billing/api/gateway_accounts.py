"""The caller's own Stripe account over HTTP: ``/v1/gateway_account`` (retrieve, set, remove).

One account per tenant and mode: the API key's. Secrets are write-only: a response shows the key
masked (``sk_test_…abcd``) and never the webhook signing secret; the audit log records who set or
removed which account, never a secret. Rules: :mod:`billing.gateway_accounts`.
"""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from billing import gateway_accounts as accounts
from billing.models import GatewayAccount
from hardcount import audit
from hardcount.api import ERROR, ApiView, StrictCharField, StrictSerializer, object_field
from hardcount.errors import ResourceMissing

# ---------------------------------------------------------------------------------------
# Input


class GatewayAccountSet(StrictSerializer):
    """The whole account: exactly one of `secret_key` and `connect_account`, and `webhook_secret`."""

    secret_key = StrictCharField(
        required=False,
        write_only=True,
        max_length=255,
        validators=[RegexValidator(accounts.SECRET_KEY_PATTERN, "Must be a Stripe secret or restricted key.")],
        help_text="The account's secret (`sk_…`) or restricted (`rk_…`) key, of the API key's mode: "
        "`sk_test_`/`rk_test_` with a test key, `sk_live_`/`rk_live_` with a live key (else 422 "
        "`gateway_key_mode_mismatch`). Write-only: responses show it masked.",
    )
    connect_account = StrictCharField(
        required=False,
        max_length=69,
        validators=[RegexValidator(accounts.CONNECT_ACCOUNT_PATTERN, "Must be a Stripe account id (acct_…).")],
        help_text="Instead of a key: the Connect account (`acct_…`) charged with the platform's key and the "
        "`Stripe-Account` header. Live mode needs a live platform key (else 422 `gateway_platform_mode_mismatch`).",
    )
    webhook_secret = StrictCharField(
        write_only=True,
        max_length=261,
        validators=[RegexValidator(accounts.WEBHOOK_SECRET_PATTERN, "Must be a Stripe signing secret (whsec_…).")],
        help_text="The signing secret of the account's Stripe webhook endpoint, whose URL is this account's "
        "`webhook_path`. Write-only: never shown.",
    )


# ---------------------------------------------------------------------------------------
# Output (documentation of billing.gateway_accounts.gateway_account_data)


class GatewayAccountOut(serializers.Serializer):
    """The Stripe account that charges the caller's customers in the key's mode."""

    id = serializers.CharField()
    object = object_field("gateway_account")
    livemode = serializers.BooleanField()
    secret_key = serializers.CharField(
        allow_null=True, help_text="The key masked (`sk_test_…abcd`); null for a Connect account."
    )
    connect_account = serializers.CharField(allow_null=True, help_text="The Connect account id, or null.")
    webhook_secret_set = serializers.BooleanField(help_text="True once a signing secret is stored (never shown).")
    slug = serializers.CharField(help_text="The public, random last segment of the account's webhook URL.")
    webhook_path = serializers.CharField(
        help_text="Where the account's Stripe webhook endpoint posts: `/stripe/webhooks/{slug}` on this service."
    )
    created = serializers.DateTimeField()
    updated = serializers.DateTimeField()


class GatewayAccountDeleted(serializers.Serializer):
    id = serializers.CharField()
    object = object_field("gateway_account")
    deleted = serializers.BooleanField()


_NONE = "No gateway account in this mode: charges use the platform's Stripe account."

# ---------------------------------------------------------------------------------------
# Views


class GatewayAccountView(ApiView):
    def _set(self, request):
        data = self.read_body(GatewayAccountSet)
        with transaction.atomic():
            account, created = accounts.set_account(
                tenant_id=self.tenant.pk,
                livemode=self.livemode,
                secret_key=data.get("secret_key", ""),
                connect_account=data.get("connect_account", ""),
                webhook_secret=data["webhook_secret"],
            )
            verb = "Set" if created else "Replaced"
            audit.record(
                accounts.AUDIT_SET, obj=account, request=request, message=f"{verb}: {accounts.describe(account)}."
            )
        return Response(accounts.gateway_account_data(account))

    @extend_schema(
        operation_id="gateway_account_retrieve",
        summary="Retrieve the gateway account",
        description="The caller's own Stripe account in the key's mode, the key masked. 404 `resource_missing` "
        "when there is none (the platform's account charges the caller's customers).",
        tags=["gateway_account"],
        responses={200: GatewayAccountOut, 404: ERROR},
    )
    def get(self, request):
        # Scoped, and read as the tenant: row-level security holds here too.
        account = self.scoped(GatewayAccount).first()
        if account is None:
            raise ResourceMissing(_NONE)
        return Response(accounts.gateway_account_data(account))

    @extend_schema(
        operation_id="gateway_account_set",
        summary="Set the gateway account",
        description="Sets all of it (a second call replaces it; the `slug` stays). From the next charge on, "
        "every charge of the caller's invoices in this mode goes to that account. 422 for a key of the other "
        "mode or shape; nothing is written then.",
        tags=["gateway_account"],
        request=GatewayAccountSet,
        # A body's errors, which the schema class documents for POST only.
        responses={200: GatewayAccountOut, 400: ERROR, 413: ERROR, 415: ERROR, 422: ERROR},
    )
    def put(self, request):
        return self._set(request)

    @extend_schema(
        operation_id="gateway_account_set_post",
        summary="Set the gateway account (POST)",
        description="The same as `PUT /v1/gateway_account`, for clients that only POST (honours `Idempotency-Key`).",
        tags=["gateway_account"],
        request=GatewayAccountSet,
        responses={200: GatewayAccountOut},
    )
    def post(self, request):
        return self._set(request)

    @extend_schema(
        operation_id="gateway_account_delete",
        summary="Remove the gateway account",
        description="Charges in this mode go to the platform's Stripe account again. 404 when there is none.",
        tags=["gateway_account"],
        responses={200: GatewayAccountDeleted, 404: ERROR},
    )
    def delete(self, request):
        with transaction.atomic():
            account = accounts.delete_account(tenant_id=self.tenant.pk, livemode=self.livemode)
            if account is None:
                raise ResourceMissing(_NONE)
            audit.record(
                accounts.AUDIT_DELETED, obj=account, request=request, message=f"Removed: {accounts.describe(account)}."
            )
        return Response({"id": account.id, "object": "gateway_account", "deleted": True})
