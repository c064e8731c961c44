"""localstripe as Hardcount uses it in development and tests, with the fixes the gateway relies on.

localstripe (the fake Stripe server from PyPI) differs from Stripe in these ways that matter to
:mod:`billing.gateway` and to whoever tries the dev stack:

1. A PaymentIntent whose charge was declined cannot be confirmed again: its
   ``POST /v1/payment_intents/{id}/confirm`` refuses ``payment_method`` (``500 Not
   implemented``) and ``off_session``, and a declined intent never returns to
   ``requires_confirmation``. Stripe accepts a new confirmation of a ``requires_payment_method``
   intent with a payment method, which is how every retry of an invoice reaches the card.
2. A card error on a PaymentIntent carries only ``code`` and ``charge``; Stripe also sends
   ``decline_code`` and the ``payment_intent`` object.
3. A declined attach (Stripe's decline test cards, e.g. ``4000000000009979``) carries no
   ``decline_code``; Stripe sends the card's (``stolen_card``, ``lost_card``, …).
4. ``GET /v1/payment_intents`` takes no ``customer`` filter (``400 Unexpected customer``) and
   lists oldest first; Stripe filters by ``customer`` and lists newest first, paginated with
   ``limit`` and ``starting_after`` (https://docs.stripe.com/api/payment_intents/list). The
   gateway finds an invoice's PaymentIntents this way once a key may have expired.
5. Of Stripe's test PaymentMethod ids it knows only ``pm_card_visa``, ``pm_card_visa_chargeDeclined``
   and ``pm_card_chargeCustomerFail``; :data:`EXTRA_TEST_PAYMENT_METHODS` adds the ones README's
   ``make run`` section names (a declining card, insufficient funds, authentication required:
   its PaymentIntents stay ``requires_action`` until authenticated, as Stripe's 4000002760003184).

6. A refund larger than what is left of its charge is created anyway; Stripe refuses it (``amount_too_large``,
   or ``charge_already_refunded`` once nothing is left). A PaymentIntent update stores ``amount`` as the form's
   string and accepts it in any status; Stripe takes an integer, before the PaymentIntent is confirmed
   (``requires_payment_method``, ``requires_confirmation``). ``POST /_hardcount/refunds/{id}/status``
   (``status=failed|canceled|pending|succeeded``) plays a refund Stripe moves later.

It also lets a test hold a payment in ``processing``, as Stripe's asynchronous payment methods
do, and settle it later (:data:`CONTROL_ROUTES`; :meth:`devstack.strict_stripe.StrictStripe.hold_processing`
and ``settle``): every charge of a payment method marked with
``POST /_hardcount/payment_methods/{id}/processing`` stays ``pending`` (its PaymentIntent
``processing``) until ``POST /_hardcount/payment_intents/{id}/settle`` with
``outcome=succeeded`` or ``outcome=failed`` (optionally ``decline_code=…``) settles it, with the
``payment_intent.succeeded`` / ``payment_intent.payment_failed`` event Stripe sends. A failed one
is ``requires_payment_method`` with a ``last_payment_error``, as at Stripe.

:func:`apply_localstripe_fixes` patches localstripe's classes in the process that serves it so
it behaves as Stripe does in those respects. :func:`main` serves an in-memory localstripe
(no pickling to ``/tmp``) on a port: ``python -m devstack.devstripe --port 8420``. The test
suite starts it this way; ``devstack.stack`` may call :func:`apply_localstripe_fixes` too.
"""

from __future__ import annotations

import argparse
import socket

# Stripe's test cards that are declined, with the decline code Stripe gives them
# (https://docs.stripe.com/testing#declined-payments).
DECLINE_CODES_OF_TEST_CARDS = {
    "4000000000000002": "generic_decline",
    "4000000000009995": "insufficient_funds",
    "4000000000009987": "lost_card",
    "4000000000009979": "stolen_card",
    "4000000000000069": "expired_card",
    "4000000000000127": "incorrect_cvc",
    "4000000000000119": "processing_error",
    "4242424242424241": "incorrect_number",
}

