"""The payment gateway: Stripe PaymentIntents through the real ``stripe`` library.

``settings.STRIPE_API_BASE`` points the library at ``localstripe`` in development and tests
(unset: Stripe itself); ``settings.STRIPE_API_KEY`` is the secret key;
``settings.HARDCOUNT_GATEWAY_TIMEOUT_S`` bounds every HTTP request. The library's own network
retries are off: every retry is a decision of the caller, made with an idempotency key the
caller chose (docs/decisions/0011-payment-attempts-and-idempotency-keys.md).

Idempotency keys (docs/reference/billing.md#idempotency-keys), all derived from Hardcount ids so a crashed
process re-derives them:

- ``hc:{invoice_id}:create`` creates and confirms the invoice's one PaymentIntent;
- ``hc:{invoice_id}:attempt:{n}`` confirms it again for payment attempt ``n`` (a ladder or
  dunning retry), so a retry really reaches the card instead of replaying the first decline;
- ``hc:{customer_id}:customer:{digest}`` creates the gateway customer, lazily, on the first
  charge (``digest`` hashes the body, so an email changed after a lost answer cannot make the
  key unusable; the worst case is an orphan gateway customer);
- ``hc:{customer_id}:attach:{pm}`` attaches a payment method to it;
- ``hc:{credit_note_id}:refund`` creates the one refund of a credit note (:meth:`Gateway.refund`; once that
  key may have expired, :meth:`Gateway.find_refund` looks it up by metadata first).

Outcomes of a charge, told apart by the exception classes the library raises:

- ``succeeded``: the PaymentIntent succeeded;
- ``declined``: ``stripe.CardError`` (HTTP 402), with the ``decline_code``;
- ``unknown``: ``stripe.APIConnectionError`` (timeout, connection reset: the request may have
  run), or a PaymentIntent that finishes later: ``processing``, or ``requires_action`` (the
  customer must authenticate, docs/reference/payments.md); it is resolved by sending the same request under
  the same key again, never by a new key, while the key is young; a pending PaymentIntent,
  and any attempt whose key may have expired, is resolved by :meth:`Gateway.look_up` instead;
- ``error``: anything else (5xx, 429, other 4xx, authentication). A 5xx, 409 or 429, or no
  HTTP status at all, is *transient*: the next try re-sends the same request under the same key
  (Stripe replays a stored result, or runs a request that never ran). Other 4xx are final.
  A 429 is also ``rate_limited``: the account's backoff gate (:func:`backoff_remaining`) closes
  for its ``Retry-After`` and every charge of that account in the meantime is answered
  ``rate_limited`` without a request; it is never a billing failure
  (docs/decisions/0133-gateway-rate-limits.md).

Each :class:`Gateway` is bound to one account: a secret key, or the platform key with a Connect
account id sent as ``Stripe-Account`` (:func:`gateway_client`; which account a tenant uses is
:mod:`billing.gateway_accounts`).

Stripe forgets a key once it is 24 hours old (https://docs.stripe.com/api/idempotent_requests):
a re-send after that runs as a new request, a second PaymentIntent. :meth:`Gateway.look_up`
resolves an attempt without sending it: the PaymentIntent by id, or found among the gateway
customer's PaymentIntents by the ``hardcount_invoice`` metadata :meth:`Gateway.charge` sets
(docs/decisions/0129-idempotency-keys-expire.md).

Amounts go to Stripe exactly as stored: integer minor units, so 1000 JPY is ``amount=1000``
(the yen has no minor unit) and 1000 USD cents is ``amount=1000``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass

import stripe
from django.conf import settings

SUCCEEDED, DECLINED, UNKNOWN, ERROR = "succeeded", "declined", "unknown", "error"
# A refund's outcomes besides succeeded, unknown and error (billing.models.Refund's): it finishes later, or failed.
PENDING, FAILED = "pending", "failed"
PROCESSING = "processing"  # the PaymentIntent status of a payment that settles later
REQUIRES_ACTION = "requires_action"  # the PaymentIntent waits for the customer (3-D Secure)
# PaymentIntent statuses that finish later, without another request of ours (docs/reference/payments.md).
PENDING_STATUSES = (PROCESSING, REQUIRES_ACTION)
# Metadata keys of every PaymentIntent Hardcount creates (and of its gateway customers).
INVOICE_METADATA_KEY, TENANT_METADATA_KEY, CUSTOMER_METADATA_KEY = (
    "hardcount_invoice",
    "hardcount_tenant",
    "hardcount_customer",
)
# Metadata keys of every refund Hardcount creates.
REFUND_METADATA_KEY, CREDIT_NOTE_METADATA_KEY = "hardcount_refund", "hardcount_credit_note"
# Page size of the lookup's lists (Stripe's largest).
LIST_PAGE_SIZE = 100

# The library logs every request at INFO; payment attempts are our record of calls.
logging.getLogger("stripe").setLevel(logging.WARNING)


def create_key(invoice_id: str) -> str:
    """Idempotency key of the request that creates and confirms the invoice's PaymentIntent."""
    return f"hc:{invoice_id}:create"


