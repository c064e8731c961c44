"""The caller's business details over HTTP: ``GET /v1/account`` and ``POST /v1/account``.

What the tenant's invoice documents (PDF and hosted page) print as the seller. One per tenant, both
modes alike: the API key's tenant. Rules: :mod:`billing.services.account`.
"""

from __future__ import annotations

from babel import Locale
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from billing.services.account import account_data, update_business_details
from hardcount.api import ERROR, ApiView, StrictCharField, StrictChoiceField, StrictSerializer, object_field

# ISO 3166-1 alpha-2 codes as Babel's CLDR data knows them (its numeric keys are regions, not countries).
COUNTRIES = sorted(code for code in Locale("en").territories if len(code) == 2 and code.isalpha())


class AddressIn(StrictSerializer):
    line1 = StrictCharField(required=False, allow_blank=True, max_length=200)
    line2 = StrictCharField(required=False, allow_blank=True, max_length=200)
    city = StrictCharField(required=False, allow_blank=True, max_length=100)
    postal_code = StrictCharField(required=False, allow_blank=True, max_length=20)
    state = StrictCharField(required=False, allow_blank=True, max_length=100)
    country = StrictChoiceField(
        choices=COUNTRIES,
        required=False,
        allow_blank=True,
        help_text="ISO 3166-1 alpha-2, upper case (`US`, `DE`, `JP`); blank clears it.",
    )


class AccountUpdate(StrictSerializer):
    """Fields left out stay as they are; a blank string clears one."""

    business_name = StrictCharField(
        required=False,
        allow_blank=True,
        max_length=200,
        help_text="The seller's name on invoice documents; blank: the tenant's `name`.",
    )
    address = AddressIn(required=False)


class AddressOut(serializers.Serializer):
    line1 = serializers.CharField(allow_null=True)
    line2 = serializers.CharField(allow_null=True)
    city = serializers.CharField(allow_null=True)
    postal_code = serializers.CharField(allow_null=True)
    state = serializers.CharField(allow_null=True)
    country = serializers.CharField(allow_null=True)


class AccountOut(serializers.Serializer):
    """The caller's tenant as its customers' documents show it."""

    id = serializers.CharField()
    object = object_field("account")
    name = serializers.CharField()
    business_name = serializers.CharField(allow_null=True)
    address = AddressOut()


class AccountView(ApiView):
    @extend_schema(
        operation_id="account_retrieve",
        summary="Retrieve the caller's business details",
        tags=["account"],
        responses={200: AccountOut},
    )
    def get(self, request):
        return Response(account_data(self.tenant))

    @extend_schema(
        operation_id="account_update",
        summary="Update the caller's business details",
        description="The seller's name and address printed on every invoice document rendered from now on "
        "(earlier invoices' documents too: they are rendered when asked for). 422 for an unknown country code.",
        tags=["account"],
        request=AccountUpdate,
        responses={200: AccountOut, 400: ERROR, 413: ERROR, 415: ERROR, 422: ERROR},
    )
    def post(self, request):
        data = self.read_body(AccountUpdate)
        tenant = update_business_details(
            self.tenant.pk, business_name=data.get("business_name"), address=data.get("address")
        )
        return Response(account_data(tenant))