# Stripe's test PaymentMethod ids (https://docs.stripe.com/testing) that localstripe lacks, with the
# card number localstripe then behaves as: attach declined (generic, insufficient funds), or
# every PaymentIntent left requires_action (3-D Secure), until the customer authenticates
# (localstripe's /v1/payment_intents/{id}/_authenticate; devstack.strict_stripe.StrictStripe.complete_action).
EXTRA_TEST_PAYMENT_METHODS = {
    "pm_card_chargeDeclined": "4000000000000002",
    "pm_card_chargeDeclinedInsufficientFunds": "4000000000009995",
    "pm_card_authenticationRequired": "4000002760003184",
}


def apply_localstripe_fixes() -> None:
    """Patch localstripe's ``PaymentIntent`` in this process (idempotent; see the module docstring)."""
    from localstripe import resources
    from localstripe.errors import UserError

    pi_cls = resources.PaymentIntent
    if getattr(pi_cls, "_hardcount_fixed", False):
        return

    def _api_confirm(cls, id, payment_method=None, off_session=None, **kwargs):
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        if not (isinstance(id, str) and id.startswith("pi_")):
            raise UserError(400, "Bad request")
        obj = cls._api_retrieve(id)
        if payment_method is not None:
            if not isinstance(payment_method, str):
                raise UserError(400, "Bad request")
            resources.PaymentMethod._api_retrieve(payment_method)  # 404 when unknown
            if obj.status not in ("requires_payment_method", "requires_confirmation"):
                raise UserError(
                    400,
                    f"This PaymentIntent's status is {obj.status}; it cannot be confirmed.",
                    {"code": "payment_intent_unexpected_state"},
                )
            # A new confirmation makes a new charge, as in Stripe.
            obj.payment_method = payment_method
            obj.latest_charge = None
        if obj.status != "requires_confirmation":
            raise UserError(
                400,
                f"This PaymentIntent's status is {obj.status}; it cannot be confirmed.",
                {"code": "payment_intent_unexpected_state"},
            )
        obj._confirm(on_failure_now=obj._report_failure)
        return obj

    original_report_failure = pi_cls._report_failure

    def _report_failure(self):
        try:
            original_report_failure(self)
        except UserError as exc:
            exc.body["error"].setdefault("decline_code", "generic_decline")
            exc.body["error"]["payment_intent"] = self._export()
            raise

    pm_cls = resources.PaymentMethod
    original_attach = pm_cls._api_attach.__func__

    def _api_attach(cls, id, customer=None, **kwargs):
        try:
            return original_attach(cls, id, customer=customer, **kwargs)
        except UserError as exc:
            # Fix 3: Stripe's decline test cards carry their decline code (dunning tells hard declines by it).
            error = exc.body.get("error", {})
            if error.get("code") == "card_declined":
                number = getattr(resources.PaymentMethod._api_retrieve(id), "_card_number", "")
                error.setdefault("decline_code", DECLINE_CODES_OF_TEST_CARDS.get(number, "generic_decline"))
            raise

    def _api_list_all(cls, url, customer=None, limit=None, starting_after=None, **kwargs):
        # Fix 4: Stripe's filter and order. The base list is looked up now: it may be the indexed one.
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        if customer is not None and not (isinstance(customer, str) and customer.startswith("cus_")):
            raise UserError(400, "Bad request")
        li = resources.StripeObject._api_list_all.__func__(cls, url, limit=limit, starting_after=starting_after)
        li._list = [pi for pi in reversed(li._list) if customer is None or pi.customer == customer]
        return li

    original_canonical = pm_cls._try_get_canonical_test_article.__func__

    def _try_get_canonical_test_article(cls, id):
        number = EXTRA_TEST_PAYMENT_METHODS.get(id)
        if number is None:
            return original_canonical(cls, id)
        return cls(type="card", card={"number": number, "exp_month": "12", "exp_year": "2030", "cvc": "123"})

    pm_cls._try_get_canonical_test_article = classmethod(_try_get_canonical_test_article)
    pi_cls._api_confirm = classmethod(_api_confirm)
    pi_cls._report_failure = _report_failure
    pi_cls._api_list_all = classmethod(_api_list_all)
    pm_cls._api_attach = classmethod(_api_attach)
    # The route table captured the original bound methods: point it at the fixed ones.
    fixed_routes = {
        "/v1/payment_intents/{id}/confirm": pi_cls._api_confirm,
        "/v1/payment_methods/{id}/attach": pm_cls._api_attach,
    }
    resources.extra_apis[:] = [(method, url, fixed_routes.get(url, func)) for method, url, func in resources.extra_apis]
    _add_processing_payments(resources, UserError)
    _make_refunds_strict(resources, UserError)
    pi_cls._hardcount_fixed = True


