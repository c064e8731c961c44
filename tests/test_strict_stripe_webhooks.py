"""The strict dev Stripe as Stripe's webhook sender (devstack/strict_stripe.py, docs/decisions/0135): its events
verify with the ``stripe`` library, one per PaymentIntent status change, retried until a 2xx."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import stripe

from devstack.strict_stripe import (
    WebhookSender,
    generate_webhook_secret,
    payment_intent_event_type,
    stripe_signature,
)


class Receiver:
    """A local endpoint answering the statuses given in turn (then 200), keeping what it got."""

    def __init__(self, statuses=()):
        self.statuses = list(statuses)
        self.received: list[tuple[bytes, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                return

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((body, self.headers.get("Stripe-Signature", "")))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/stripe/webhooks/platform"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _intent(status, **extra):
    return {"id": "pi_1", "object": "payment_intent", "status": status, "livemode": False, **extra}


def test_events_verify_with_the_stripe_library_and_follow_status_changes_only(receiver):
    secret = generate_webhook_secret()
    sender = WebhookSender(receiver.url, secret)
    try:
        sender.observe(_intent("requires_action"))
        sender.observe(_intent("requires_action"))  # a replayed answer: no change, no event
        sender.observe(_intent("succeeded"))
        assert sender.wait_idle()
    finally:
        sender.stop()

    types = []
    for body, signature in receiver.received:
        event = stripe.Webhook.construct_event(body, signature, secret, tolerance=300)
        types.append(event.type)
        with pytest.raises(stripe.SignatureVerificationError):
            stripe.Webhook.construct_event(body, signature, generate_webhook_secret(), tolerance=300)
    assert types == ["payment_intent.created", "payment_intent.requires_action", "payment_intent.succeeded"]


def test_a_delivery_without_a_2xx_is_retried_then_given_up():
    receiver = Receiver(statuses=[500, 503])
    sender = WebhookSender(receiver.url, generate_webhook_secret(), retry_delays_s=(0.05, 0.05))
    failing = Receiver(statuses=[500] * 10)
    gives_up = WebhookSender(failing.url, generate_webhook_secret(), retry_delays_s=(0.05,))
    try:
        event = sender.send("payment_intent.succeeded", _intent("succeeded"))
        gives_up.send("payment_intent.succeeded", _intent("succeeded"))
        assert sender.wait_idle() and gives_up.wait_idle()
    finally:
        sender.stop()
        gives_up.stop()
        receiver.close()
        failing.close()

    assert sender.deliveries[0].statuses == [500, 503, 200] and sender.deliveries[0].delivered
    assert {json.loads(body)["id"] for body, _ in receiver.received} == {event["id"]}  # same event id each time
    assert gives_up.deliveries[0].statuses == [500, 500] and not gives_up.deliveries[0].delivered


def test_the_signature_is_stripes_scheme():
    # https://docs.stripe.com/webhooks#verify-manually: HMAC-SHA256 of "{t}.{payload}", hex, keyed by the secret.
    import hashlib
    import hmac

    header = stripe_signature(b'{"a":1}', "whsec_test", 1700000000)
    expected = hmac.new(b"whsec_test", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_event_types_per_status():
    assert payment_intent_event_type(_intent("processing")) == "payment_intent.processing"
    assert payment_intent_event_type(_intent("requires_payment_method")) is None
    failed = _intent("requires_payment_method", last_payment_error={"code": "card_declined"})
    assert payment_intent_event_type(failed) == "payment_intent.payment_failed"
    assert payment_intent_event_type(_intent("requires_confirmation")) is None


def test_a_secret_that_is_not_whsec_is_refused():
    with pytest.raises(ValueError):
        WebhookSender("http://127.0.0.1:1/x", "sk_test_nope")
