"""Inbound Stripe webhooks: the events a Stripe account sends to ``POST /stripe/webhooks/<slug>``.

The account is :func:`billing.gateway_accounts.webhook_account` (its signing secret, and the
tenant whose invoices its events may touch); the event is verified by the ``stripe`` library
(``stripe.Webhook.construct_event``, tolerance :data:`TOLERANCE_S`: the signature's timestamp
may be at most five minutes old, https://docs.stripe.com/webhooks#verify-events) and acted on
once per ``(account, event id)`` (:class:`~billing.models.StripeEvent`).

Stripe does not promise order (https://docs.stripe.com/webhooks#event-ordering), so an event
never decides by arriving: a PaymentIntent event in a state the PaymentIntent may still leave
(anything but ``succeeded`` and ``canceled``) is re-checked by retrieving the PaymentIntent
through :func:`~billing.gateway_accounts.gateway_for`, and the invoice's row lock and its latest
payment attempt's state decide (:func:`billing.services.payments.record_payment_intent`), as for
the drain and the reconciler, which stay the fallback. docs/decisions/0135-inbound-stripe-webhooks.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import stripe
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef

from billing import gateway as gw
from billing.events import charge_event
from billing.gateway_accounts import WebhookAccount, gateway_for
from billing.models import GatewayAccount, Invoice, StripeEvent
from billing.services.credit_notes import refund_from_gateway, refunds_to_check, send_refund
from billing.services.payments import PaymentIntentEffect, billing_time, invoice_clock_id, record_payment_intent
from hardcount import tenancy

log = logging.getLogger("billing.stripe_webhooks")

# Seconds a signature's timestamp may be old: Stripe's default (replay protection).
TOLERANCE_S = 300
PAYMENT_INTENT_EVENTS = frozenset(
    {
        "payment_intent.succeeded",
        "payment_intent.payment_failed",
        "payment_intent.requires_action",
        "payment_intent.processing",
        "payment_intent.canceled",
    }
)
# Recorded and mirrored to the tenant; a charge.refunded also makes the invoice's open refunds be looked up.
CHARGE_EVENTS = frozenset({"charge.refunded", "charge.dispute.created"})
# A refund's state, re-checked at the gateway and recorded on the Hardcount refund it belongs to.
REFUND_EVENTS = frozenset({"refund.created", "refund.updated"})
# PaymentIntent statuses it never leaves: an event carrying one is taken as delivered.
FINAL_STATUSES = frozenset({gw.SUCCEEDED, "canceled"})


class EventRejected(Exception):
    """The request is not a verified Stripe event of the account (a 400; nothing was written)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class GatewayUnavailable(Exception):
    """The PaymentIntent could not be retrieved to re-check the event (a 503: Stripe delivers it again)."""


@dataclass(frozen=True)
class Receipt:
    """What one delivery came to: ``result`` one of :data:`StripeEvent.RESULTS`; ``duplicate`` a redelivery."""

    event_id: str
    type: str
    result: str
    duplicate: bool = False
    invoice_id: str | None = None


def verify(account: WebhookAccount, payload: bytes, signature: str | None) -> dict[str, Any]:
    """The event ``payload`` carries, as a plain dict, once its ``Stripe-Signature`` verifies with the account's secret.

    Raises :class:`EventRejected` for a missing, wrong or stale signature (``signature_invalid``) and
    for a body that is not a Stripe event (``event_invalid``).
    """
    if not signature:
        raise EventRejected("signature_invalid", "The Stripe-Signature header is missing.")
    try:
        event = stripe.Webhook.construct_event(payload, signature, account.signing_secret, tolerance=TOLERANCE_S)
    except stripe.SignatureVerificationError as exc:
        raise EventRejected(
            "signature_invalid", f"The Stripe-Signature does not verify: {exc.user_message or exc}"
        ) from None
    except (ValueError, AttributeError, TypeError, KeyError):
        # After the signature verified: the library assumes a JSON object and fails on other JSON (an array).
        raise EventRejected("event_invalid", "The body is not a JSON Stripe event.") from None
    data = event.to_dict()
    obj = (data.get("data") or {}).get("object") if isinstance(data.get("data"), dict) else None
    if not (isinstance(data.get("id"), str) and data["id"] and isinstance(data.get("type"), str)):
        raise EventRejected("event_invalid", "The event has no id or type.")
    if not isinstance(obj, dict):
        raise EventRejected("event_invalid", "The event has no data.object.")
    return data


def handle(account: WebhookAccount, event: dict[str, Any]) -> Receipt:
    """Act on a verified ``event`` of ``account`` once; a redelivery of the same id changes nothing.

    Raises :class:`GatewayUnavailable` when a PaymentIntent event needs a re-check the gateway
    cannot answer (nothing was written, so Stripe's redelivery is acted on).
    """
    event_id, type_ = event["id"], event["type"]
    if StripeEvent.objects.filter(account=account.slug, event_id=event_id).exists():
        return Receipt(event_id, type_, _stored_result(account, event_id), duplicate=True)
    obj = event["data"]["object"]
    if type_ in PAYMENT_INTENT_EVENTS and obj.get("object") == "payment_intent":
        return _payment_intent_event(account, event, obj)
    if type_ in CHARGE_EVENTS:
        receipt = _charge_event(account, event, obj)
        if type_ == "charge.refunded" and receipt.invoice_id and not receipt.duplicate:
            _look_up_open_refunds(receipt.invoice_id)
        return receipt
    if type_ in REFUND_EVENTS and obj.get("object") == "refund":
        return _refund_event(account, event, obj)
    return _store(account, event, StripeEvent.IGNORED, detail="event type not handled")


