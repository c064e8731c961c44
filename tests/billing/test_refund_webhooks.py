"""Refunds reconciled from Stripe's own events (``refund.created``, ``refund.updated``, ``charge.refunded``) at
``/stripe/webhooks/platform``: re-checked at the gateway, recorded once, in any order
(docs/reference/credit-notes.md)."""

from __future__ import annotations

import json
import time

import pytest
from django.test import Client

from billing.models import CreditNote, Invoice, Refund, StripeEvent
from billing.services.credit_notes import create_credit_note
from billing.services.drain import drain_due
from devstack.strict_stripe import generate_webhook_secret, stripe_signature
from tests.billing.conftest import VISA, events

SECRET = generate_webhook_secret()
URL = "/stripe/webhooks/platform"


@pytest.fixture(autouse=True)
def _webhook_secret(settings):
    settings.STRIPE_WEBHOOK_SECRET = SECRET


def _post(type_: str, obj: dict, *, event_id: str | None = None):
    event = {
        "id": event_id or f"evt_{type_.replace('.', '_')}_{time.monotonic_ns()}",
        "object": "event",
        "api_version": "2024-06-20",
        "created": int(time.time()),
        "livemode": False,
        "type": type_,
        "data": {"object": obj},
    }
    payload = json.dumps(event).encode()
    response = Client().post(
        URL,
        data=payload,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=stripe_signature(payload, SECRET, int(time.time())),
    )
    assert response.status_code == 200, response.content
    return response.json()


def _refunded(book, stripe_proxy, *, lose_answer: bool = False) -> tuple[Invoice, Refund]:
    tenant = book.tenant()
    sub = book.subscribed(tenant, card=VISA)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    if lose_answer:
        stripe_proxy.fail_next("reset", match="POST /v1/refunds")
    note = create_credit_note(invoice.id, tenant_id=tenant.id, livemode=False, amount=300, refund_amount=300)
    return invoice, Refund.objects.get(credit_note=note)


def test_a_refund_that_fails_later_is_recorded_from_refund_updated_once(book, stripe_proxy, stripe_client):
    _invoice, refund = _refunded(book, stripe_proxy)
    assert refund.outcome == Refund.SUCCEEDED
    stripe_proxy.set_refund_status(refund.gateway_refund_id, "failed")
    obj = stripe_client.v1.refunds.retrieve(refund.gateway_refund_id).to_dict()

    first = _post("refund.updated", obj, event_id="evt_refund_failed_1")
    again = _post("refund.updated", obj, event_id="evt_refund_failed_1")
    assert (first["result"], again["duplicate"]) == ("applied", True)
    refund.refresh_from_db()
    assert (refund.outcome, refund.status) == (Refund.FAILED, "failed")
    assert StripeEvent.objects.filter(event_id="evt_refund_failed_1").count() == 1
    # The credit note stands (as at Stripe): the failed refund is for the operator to follow up.
    assert CreditNote.objects.get(pk=refund.credit_note_id).status == CreditNote.ISSUED


def test_a_stale_refund_event_is_re_checked_at_the_gateway(book, stripe_proxy, stripe_client):
    _invoice, refund = _refunded(book, stripe_proxy)
    stale = {**stripe_client.v1.refunds.retrieve(refund.gateway_refund_id).to_dict(), "status": "pending"}
    assert _post("refund.updated", stale)["result"] == "applied"
    refund.refresh_from_db()
    assert (refund.outcome, refund.status) == (Refund.SUCCEEDED, "succeeded")
    assert len(events("invoice.refunded")) == 1


def test_charge_refunded_resolves_a_refund_whose_answer_was_lost_without_sending_it_again(
    book, stripe_proxy, stripe_client
):
    invoice, refund = _refunded(book, stripe_proxy, lose_answer=True)
    assert refund.outcome == Refund.UNKNOWN
    intent = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id)
    charge_id = intent.latest_charge if isinstance(intent.latest_charge, str) else intent.latest_charge.id
    charge = stripe_client.v1.charges.retrieve(charge_id).to_dict()
    assert (charge["amount_refunded"], charge["refunded"]) == (300, False)

    assert _post("charge.refunded", charge)["result"] == "applied"
    refund.refresh_from_db()
    assert (refund.outcome, refund.gateway_refund_id != "") == (Refund.SUCCEEDED, True)
    assert [e.action for e in stripe_proxy.entries("POST /v1/refunds")] == ["reset"]
    (mirrored,) = events("charge.refunded")
    assert (mirrored.data["amount_refunded"], mirrored.data["invoice"]) == (300, invoice.id)


def test_the_strict_dev_stripe_sends_refund_events(book, stripe_proxy, live_server):
    sender = stripe_proxy.send_webhooks_to(f"{live_server.url}{URL}", SECRET, retry_delays_s=(0.2,))
    try:
        _invoice, refund = _refunded(book, stripe_proxy)
        assert sender.wait_idle()
        stripe_proxy.set_refund_status(refund.gateway_refund_id, "canceled")
        assert sender.wait_idle()
        stripe_proxy.set_refund_status(refund.gateway_refund_id, "succeeded")
        assert sender.wait_idle()
    finally:
        stripe_proxy.stop_webhooks()
    types = [d.event["type"] for d in sender.deliveries if not d.event["type"].startswith("payment_intent.")]
    assert types == ["refund.created", "charge.refunded", "refund.updated", "refund.updated"]
    assert all(d.statuses == [200] for d in sender.deliveries)
    refund.refresh_from_db()
    assert refund.outcome == Refund.SUCCEEDED