def attempt_key(invoice_id: str, attempt_number: int) -> str:
    """Idempotency key of confirmation attempt ``attempt_number`` (≥ 2) on the invoice's PaymentIntent."""
    return f"hc:{invoice_id}:attempt:{attempt_number}"


def is_transient_status(http_status: int | None) -> bool:
    """True when a failed request should be re-sent under its own key (no status, 409, 429, 5xx)."""
    return http_status is None or http_status in (409, 429) or http_status >= 500


@dataclass(frozen=True)
class ChargeRequest:
    """One charge to send: ``amount`` minor units of ``currency`` for ``invoice_id``.

    ``payment_intent_id`` empty: create and confirm a PaymentIntent under ``idempotency_key``;
    set: confirm that PaymentIntent again. ``gateway_customer_id`` empty: the gateway customer is
    created first (under a key derived from ``customer_id``). The body sent under a key is a
    function of these fields only, so a same-key retry sends the same body.
    """

    invoice_id: str
    customer_id: str
    customer_email: str
    customer_name: str
    gateway_customer_id: str
    payment_method: str
    attach_payment_method: bool
    amount: int
    currency: str
    idempotency_key: str
    payment_intent_id: str = ""
    tenant_id: str = ""
    livemode: bool = False
    # Set the PaymentIntent's amount to ``amount`` before confirming it again: a credit note reduced the
    # open invoice's ``amount_due`` since the PaymentIntent was created (docs/decisions/0158).
    update_amount: bool = False


@dataclass
class ChargeResult:
    """What the gateway said. ``outcome`` is one of succeeded/declined/unknown/error.

    ``gateway_customer_id`` / ``payment_method_attached`` report side effects learned on the
    way (the caller saves them); ``http_status`` is None when no HTTP answer arrived;
    ``payment_intent_status`` is the PaymentIntent's status when an answer showed it
    (``processing`` or ``requires_action``: the payment finishes later, :attr:`pending`).
    ``client_secret`` and ``next_action`` are the PaymentIntent's when it requires action: what
    the tenant's page needs to let the customer authenticate.
    ``rate_limited``: the account answered 429, or its backoff gate was closed and nothing was
    sent; ``retry_after_s`` is then how long the gate stays closed (seconds).
    """

    outcome: str
    payment_intent_id: str = ""
    payment_intent_status: str = ""
    decline_code: str = ""
    error_message: str = ""
    http_status: int | None = None
    gateway_customer_id: str = ""
    payment_method_attached: bool = False
    client_secret: str = ""
    next_action: dict | None = None
    rate_limited: bool = False
    retry_after_s: float | None = None

    @property
    def pending(self) -> bool:
        """True when the PaymentIntent finishes later (``processing``, ``requires_action``): outcome ``unknown``,
        resolved by the PaymentIntent's own events or by retrieving it, never by a re-send."""
        return self.outcome == UNKNOWN and self.payment_intent_status in PENDING_STATUSES

    @property
    def transient(self) -> bool:
        """True when the same request should be re-sent under the same key on the next try."""
        return self.outcome == UNKNOWN or (self.outcome == ERROR and is_transient_status(self.http_status))