# --- PaymentIntents --------------------------------------------------------------------------------------------------


def _payment_intent_event(account: WebhookAccount, event: dict, obj: dict) -> Receipt:
    intent_id = _text(obj.get("id"))
    invoice = _invoice_of(account, intent_id, _metadata(obj))
    if invoice is None:
        return _store(account, event, StripeEvent.NO_INVOICE, payment_intent_id=intent_id)
    intent = stripe.PaymentIntent.construct_from(obj, None)
    if obj.get("status") not in FINAL_STATUSES:
        # The event may be older than the PaymentIntent's state now: ask the gateway.
        try:
            intent = gateway_for(invoice.tenant_id, invoice.livemode).retrieve_payment_intent(intent_id)
        except stripe.StripeError as exc:
            raise GatewayUnavailable(f"retrieving {intent_id}: {type(exc).__name__} ({exc.http_status})") from exc
    result = gw.classify_payment_intent(intent)
    with transaction.atomic(), tenancy.cross_tenant():
        row = _insert(account, event, StripeEvent.NO_CHANGE, invoice=invoice, payment_intent_id=intent_id)
        if row is None:
            return Receipt(event["id"], event["type"], _stored_result(account, event["id"]), duplicate=True)
        effect, outcome = record_payment_intent(invoice.id, result)
        row.result = StripeEvent.APPLIED if effect == PaymentIntentEffect.RECORDED else StripeEvent.NO_CHANGE
        row.detail = f"{effect}: PaymentIntent {result.payment_intent_status}" + (
            f", {outcome.kind}" if outcome is not None else ""
        )
        row.save(update_fields=["result", "detail"])
    return Receipt(event["id"], event["type"], row.result, invoice_id=invoice.id)


# --- charges: refunds and disputes, recorded -----------------------------------------------------------------------


def _charge_event(account: WebhookAccount, event: dict, obj: dict) -> Receipt:
    intent_id = _text(obj.get("payment_intent"))
    invoice = _invoice_of(account, intent_id, _metadata(obj)) if intent_id else None
    if invoice is None:
        return _store(account, event, StripeEvent.NO_INVOICE, payment_intent_id=intent_id)
    with transaction.atomic(), tenancy.cross_tenant():
        row = _insert(account, event, StripeEvent.APPLIED, invoice=invoice, payment_intent_id=intent_id)
        if row is None:
            return Receipt(event["id"], event["type"], _stored_result(account, event["id"]), duplicate=True)
        now = billing_time(invoice_clock_id(invoice, invoice.subscription))
        charge_event(invoice, event["type"], _charge_data(event["type"], obj, invoice), created_at=now)
    return Receipt(event["id"], event["type"], StripeEvent.APPLIED, invoice_id=invoice.id)


def _charge_data(type_: str, obj: dict, invoice: Invoice) -> dict[str, Any]:
    """The tenant event's data: Stripe's object, reduced to what is recorded, with the invoice it belongs to."""
    common = {
        "id": _text(obj.get("id")),
        "livemode": invoice.livemode,
        "amount": _int(obj.get("amount")),
        "currency": _text(obj.get("currency")).lower() or invoice.currency,
        "payment_intent": _text(obj.get("payment_intent")),
        "invoice": invoice.id,
    }
    if type_ == "charge.dispute.created":
        return {
            **common,
            "object": "dispute",
            "charge": _text(obj.get("charge")) or None,
            "reason": _text(obj.get("reason")) or None,
            "status": _text(obj.get("status")) or None,
        }
    return {
        **common,
        "object": "charge",
        "amount_refunded": _int(obj.get("amount_refunded")),
        "refunded": bool(obj.get("refunded")),
    }


# --- refunds -------------------------------------------------------------------------------------------------------