# The test's control of a refund's status (Stripe moves refunds to failed or canceled on its own).
REFUND_STATUS_ROUTE = "/_hardcount/refunds/{id}/status"
REFUND_STATUSES = ("pending", "succeeded", "failed", "canceled", "requires_action")


def _make_refunds_strict(resources, UserError) -> None:
    """Fix 6: refunds and PaymentIntent amounts as strict as Stripe's (see the module docstring)."""
    refund_cls, charge_cls, pi_cls = resources.Refund, resources.Charge, resources.PaymentIntent
    original_init = refund_cls.__init__

    def __init__(self, charge=None, payment_intent=None, amount=None, metadata=None, **kwargs):
        target = charge
        if target is None and isinstance(payment_intent, str) and payment_intent.startswith("pi_"):
            intent = pi_cls._api_retrieve(payment_intent)
            target = intent.latest_charge.id if intent.latest_charge is not None else None
        if isinstance(target, str) and target.startswith("ch_"):
            charge_obj = charge_cls._api_retrieve(target)
            left = charge_obj.amount - sum(r.amount for r in charge_obj.refunds._list if r.status != "failed")
            wanted = resources.try_convert_to_int(amount) if amount is not None else left
            if left <= 0:
                raise UserError(
                    400,
                    f"Charge {target} has already been refunded.",
                    {"code": "charge_already_refunded", "param": "amount"},
                )
            if isinstance(wanted, int) and wanted > left:
                raise UserError(
                    400,
                    f"Refund amount ({wanted}) is greater than unrefunded amount on charge ({left})",
                    {"code": "amount_too_large", "param": "amount"},
                )
        original_init(self, charge=charge, payment_intent=payment_intent, amount=amount, metadata=metadata, **kwargs)

    original_update = pi_cls._api_update.__func__

    def _api_update(cls, id, **data):
        if "amount" in data:
            amount = resources.try_convert_to_int(data["amount"])
            if not isinstance(amount, int) or amount <= 0:
                raise UserError(400, "Bad request")
            if cls._api_retrieve(id).status not in ("requires_payment_method", "requires_confirmation"):
                raise UserError(
                    400,
                    "This PaymentIntent's amount could not be updated because it has a status of "
                    f"{cls._api_retrieve(id).status}.",
                    {"code": "payment_intent_unexpected_state"},
                )
            data["amount"] = amount
        return original_update(cls, id, **data)

    def set_status(id=None, status=None, **kwargs):
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        if status not in REFUND_STATUSES:
            raise UserError(400, "status must be one of " + ", ".join(REFUND_STATUSES))
        refund = refund_cls._api_retrieve(id)
        refund.status = status
        return refund

    refund_cls.__init__ = __init__
    pi_cls._api_update = classmethod(_api_update)
    resources.extra_apis.append(("POST", REFUND_STATUS_ROUTE, set_status))


# The test's controls of processing payments (served to callers with any secret key, as localstripe's API).
CONTROL_ROUTES = (
    "/_hardcount/payment_methods/{id}/processing",
    "/_hardcount/payment_intents/{id}/settle",
)