class Gateway:
    """A Stripe client bound to one API base, account and timeout. Thread-safe.

    The account is ``api_key``'s, or with ``stripe_account`` (``acct_…``) that Connect account,
    reached with the platform's ``api_key`` (https://docs.stripe.com/connect/authentication).
    """

    def __init__(self, *, api_key: str, api_base: str, timeout_s: float, stripe_account: str = ""):
        base_addresses = {"api": api_base} if api_base else None
        self.account = account_identity(api_key, stripe_account)
        self._client = stripe.StripeClient(
            api_key,
            stripe_account=stripe_account or None,
            base_addresses=base_addresses,
            max_network_retries=0,
            http_client=stripe.HTTPXClient(timeout=timeout_s, allow_sync_methods=True),
        )

    def _gate_closed(self, req: ChargeRequest, outcome: str) -> ChargeResult | None:
        """The answer to ``req`` while this account backs off (nothing sent), or None when the gate is open."""
        remaining = backoff_remaining(self.account)
        if remaining <= 0:
            return None
        return ChargeResult(
            outcome=outcome,
            http_status=429,
            rate_limited=True,
            retry_after_s=remaining,
            error_message=f"rate limited: the gateway account backs off for {remaining:.1f} s; not sent",
            gateway_customer_id=req.gateway_customer_id,
            payment_intent_id=req.payment_intent_id,
        )

    def _rate_limited(self, exc: stripe.StripeError, result: ChargeResult) -> None:
        """Mark ``result`` of a 429 answer and close this account's gate for its ``Retry-After``."""
        result.rate_limited = True
        result.retry_after_s = note_rate_limited(self.account, exc.headers or {})

    # --- customers ----------------------------------------------------------------------------------------------

    def ensure_customer(self, req: ChargeRequest) -> str:
        """The gateway customer id for ``req``'s customer, creating it (idempotently) when missing."""
        if req.gateway_customer_id:
            return req.gateway_customer_id
        params = {
            "email": req.customer_email,
            "name": req.customer_name or req.customer_email,
            "metadata": {CUSTOMER_METADATA_KEY: req.customer_id, TENANT_METADATA_KEY: req.tenant_id},
        }
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
        customer = self._client.v1.customers.create(
            params=params, options={"idempotency_key": f"hc:{req.customer_id}:customer:{digest}"}
        )
        return customer.id

    def attach_payment_method(self, gateway_customer_id: str, customer_id: str, payment_method: str) -> None:
        """Attach ``payment_method`` to the gateway customer (raises the library's errors)."""
        self._client.v1.payment_methods.attach(
            payment_method,
            params={"customer": gateway_customer_id},
            options={"idempotency_key": f"hc:{customer_id}:attach:{payment_method}"},
        )

    # --- charges ------------------------------------------------------------------------------------------------

    def charge(self, req: ChargeRequest) -> ChargeResult:
        """Send ``req`` and classify the answer; never raises for gateway failures.

        While the account backs off after a 429 nothing is sent: the answer is a ``rate_limited``
        error (status 429), as if Stripe had refused it again.
        """
        closed = self._gate_closed(req, ERROR)
        if closed is not None:
            return closed
        result = ChargeResult(outcome=ERROR, gateway_customer_id=req.gateway_customer_id)
        try:
            result.gateway_customer_id = self.ensure_customer(req)
            if req.attach_payment_method:
                self.attach_payment_method(result.gateway_customer_id, req.customer_id, req.payment_method)
                result.payment_method_attached = True
            if req.payment_intent_id and req.update_amount:
                # Its own key, derived from the attempt's: the confirmation's body never changes under its key.
                self._client.v1.payment_intents.update(
                    req.payment_intent_id,
                    params={"amount": req.amount},
                    options={"idempotency_key": f"{req.idempotency_key}:amount"},
                )
            if req.payment_intent_id:
                intent = self._client.v1.payment_intents.confirm(
                    req.payment_intent_id,
                    params={"payment_method": req.payment_method, "off_session": True},
                    options={"idempotency_key": req.idempotency_key},
                )
            else:
                intent = self._client.v1.payment_intents.create(
                    params={
                        "amount": req.amount,
                        "currency": req.currency,
                        "customer": result.gateway_customer_id,
                        "payment_method": req.payment_method,
                        "off_session": True,
                        "confirm": True,
                        "metadata": {INVOICE_METADATA_KEY: req.invoice_id, TENANT_METADATA_KEY: req.tenant_id},
                    },
                    options={"idempotency_key": req.idempotency_key},
                )
        except stripe.CardError as exc:
            result.outcome = DECLINED
            result.http_status = exc.http_status
            error = (exc.json_body or {}).get("error", {}) if isinstance(exc.json_body, dict) else {}
            result.decline_code = error.get("decline_code") or exc.code or "card_declined"
            result.error_message = exc.user_message or str(exc)
            result.payment_intent_id = req.payment_intent_id or self._intent_of_card_error(error)
            return result
        except stripe.APIConnectionError as exc:
            result.outcome = UNKNOWN
            result.error_message = f"connection: {exc.user_message or exc}"
            result.payment_intent_id = req.payment_intent_id
            return result
        except stripe.StripeError as exc:
            result.outcome = ERROR
            result.http_status = exc.http_status
            result.error_message = f"{type(exc).__name__} ({exc.http_status}): {exc.user_message or exc}"
            result.payment_intent_id = req.payment_intent_id
            if exc.http_status == 429:
                self._rate_limited(exc, result)
            return result
        note_answered(self.account)
        _classify(intent, result)
        return result

    def _intent_of_card_error(self, error: dict) -> str:
        """The PaymentIntent a card error belongs to: from the error, else through its charge."""
        intent = error.get("payment_intent")
        if isinstance(intent, dict) and intent.get("id"):
            return intent["id"]
        if isinstance(intent, str):
            return intent
        charge_id = error.get("charge")
        if not charge_id:
            return ""
        try:
            charge = self._client.v1.charges.retrieve(charge_id)
        except stripe.StripeError:
            return ""
        return charge.get("payment_intent") or ""

    # --- refunds ------------------------------------------------------------------------------------------------

    def refund(self, req: RefundRequest) -> RefundResult:
        """Create the refund ``req`` under its idempotency key and classify the answer; never raises for gateway
        failures. While the account backs off after a 429 nothing is sent (a transient error)."""
        remaining = backoff_remaining(self.account)
        if remaining > 0:
            return RefundResult(UNKNOWN, http_status=429, error_message=f"rate limited for {remaining:.1f} s; not sent")
        try:
            refund = self._client.v1.refunds.create(
                params={
                    "payment_intent": req.payment_intent_id,
                    "amount": req.amount,
                    "metadata": {
                        REFUND_METADATA_KEY: req.refund_id,
                        CREDIT_NOTE_METADATA_KEY: req.credit_note_id,
                        INVOICE_METADATA_KEY: req.invoice_id,
                        TENANT_METADATA_KEY: req.tenant_id,
                    },
                },
                options={"idempotency_key": req.idempotency_key},
            )
        except stripe.APIConnectionError as exc:
            return RefundResult(UNKNOWN, error_message=f"connection: {exc.user_message or exc}")
        except stripe.StripeError as exc:
            message = f"{type(exc).__name__} ({exc.http_status}): {exc.user_message or exc}"
            if exc.http_status == 429:
                note_rate_limited(self.account, exc.headers or {})
            outcome = UNKNOWN if is_transient_status(exc.http_status) else ERROR
            return RefundResult(outcome, http_status=exc.http_status, error_message=message)
        note_answered(self.account)
        return classify_refund(refund)

    def find_refund(self, req: RefundRequest) -> RefundResult | None:
        """The refund ``req`` made, found among its PaymentIntent's refunds by the ``hardcount_refund`` metadata
        (a list: strongly consistent), or None when there is none. Raises the library's errors."""
        pages = self._client.v1.refunds.list(params={"payment_intent": req.payment_intent_id, "limit": LIST_PAGE_SIZE})
        for refund in pages.auto_paging_iter():
            if _as_dict(getattr(refund, "metadata", None)).get(REFUND_METADATA_KEY) == req.refund_id:
                return classify_refund(refund)
        return None

    def retrieve_refund(self, refund_id: str) -> dict:
        """The gateway refund ``refund_id`` as a plain dict (raises the library's errors)."""
        return self._client.v1.refunds.retrieve(refund_id).to_dict()

    def retrieve_payment_intent(self, payment_intent_id: str):
        """The PaymentIntent object (raises the library's errors)."""
        return self._client.v1.payment_intents.retrieve(payment_intent_id)

    # --- lookups ------------------------------------------------------------------------------------------------

    def look_up(self, req: ChargeRequest) -> ChargeResult:
        """What became of ``req``, found without sending it; never raises for gateway failures.

        ``req.payment_intent_id`` set: that PaymentIntent, retrieved. Empty: the invoice's
        PaymentIntents among its gateway customer's (:meth:`find_invoice_payment_intents`; the
        customer found by :meth:`find_gateway_customers` when ``req.gateway_customer_id`` is
        empty). A PaymentIntent found is classified as :meth:`charge` classifies one, except that
        one on which nothing was charged (``requires_confirmation``, or ``requires_payment_method``
        without a ``last_payment_error``) is a final ``error``, as is finding none: both answered
        with ``http_status`` 200, so the next try takes a new attempt (and, with no PaymentIntent,
        a new create key). Several found: a succeeded one wins, then a processing one, then the
        newest. A lookup that gets no answer, or an error, proves nothing: ``unknown`` (with the
        error's ``http_status``), so the attempt stays open and the next try looks up again; a
        429, or a closed backoff gate, is also ``rate_limited``.
        """
        closed = self._gate_closed(req, UNKNOWN)
        if closed is not None:
            return closed
        result = ChargeResult(outcome=ERROR, gateway_customer_id=req.gateway_customer_id)
        try:
            if req.payment_intent_id:
                intents = [self.retrieve_payment_intent(req.payment_intent_id)]
            else:
                customers = (
                    [req.gateway_customer_id]
                    if req.gateway_customer_id
                    else self.find_gateway_customers(req.customer_id, req.customer_email)
                )
                intents = []
                for customer in customers:
                    found = self.find_invoice_payment_intents(customer, req.invoice_id)
                    if found and not result.gateway_customer_id:
                        result.gateway_customer_id = customer
                    intents.extend(found)
        except stripe.StripeError as exc:
            # Even a final-looking 4xx: only a lookup that answered may let a new PaymentIntent be created.
            result.outcome = UNKNOWN
            result.http_status = exc.http_status
            result.error_message = f"lookup, {type(exc).__name__} ({exc.http_status}): {exc.user_message or exc}"
            result.payment_intent_id = req.payment_intent_id
            if exc.http_status == 429:
                self._rate_limited(exc, result)
            return result
        note_answered(self.account)
        result.http_status = 200
        if not intents:
            result.error_message = f"lookup: no PaymentIntent at the gateway for invoice {req.invoice_id}"
            return result
        rank = {SUCCEEDED: 0, PROCESSING: 1}
        intent = min(enumerate(intents), key=lambda pair: (rank.get(pair[1].status, 2), pair[0]))[1]
        if intent.status in ("requires_confirmation", "requires_payment_method") and not getattr(
            intent, "last_payment_error", None
        ):
            result.payment_intent_id = intent.id
            result.payment_intent_status = intent.status
            result.error_message = f"lookup: PaymentIntent {intent.id} is {intent.status}, nothing was charged"
            return result
        _classify(intent, result)
        result.http_status = None if result.outcome == UNKNOWN else 200
        return result

    def find_invoice_payment_intents(self, gateway_customer_id: str, invoice_id: str, *, page_size: int = 0) -> list:
        """The gateway customer's PaymentIntents whose ``hardcount_invoice`` metadata is ``invoice_id``, newest first.

        Lists them all (``GET /v1/payment_intents?customer=…``, ``page_size`` a page,
        :data:`LIST_PAGE_SIZE` by default): Stripe's lists are strongly consistent, its search is
        not, so a PaymentIntent created a moment ago may be missing from a search but never from
        the list. Raises the library's errors.
        """
        pages = self._client.v1.payment_intents.list(
            params={"customer": gateway_customer_id, "limit": page_size or LIST_PAGE_SIZE}
        )
        return [
            intent
            for intent in pages.auto_paging_iter()
            if _as_dict(getattr(intent, "metadata", None)).get(INVOICE_METADATA_KEY) == invoice_id
        ]

    def find_gateway_customers(self, customer_id: str, email: str) -> list[str]:
        """Ids of the gateway customers created for Hardcount customer ``customer_id`` under ``email``.

        For a customer whose gateway id was never recorded (a process that died after the
        charge): its gateway customers are listed by email (``GET /v1/customers?email=…``, a
        list, so strongly consistent) and kept when their ``hardcount_customer`` metadata is
        ``customer_id``. A gateway customer created under an email changed since is not found.
        Raises the library's errors.
        """
        if not email:
            return []
        pages = self._client.v1.customers.list(params={"email": email, "limit": LIST_PAGE_SIZE})
        return [
            customer.id
            for customer in pages.auto_paging_iter()
            if _as_dict(getattr(customer, "metadata", None)).get(CUSTOMER_METADATA_KEY) == customer_id
        ]