def _refund_event(account: WebhookAccount, event: dict, obj: dict) -> Receipt:
    """A ``refund.*`` event: the refund is retrieved from the gateway (events come in any order) and its
    state recorded on the Hardcount refund of the same id or ``hardcount_refund`` metadata, once."""
    intent_id = _text(obj.get("payment_intent"))
    invoice = _invoice_of(account, intent_id, _metadata(obj)) if intent_id else None
    if invoice is None:
        return _store(account, event, StripeEvent.NO_INVOICE, payment_intent_id=intent_id)
    refund_id = _text(obj.get("id"))
    try:
        current = gateway_for(invoice.tenant_id, invoice.livemode).retrieve_refund(refund_id)
    except stripe.StripeError as exc:
        raise GatewayUnavailable(f"retrieving {refund_id}: {type(exc).__name__} ({exc.http_status})") from exc
    with transaction.atomic(), tenancy.cross_tenant():
        row = _insert(account, event, StripeEvent.NO_CHANGE, invoice=invoice, payment_intent_id=intent_id)
        if row is None:
            return Receipt(event["id"], event["type"], _stored_result(account, event["id"]), duplicate=True)
        refund = refund_from_gateway(current, tenant_id=invoice.tenant_id, livemode=invoice.livemode)
        if refund is not None:
            row.result, row.detail = StripeEvent.APPLIED, f"refund {refund.id}: {refund.outcome} ({refund.status})"
            row.save(update_fields=["result", "detail"])
    return Receipt(event["id"], event["type"], row.result, invoice_id=invoice.id)


def _look_up_open_refunds(invoice_id: str) -> None:
    """After a ``charge.refunded``: look the invoice's refunds without a definite outcome up at the gateway
    (never re-sent from here; the reconciler stays the fallback when the gateway does not answer)."""
    invoice = Invoice.objects.get(pk=invoice_id)
    for refund_id in refunds_to_check(invoice):
        send_refund(refund_id, look_up_only=True)


# --- rows ----------------------------------------------------------------------------------------------------------


def _invoice_of(account: WebhookAccount, payment_intent_id: str, metadata: dict) -> Invoice | None:
    """The invoice a PaymentIntent belongs to, among those ``account``'s events may touch, or None.

    Found by the invoice's PaymentIntent id, else by the PaymentIntent's ``hardcount_invoice``
    metadata (a create whose answer was not recorded yet), which must agree with its
    ``hardcount_tenant`` and with an invoice that has no other PaymentIntent. A tenant's own
    account touches that tenant's invoices of its mode only; the platform account (``tenant_id``
    None) those it charges: of every tenant and mode without an account of its own
    (:func:`billing.gateway_accounts.gateway_for`).
    """
    invoices = Invoice.objects.all()
    if account.tenant_id is not None:
        invoices = invoices.filter(tenant_id=account.tenant_id, livemode=account.livemode)
    else:
        own_account = GatewayAccount.objects.filter(tenant_id=OuterRef("tenant_id"), livemode=OuterRef("livemode"))
        invoices = invoices.exclude(Exists(own_account))
    if payment_intent_id:
        invoice = invoices.filter(payment_intent_id=payment_intent_id).first()
        if invoice is not None:
            return invoice
    invoice_id = _text(metadata.get(gw.INVOICE_METADATA_KEY))
    if not invoice_id:
        return None
    invoice = invoices.filter(pk=invoice_id, payment_intent_id__in=["", payment_intent_id]).first()
    tenant_id = _text(metadata.get(gw.TENANT_METADATA_KEY))
    if invoice is None or (tenant_id and tenant_id != invoice.tenant_id):
        return None
    return invoice


def _store(
    account: WebhookAccount, event: dict, result: str, *, payment_intent_id: str = "", detail: str = ""
) -> Receipt:
    with transaction.atomic(), tenancy.cross_tenant():
        row = _insert(account, event, result, payment_intent_id=payment_intent_id, detail=detail)
    if row is None:
        return Receipt(event["id"], event["type"], _stored_result(account, event["id"]), duplicate=True)
    return Receipt(event["id"], event["type"], result)


def _insert(
    account: WebhookAccount,
    event: dict,
    result: str,
    *,
    invoice: Invoice | None = None,
    payment_intent_id: str = "",
    detail: str = "",
) -> StripeEvent | None:
    """Insert the event's row (inside the caller's transaction); None when the event is there already.

    A concurrent delivery of the same event waits on the unique index until the first commits,
    then lands here as a duplicate: the event is acted on once.
    """
    try:
        with transaction.atomic():
            return StripeEvent.objects.create(
                account=account.slug,
                event_id=event["id"][:255],
                type=event["type"][:100],
                livemode=bool(event.get("livemode")),
                tenant_id=invoice.tenant_id if invoice is not None else None,
                invoice=invoice,
                payment_intent_id=payment_intent_id[:255],
                result=result,
                detail=detail,
                # A PaymentIntent's client_secret lets whoever holds it confirm the payment: not kept.
                data={k: v for k, v in event["data"]["object"].items() if k != "client_secret"},
                stripe_created_at=_created(event.get("created")),
            )
    except IntegrityError:
        return None


def _stored_result(account: WebhookAccount, event_id: str) -> str:
    return (
        StripeEvent.objects.filter(account=account.slug, event_id=event_id).values_list("result", flat=True).first()
        or StripeEvent.NO_CHANGE
    )


def _metadata(obj: dict) -> dict:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _created(value) -> datetime | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**33:
        return datetime.fromtimestamp(value, UTC)
    return None


__all__ = [
    "CHARGE_EVENTS",
    "PAYMENT_INTENT_EVENTS",
    "REFUND_EVENTS",
    "TOLERANCE_S",
    "EventRejected",
    "GatewayUnavailable",
    "Receipt",
    "handle",
    "verify",
]
