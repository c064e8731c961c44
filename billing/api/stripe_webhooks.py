"""``POST /stripe/webhooks/<slug>``: Stripe's events about the payments it makes for us (outside /v1 and its keys).

Authenticated by the event's ``Stripe-Signature`` alone (billing/stripe_webhooks.py); answers
quickly with 200 and a receipt, also for an event type it ignores and for a redelivery.
"""

from __future__ import annotations

import logging

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import stripe_webhooks
from billing.gateway_accounts import webhook_account
from billing.models import StripeEvent
from billing.vault import SecretUnreadable
from hardcount.api import ErrorSerializer, JsonOnlyNegotiation
from hardcount.errors import INVALID_REQUEST, error_body

log = logging.getLogger("billing.stripe_webhooks")


class StripeWebhookReceipt(serializers.Serializer):
    """What the delivery came to."""

    received = serializers.BooleanField(help_text="Always true: the event was verified and is recorded.")
    id = serializers.CharField(help_text="The Stripe event's id.")
    type = serializers.CharField(help_text="The Stripe event's type.")
    result = serializers.ChoiceField(choices=StripeEvent.RESULTS, help_text="What the event came to.")
    duplicate = serializers.BooleanField(help_text="True for a redelivery of an event already received.")


class StripeWebhookView(APIView):
    """Receive one Stripe event for the account ``slug``."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    parser_classes: list = []  # the body is read raw: the signature covers its exact bytes
    renderer_classes = [JSONRenderer]
    content_negotiation_class = JsonOnlyNegotiation

    @extend_schema(
        operation_id="stripe_webhooks_receive",
        summary="Receive a Stripe event (Stripe's webhook endpoint)",
        description="For Stripe, not for API clients: the Stripe account's webhook endpoint posts its events "
        "here, signed with the endpoint's `whsec_` secret in the `Stripe-Signature` header (a timestamp at "
        "most 300 s old). Each event is acted on once per account and event id; a redelivery answers 200 "
        "with `duplicate` true. `payment_intent.succeeded`, `payment_intent.payment_failed`, "
        "`payment_intent.requires_action` and `payment_intent.processing` settle the invoice's payment; "
        "`charge.refunded` and `charge.dispute.created` are recorded and mirrored to the tenant; other types "
        "are ignored (200). 400 for a missing, wrong or stale signature or a body that is not an event "
        "(nothing written); 404 for an unknown account; 411/413 for a body without a length or over 1 MiB; "
        "503 when the PaymentIntent could not be re-checked "
        "at Stripe (Stripe delivers the event again).",
        tags=["stripe"],
        auth=[],
        request={"application/json": OpenApiTypes.OBJECT},
        parameters=[
            OpenApiParameter(
                "slug", str, OpenApiParameter.PATH, description="The Stripe account's webhook slug (`platform`)."
            ),
            OpenApiParameter(
                "Stripe-Signature",
                str,
                OpenApiParameter.HEADER,
                required=False,
                description='`t=<unix time>,v1=<HMAC-SHA256 of "{t}.{body}">`, as Stripe signs.',
            ),
        ],
        responses={
            200: StripeWebhookReceipt,
            400: ErrorSerializer,
            404: ErrorSerializer,
            411: ErrorSerializer,
            413: ErrorSerializer,
            503: ErrorSerializer,
        },
    )
    def post(self, request, slug):
        try:
            account = webhook_account(slug)
        except SecretUnreadable:
            # Our configuration, not the sender's fault: a 5xx, so Stripe redelivers once the key is back.
            log.error("stripe webhook %s: its signing secret decrypts under no configured key", slug)
            return _error(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                "signing_secret_unreadable",
                "Try again: the endpoint is misconfigured.",
            )
        if account is None:
            return _error(status.HTTP_404_NOT_FOUND, "resource_missing", f"No Stripe webhook endpoint {slug!r}.")
        payload = request._request.body
        try:
            event = stripe_webhooks.verify(account, payload, request.headers.get("Stripe-Signature"))
        except stripe_webhooks.EventRejected as exc:
            return _error(status.HTTP_400_BAD_REQUEST, exc.code, exc.message, param="Stripe-Signature")
        try:
            receipt = stripe_webhooks.handle(account, event)
        except stripe_webhooks.GatewayUnavailable as exc:
            log.warning("stripe event %s (%s) not acted on: %s", event["id"], event["type"], exc)
            return _error(
                status.HTTP_503_SERVICE_UNAVAILABLE, "gateway_unavailable", "Try again: the gateway did not answer."
            )
        return Response(
            {
                "received": True,
                "id": receipt.event_id,
                "type": receipt.type,
                "result": receipt.result,
                "duplicate": receipt.duplicate,
            }
        )


def _error(status_code: int, code: str, message: str, *, param: str | None = None) -> Response:
    return Response(error_body(INVALID_REQUEST, code, message, param), status=status_code)