def _as_dict(value) -> dict:
    """A StripeObject (or None, or a dict) as a plain dict: StripeObjects have no ``.get``."""
    if not value:
        return {}
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def refund_key(credit_note_id: str) -> str:
    """Idempotency key of the one refund of a credit note: derived from it, so a re-send never takes a new key."""
    return f"hc:{credit_note_id}:refund"


# Refund statuses (https://docs.stripe.com/api/refunds/object#refund_object-status).
REFUND_PENDING_STATUSES = ("pending", "requires_action")
REFUND_FAILED_STATUSES = ("failed", "canceled")


@dataclass(frozen=True)
class RefundRequest:
    """One refund to send: ``amount`` minor units of ``payment_intent_id``'s charge, for Hardcount refund
    ``refund_id`` of credit note ``credit_note_id``. Its body is a function of these fields only."""

    refund_id: str
    credit_note_id: str
    invoice_id: str
    payment_intent_id: str
    amount: int
    idempotency_key: str
    tenant_id: str
    livemode: bool


@dataclass
class RefundResult:
    """What the gateway said of a refund: ``outcome`` one of succeeded/pending/failed (the refund's ``status``
    decides), ``unknown`` (no answer, or a transient error: re-sent under its key) or ``error`` (refused)."""

    outcome: str
    gateway_refund_id: str = ""
    status: str = ""
    error_message: str = ""
    http_status: int | None = None