def _add_processing_payments(resources, UserError) -> None:
    """Charges of marked payment methods stay ``pending`` until settled (see the module docstring)."""
    charge_cls, pi_cls = resources.Charge, resources.PaymentIntent
    processing_methods: set[str] = set()
    held: dict[str, tuple] = {}  # charge id -> (on_success, on_failure_later) of the held charge
    original_initialize = charge_cls._initialize_charge
    original_last_error = pi_cls.last_payment_error.fget

    def _initialize_charge(self, on_success=None, on_failure_now=None, on_failure_later=None):
        if self.payment_method not in processing_methods:
            return original_initialize(self, on_success, on_failure_now, on_failure_later)
        self.status = "pending"
        held[self.id] = (on_success, on_failure_later)

    def last_payment_error(self):
        error = original_last_error(self)
        code = getattr(self.latest_charge, "_hardcount_decline_code", None)
        if error is not None and code:
            error = {**error, "decline_code": code}
        return error

    def hold(id=None, **kwargs):
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        payment_method = resources.PaymentMethod._api_retrieve(id)
        processing_methods.add(payment_method.id)
        return payment_method

    def settle(id=None, outcome=None, decline_code=None, **kwargs):
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        if outcome not in ("succeeded", "failed"):
            raise UserError(400, "outcome must be succeeded or failed")
        intent = pi_cls._api_retrieve(id)
        charge = intent.latest_charge
        if charge is None or charge.id not in held:
            raise UserError(400, f"PaymentIntent {id} is not processing", {"code": "payment_intent_unexpected_state"})
        on_success, on_failure_later = held.pop(charge.id)
        if outcome == "succeeded":
            charge._trigger_payment(on_success)
        else:
            charge._set_auth_failure()
            charge._hardcount_decline_code = decline_code or "generic_decline"
            if on_failure_later:
                on_failure_later()
        return intent

    charge_cls._initialize_charge = _initialize_charge
    pi_cls.last_payment_error = property(last_payment_error)
    resources.extra_apis.extend((("POST", CONTROL_ROUTES[0], hold), ("POST", CONTROL_ROUTES[1], settle)))


def _keep_store_in_memory() -> None:
    """localstripe pickles its whole store to a shared ``/tmp`` file on every write: turn that off."""
    from localstripe import resources

    resources.Store.dump_to_disk = lambda self: None
    resources.Store.try_load_from_disk = lambda self: None


def _index_store_by_type() -> None:
    """localstripe lists a type's objects by scanning its whole store, and it renders every Charge
    with its refunds listed that way: each request slows as the store grows (a PaymentIntent
    takes ~35 ms after 1 200 charges instead of 4). Keep a per-type index and list from it, in
    the same (insertion) order."""
    from localstripe import resources
    from localstripe.errors import UserError

    store_cls = resources.Store
    if getattr(store_cls, "_hardcount_indexed", False):
        return
    set_item, del_item = store_cls.__setitem__, store_cls.__delitem__

    def index(store) -> dict[str, dict]:
        by_type = store.__dict__.get("_by_type")
        if by_type is None:
            by_type = store.__dict__["_by_type"] = {}
            for key, value in dict.items(store):
                if ":" in key:
                    by_type.setdefault(key.split(":", 1)[0], {})[key] = value
        return by_type

    def setitem(self, key, value):
        set_item(self, key, value)
        if ":" in key:
            index(self).setdefault(key.split(":", 1)[0], {})[key] = value

    def delitem(self, key):
        del_item(self, key)
        index(self).get(key.split(":", 1)[0], {}).pop(key, None)

    def list_all(cls, url, limit=None, starting_after=None, **kwargs):
        if kwargs:
            raise UserError(400, "Unexpected " + ", ".join(kwargs.keys()))
        li = resources.List(url, limit=limit, starting_after=starting_after)
        li._list = list(index(resources.store).get(cls.object, {}).values())
        return li

    store_cls.__setitem__ = setitem
    store_cls.__delitem__ = delitem
    resources.StripeObject._api_list_all = classmethod(list_all)
    store_cls._hardcount_indexed = True


def main(argv: list[str] | None = None) -> None:
    """Serve a fixed, in-memory localstripe on ``127.0.0.1:<port>`` until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    import logging

    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    _keep_store_in_memory()
    _index_store_by_type()
    apply_localstripe_fixes()
    # Imported after the fixes: the server registers routes from resources.extra_apis at import.
    from aiohttp import web
    from localstripe.server import app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    web.run_app(app, sock=sock, access_log=None, print=None)


if __name__ == "__main__":
    main()
