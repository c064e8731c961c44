"""API authentication: ``Authorization: Bearer hc_test_…|hc_live_…`` (docs/reference/domain.md, docs/reference/api.md).

HTTP Basic with the key as the user name (``curl -u hc_test_…:``) is accepted too, as Stripe accepts it.

The key decides everything: its tenant and its mode. After authentication the request
carries ``request.tenant`` (a :class:`~hardcount.models.Tenant`), ``request.livemode``
(bool) and ``request.auth`` (the :class:`~hardcount.models.ApiKey` row). Only the
SHA-256 of a key is stored, so lookup is by hash; revoked keys are refused.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication

from hardcount.errors import Unauthenticated
from hardcount.models import LIVE_KEY_PREFIX, TEST_KEY_PREFIX, ApiKey, Tenant, hash_api_key

# Longest key accepted before hashing: real keys are 8 + 32 characters.
_MAX_KEY_LENGTH = 200


@dataclass(frozen=True)
class ApiPrincipal:
    """``request.user`` for an API call: the tenant and mode of the key used."""

    tenant: Tenant
    livemode: bool
    is_authenticated: bool = True
    is_anonymous: bool = False


def _key_from_header(header: str) -> str:
    """The API key an ``Authorization`` header carries: ``Bearer <key>``, or ``Basic base64(<key>:)``.

    Basic is accepted as Stripe accepts it (``curl -u hc_test_…:``): the key is the user name and the
    password, normally empty, is ignored. Raises :class:`~hardcount.errors.Unauthenticated` for any
    other scheme, a credential that is not base64 of ``user:password``, or a value shaped unlike a key.
    """
    scheme, _, credential = header.strip().partition(" ")
    credential = credential.strip()
    if scheme.lower() == "bearer" and credential:
        key = credential
    elif scheme.lower() == "basic" and credential and len(credential) <= 2 * _MAX_KEY_LENGTH:
        try:
            user, colon, _password = base64.b64decode(credential, validate=True).decode("ascii").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise Unauthenticated("Invalid API key.") from None
        if not colon:
            raise Unauthenticated("Invalid API key.")
        key = user
    else:
        raise Unauthenticated("Use the Authorization header: Bearer <api key>.")
    if len(key) > _MAX_KEY_LENGTH or not key.startswith((TEST_KEY_PREFIX, LIVE_KEY_PREFIX)):
        raise Unauthenticated("Invalid API key.")
    return key


class ApiKeyAuthentication(BaseAuthentication):
    """DRF authentication by bearer API key.

    Raises :class:`~hardcount.errors.Unauthenticated` (401) for a missing, malformed,
    unknown or revoked key; on success sets ``request.tenant`` and ``request.livemode``.
    """

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            raise Unauthenticated("No API key provided. Use the Authorization header: Bearer <api key>.")
        key = _key_from_header(header)
        api_key = (
            ApiKey.objects.select_related("tenant").filter(key_hash=hash_api_key(key), revoked_at__isnull=True).first()
        )
        if api_key is None:
            raise Unauthenticated("Invalid API key.")
        for target in (request, request._request):
            target.tenant = api_key.tenant
            target.livemode = api_key.livemode
        return ApiPrincipal(tenant=api_key.tenant, livemode=api_key.livemode), api_key

    def authenticate_header(self, request) -> str:
        # A non-empty value makes DRF answer 401 (not 403) to unauthenticated requests.
        return 'Bearer realm="hardcount"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Documents :class:`ApiKeyAuthentication` in the OpenAPI document: HTTP bearer, or HTTP Basic with the key as
    the username (either one authenticates a request)."""

    target_class = "hardcount.auth.ApiKeyAuthentication"
    name = ["ApiKey", "ApiKeyBasic"]

    def get_security_requirement(self, auto_schema):
        # Two requirement objects: either scheme alone authenticates (one object naming both would mean both).
        return [{"ApiKey": []}, {"ApiKeyBasic": []}]

    def get_security_definition(self, auto_schema):
        return [
            {
                "type": "http",
                "scheme": "bearer",
                "description": "A secret key `hc_test_…` (test mode) or `hc_live_…` (live mode). "
                "The key decides the tenant and the mode of every object the request sees.",
            },
            {
                "type": "http",
                "scheme": "basic",
                "description": "The same secret key as the username and an empty password, as Stripe's "
                "clients send it (`curl -u hc_test_…:`).",
            },
        ]