def classify_refund(refund) -> RefundResult:
    """The :class:`RefundResult` of a refund object (an answer, a list's item or an inbound event's)."""
    status = (refund.get("status") if isinstance(refund, dict) else getattr(refund, "status", None)) or ""
    refund_id = (refund.get("id") if isinstance(refund, dict) else getattr(refund, "id", None)) or ""
    if status == SUCCEEDED:
        outcome = SUCCEEDED
    elif status in REFUND_FAILED_STATUSES:
        outcome = FAILED
    else:
        outcome = PENDING
    return RefundResult(outcome, gateway_refund_id=refund_id, status=status)


def classify_payment_intent(intent) -> ChargeResult:
    """The :class:`ChargeResult` a PaymentIntent object (a retrieved one, or an inbound event's) stands for.

    Classified as :meth:`Gateway.charge` classifies the PaymentIntent a confirmation returns.
    """
    result = ChargeResult(outcome=ERROR)
    _classify(intent, result)
    return result


def _classify(intent, result: ChargeResult) -> None:
    """Set ``result``'s outcome from a PaymentIntent the gateway returned (in place).

    ``succeeded``: paid. ``processing`` and ``requires_action`` finish later: ``unknown`` with the
    status kept (:attr:`ChargeResult.pending`), never a decline: a ``requires_action``
    PaymentIntent waits for the customer to authenticate with its ``client_secret``
    (https://docs.stripe.com/payments/paymentintents/lifecycle). Anything else
    (``requires_payment_method`` with a ``last_payment_error``, ``canceled``) is a decline.
    """
    result.payment_intent_id = intent.id
    result.payment_intent_status = intent.status or ""
    if intent.status == SUCCEEDED:
        result.outcome = SUCCEEDED
    elif intent.status == PROCESSING:
        # Asynchronous methods settle later: resolved by retrieving the PaymentIntent (a same-key
        # re-send would only replay this answer).
        result.outcome = UNKNOWN
        result.error_message = "payment processing"
    elif intent.status == REQUIRES_ACTION:
        result.outcome = UNKNOWN
        result.error_message = "payment requires action: the customer must authenticate"
        result.client_secret = getattr(intent, "client_secret", None) or ""
        result.next_action = _as_dict(getattr(intent, "next_action", None)) or None
    else:
        result.outcome = DECLINED
        last_error = _as_dict(getattr(intent, "last_payment_error", None))
        result.decline_code = (last_error.get("decline_code") or last_error.get("code")) or "card_declined"
        result.error_message = f"PaymentIntent status {intent.status}"


# --- the per-account backoff gate (docs/decisions/0133-gateway-rate-limits.md) ------------------------------------

# Without a Retry-After, the gate closes for BACKOFF_BASE_S doubled per 429 in a row, at most BACKOFF_MAX_S;
# a Retry-After is honoured up to BACKOFF_MAX_S. Stripe-Should-Retry: false closes it for BACKOFF_MAX_S.
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0


@dataclass
class _Backoff:
    until: float  # _clock()
    streak: int


_backoffs: dict[str, _Backoff] = {}
_backoffs_lock = threading.Lock()
# The gate's clock (a test moves it on instead of sleeping through a Retry-After).
_clock = time.monotonic


def account_identity(api_key: str, stripe_account: str = "") -> str:
    """The name of the account a client acts as: the Connect id, else a digest of the key (never the key)."""
    if stripe_account:
        return stripe_account
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def backoff_remaining(account: str) -> float:
    """Seconds the ``account``'s gate stays closed (0.0: open). In-process: each process learns its own 429s."""
    with _backoffs_lock:
        backoff = _backoffs.get(account)
        return 0.0 if backoff is None else max(0.0, backoff.until - _clock())


def backoff_delay(headers, streak: int) -> float:
    """How long a 429 closes the gate (seconds), from its headers and the 429s in a row (``streak`` ≥ 1).

    ``Retry-After`` in seconds wins (capped at :data:`BACKOFF_MAX_S`); ``Stripe-Should-Retry:
    false`` means not soon, :data:`BACKOFF_MAX_S`; else exponential from :data:`BACKOFF_BASE_S`
    (https://docs.stripe.com/rate-limits#handling-limiting-gracefully).
    """
    lowered = {str(k).lower(): str(v) for k, v in dict(headers).items()}
    try:
        retry_after = float(lowered.get("retry-after", ""))
    except ValueError:
        retry_after = None
    if retry_after is not None and retry_after >= 0:
        return min(retry_after, BACKOFF_MAX_S)
    if lowered.get("stripe-should-retry", "").strip().lower() == "false":
        return BACKOFF_MAX_S
    return min(BACKOFF_BASE_S * 2 ** (streak - 1), BACKOFF_MAX_S)


def note_rate_limited(account: str, headers) -> float:
    """Close ``account``'s gate after a 429 with ``headers``; returns the seconds it stays closed."""
    with _backoffs_lock:
        previous = _backoffs.get(account)
        streak = (previous.streak if previous else 0) + 1
        delay = backoff_delay(headers, streak)
        until = _clock() + delay
        _backoffs[account] = _Backoff(max(until, previous.until if previous else 0.0), streak)
        return delay


def note_answered(account: str) -> None:
    """``account`` answered a request: the next 429 starts the exponential backoff from its base again."""
    with _backoffs_lock:
        backoff = _backoffs.get(account)
        if backoff is not None and backoff.until <= _clock():
            del _backoffs[account]


def clear_backoffs() -> None:
    """Open every gate (tests; an operator's console)."""
    with _backoffs_lock:
        _backoffs.clear()


# --- clients --------------------------------------------------------------------------------------------------------

_gateways: dict[tuple[str, str, str, float], Gateway] = {}
_gateways_lock = threading.Lock()


def gateway_client(*, api_key: str, stripe_account: str = "") -> Gateway:
    """The cached gateway of one account (``api_key``, or the platform key and ``stripe_account``) under the
    current ``STRIPE_API_BASE`` and timeout: one client per (key, account, base, timeout)."""
    key = (api_key, stripe_account, settings.STRIPE_API_BASE, float(settings.HARDCOUNT_GATEWAY_TIMEOUT_S))
    with _gateways_lock:
        gateway = _gateways.get(key)
        if gateway is None:
            gateway = _gateways[key] = Gateway(api_key=key[0], stripe_account=key[1], api_base=key[2], timeout_s=key[3])
        return gateway


def forget_clients(*, api_key: str = "", stripe_account: str = "") -> None:
    """Drop the cached clients of an account whose key or Connect id changed or was removed."""
    with _gateways_lock:
        for key in [
            k
            for k in _gateways
            if (api_key and k[0] == api_key and not k[1]) or (stripe_account and k[1] == stripe_account)
        ]:
            del _gateways[key]


def get_gateway() -> Gateway:
    """The platform account's gateway (``settings.STRIPE_API_KEY``). A tenant's charges use
    :func:`billing.gateway_accounts.gateway_for` instead."""
    return gateway_client(api_key=settings.STRIPE_API_KEY)
