"""Charging an invoice: reserve a payment attempt, call the gateway, record the outcome and act on it.

The same three steps serve the drain's close (:mod:`billing.services.close`), the reconciler,
``POST /v1/invoices/{id}/pay`` and dunning retries (docs/decisions/0011):

1. :func:`reserve_attempt_locked`, inside the caller's transaction with the subscription, the
   invoice and the customer locked: choose the attempt and its idempotency key, and write the
   :class:`~billing.models.PaymentAttempt` row *before* the call, with outcome ``unknown``. A
   process that dies during the call leaves that row behind, so the next try re-sends the same
   request under the same key (Stripe replays the answer) and never creates a second
   PaymentIntent; once that key may have expired at the gateway, or when the PaymentIntent is
   processing, the next try looks the PaymentIntent up instead (:func:`must_look_up`).
2. :func:`send`: the gateway call, outside any transaction: the request, or, for an open
   attempt that may no longer be re-sent (:func:`must_look_up`), a lookup of its PaymentIntent.
3. :func:`record_outcome`: one transaction that records the answer on the attempt and acts on
   it (invoice paid; period advanced; ``past_due`` and dunning on a decline; the retry ladder
   on a failure), with every event.

A row is one idempotency key: a same-key re-send updates it. A definite outcome (succeeded,
declined, a final error) is never overwritten by a later indefinite one.

An attempt of an invoice on a test clock is dated by the clock, like everything else of the
clock's objects (docs/decisions/0082-test-clock-time-rules.md): its times say nothing about the
wall clock, so whether it is in flight is not read from them. Its sender holds the invoice's
*charge lock* instead, a claim (:mod:`hardcount.claims`) taken when the attempt is reserved and
released once the outcome is recorded (:func:`charging`): in flight means "a live holder has the
claim", and the claim of a process that dies lapses one ``HARDCOUNT_CLAIM_TTL_S`` after its last
heartbeat (decision 0182).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import StrEnum

from django.conf import settings
from django.db import DatabaseError, connection, transaction

from billing import gateway as gw
from billing.events import invoice_event, subscription_event
from billing.gateway_accounts import gateway_for
from billing.lock_objects import (
    charge_rows_locked,
    payment_attempt_qs_select_for_update,
    subscription_and_invoice_locked,
)
from billing.models import BillingAttempt, BillingRun, Customer, Invoice, PaymentAttempt, Subscription, TestClock
from billing.periods import period_start
from billing.queries import record_billing_failure
from billing.services.ledger import carry_debit_locked
from dunning import services as dunning_services
from hardcount import claims
from hardcount.errors import StateConflictError
from hardcount.fencing import NO_FENCE, Fence
from hardcount.money import minimum_charge
from hardcount.times import database_now, iso
from outbox import services as outbox_services

log = logging.getLogger("billing.payments")

OPEN_OUTCOMES = (PaymentAttempt.UNKNOWN, PaymentAttempt.ERROR)


class PaymentInFlight(StateConflictError):
    """409: a payment attempt of this invoice is in flight (sent, not yet recorded)."""

    default_code = "payment_in_flight"


def in_flight_window() -> timedelta:
    """How long an ``unknown`` attempt counts as in flight: five gateway timeouts.

    Step 2 makes at most four requests (customer, attach, PaymentIntent, charge lookup), each
    bounded by ``HARDCOUNT_GATEWAY_TIMEOUT_S``; after the window the caller that reserved the
    attempt is presumed dead and the next try re-sends it under its key.
    """
    return timedelta(seconds=5 * float(settings.HARDCOUNT_GATEWAY_TIMEOUT_S))


def is_open(attempt: PaymentAttempt) -> bool:
    """True when ``attempt`` has no definite outcome: ``unknown``, or a transient ``error``, of a call made
    under a key. The next try of the invoice resolves it (re-sent under its key, or looked up) rather
    than taking a new attempt."""
    if attempt.settled_without_charge or not attempt.idempotency_key:
        return False
    if attempt.outcome == PaymentAttempt.UNKNOWN:
        return True
    return attempt.outcome == PaymentAttempt.ERROR and gw.is_transient_status(attempt.http_status)


def key_safe_window() -> timedelta:
    """How long after its first send an attempt may still be re-sent under its key.

    ``HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S``, default 23 hours: Stripe keeps a key for at
    least 24 hours (https://docs.stripe.com/api/idempotent_requests), and the hour left over
    covers the re-send itself (at most :func:`in_flight_window`) and the clocks' skew. It must
    stay below 24 hours.
    """
    return timedelta(seconds=float(settings.HARDCOUNT_IDEMPOTENCY_KEY_SAFE_WINDOW_S))


def must_look_up(attempt: PaymentAttempt, *, now: datetime) -> bool:
    """True when the open ``attempt`` is resolved only by looking its PaymentIntent up, never re-sent.

    Either its PaymentIntent answered ``processing`` or ``requires_action`` (it finishes later; a
    same-key re-send would replay that answer for as long as the key lives, then create a second
    PaymentIntent), or its key may have expired
    at the gateway: first sent more than :func:`key_safe_window` before ``now`` (the DB's now()),
    or at a time not recorded. docs/decisions/0129-idempotency-keys-expire.md.
    """
    if attempt.payment_intent_status in gw.PENDING_STATUSES:
        return True
    first_sent_at = attempt.first_sent_at
    return not isinstance(first_sent_at, datetime) or first_sent_at <= now - key_safe_window()


def pending_poll_interval() -> timedelta:
    """How often the reconciler retrieves a PaymentIntent that finishes later (``processing``, ``requires_action``).

    ``HARDCOUNT_PENDING_PAYMENT_POLL_S``, default 300 s, and never less than :func:`in_flight_window`:
    the PaymentIntent's own events (``payment_intent.succeeded``, ``payment_intent.payment_failed``,
    received at ``/stripe/webhooks/<account>``) tell first; the poll is the fallback for one lost.
    """
    return max(in_flight_window(), timedelta(seconds=float(settings.HARDCOUNT_PENDING_PAYMENT_POLL_S)))


def reuses_key(attempt: PaymentAttempt, *, now: datetime) -> bool:
    """True when the next try of the invoice re-sends ``attempt`` under its own key: it is open
    (:func:`is_open`) and its key is still safe to use (not :func:`must_look_up`)."""
    return is_open(attempt) and not must_look_up(attempt, now=now)


@dataclass
class ChargePlan:
    """What step 2 sends: the reserved attempt and the request (or a result known without a call)."""

    attempt_id: str
    invoice_id: str
    subscription_id: str | None
    request: gw.ChargeRequest | None
    known_result: gw.ChargeResult | None = None
    # Step 2 looks the request's PaymentIntent up instead of sending it (must_look_up).
    look_up: bool = False


class OutcomeKind(StrEnum):
    """What one close or charge came to (the values are :class:`~billing.models.BillingAttempt` outcomes)."""

    BILLED = "billed"
    DECLINED = "declined"
    TAX_PENDING = "tax_pending"
    FAILED = "failed"
    SKIPPED = "skipped"
    PAYMENT_PENDING = "payment_pending"
    HELD = "held"


@dataclass
class Outcome:
    """What one close or charge came to, for the run's counts and its billing attempt row.

    ``kind``: an :class:`OutcomeKind` (a plain string of one is converted; another raises
    ``ValueError``); ``saved``: the failure was saved on the subscription (the retry ladder).
    """

    kind: OutcomeKind
    invoice_id: str | None = None
    error: str = ""
    failure_number: int = 0
    saved: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kind = OutcomeKind(self.kind)


# --- billing time ---------------------------------------------------------------------------------------------------


def billing_time(test_clock_id: str | None, as_of: datetime | None = None) -> datetime:
    """``as_of`` if given, else the clock's ``frozen_time`` for an object on a test clock, else the DB's now()."""
    if as_of is not None:
        return as_of
    if test_clock_id:
        return TestClock.objects.only("frozen_time").get(pk=test_clock_id).frozen_time
    return database_now()


def wall_clock_now(now: datetime, *, test_clock_id: str | None, as_of: datetime | None) -> datetime:
    """The DB's now() in the caller's transaction, given its billing time ``now`` (:func:`billing_time`).

    For a wall-clock object without ``as_of`` that billing time is the DB's now() already (the
    same all through a transaction), so it is reused and no query is made.
    """
    return now if test_clock_id is None and as_of is None else database_now()


def attempt_time(now: datetime, *, test_clock_id: str | None, as_of: datetime | None) -> datetime:
    """The time written on a payment attempt (``started_at``, ``completed_at``), given the billing time ``now``.

    On a test clock it is ``now``, the clock's time; a wall-clock object's attempt is dated by the
    DB's now() (:func:`wall_clock_now`), whatever ``as_of`` the caller bills by.
    """
    return now if test_clock_id else wall_clock_now(now, test_clock_id=None, as_of=as_of)


# --- the charge lock of a clock's invoice ----------------------------------------------------------------------------


# The charge lock is a claim (hardcount.claims) on this key, taken by the sending thread from the
# reservation to the recorded outcome: it outlives the reservation's transaction and lapses one claim
# TTL after its process stops beating.
def _charge_key(invoice_id: str) -> str:
    return f"charge:{invoice_id}"


# The charge locks this thread holds, in the order taken (a lock taken twice is listed twice).
_held = threading.local()


def _held_locks() -> list[str]:
    if not hasattr(_held, "invoice_ids"):
        _held.invoice_ids = []
    return _held.invoice_ids


def take_charge_lock(invoice_id: str) -> bool:
    """Take the charge lock of a test-clock invoice for this thread; False when another holder has it.

    Released by the :func:`charging` block around the charge (run every reservation inside one).
    """
    return not take_charge_locks([invoice_id])


def take_charge_locks(invoice_ids: list[str]) -> list[str]:
    """:func:`take_charge_lock` for each of ``invoice_ids`` in one statement; the ids another holder has."""
    if not invoice_ids:
        return []
    taken = set(claims.take([_charge_key(invoice_id) for invoice_id in invoice_ids]))
    _held_locks().extend(invoice_id for invoice_id in invoice_ids if _charge_key(invoice_id) in taken)
    return [invoice_id for invoice_id in invoice_ids if _charge_key(invoice_id) not in taken]


def charges_in_flight(invoice_ids: list[str]) -> list[str]:
    """The invoices among ``invoice_ids`` whose charge lock another holder has (their charge is in flight)."""
    held = set(claims.held_elsewhere([_charge_key(invoice_id) for invoice_id in invoice_ids]))
    return [invoice_id for invoice_id in invoice_ids if _charge_key(invoice_id) in held]


def _release(taken: list[str]) -> None:
    if not taken:
        return
    try:
        claims.release([_charge_key(invoice_id) for invoice_id in reversed(taken)])
    except DatabaseError:
        log.warning("could not free %d charge lock(s); they lapse by themselves", len(taken))
        connection.close()


@contextmanager
def charging() -> Iterator[None]:
    """Wrap a reservation, its gateway call and its record: on the way out, free the charge locks taken inside.

    Blocks nest: each frees only the locks taken since it began. A lock that cannot be freed
    (the database is unreachable) lapses by itself one claim TTL later.
    """
    held = _held_locks()
    mark = len(held)
    try:
        yield
    finally:
        taken, held[mark:] = held[mark:], []
        _release(taken)


# --- step 1 ---------------------------------------------------------------------------------------------------------


def reserve_attempt_locked(
    invoice: Invoice, customer: Customer, *, now: datetime, first_attempt: bool = False
) -> ChargePlan:
    """Reserve the next payment attempt of an ``open`` invoice (invoice and customer locked by the caller).

    ``now`` is the attempt's time (:func:`attempt_time`: the clock's on a test clock). If the
    latest attempt is still open (``unknown``, or a transient error) it is re-sent under its own
    key and body, or, when :func:`must_look_up` (its PaymentIntent is processing, or its key may
    have expired at the gateway, measured on the database's wall clock), looked up instead
    (``plan.look_up``): raises :class:`PaymentInFlight` when it is ``unknown`` and someone is
    sending it right now (younger than :func:`in_flight_window`; on a test clock, another holder
    has the invoice's charge lock). Otherwise a new attempt: number n+1, key
    ``hc:{invoice}:create`` while the invoice has no PaymentIntent, else
    ``hc:{invoice}:attempt:{n+1}``, charging the customer's current default payment method
    ``amount_due`` (frozen since finalisation). With no payment method there is nothing to call:
    the attempt is a decline (``payment_method_missing``). ``first_attempt``: the caller inserted
    the invoice in this transaction, so it has no attempt yet (saves a query). On a test clock the
    invoice's charge lock is taken here: call this inside :func:`charging`.
    """
    latest = None if first_attempt else invoice.payment_attempts.order_by("-attempt_number").first()
    if customer.test_clock_id and not take_charge_lock(invoice.id):
        raise PaymentInFlight(f"A payment of invoice {invoice.id} is in flight; try again later.")
    if latest is not None and is_open(latest):
        if (
            not customer.test_clock_id
            and latest.outcome == PaymentAttempt.UNKNOWN
            and latest.started_at > now - in_flight_window()
        ):
            raise PaymentInFlight(f"A payment of invoice {invoice.id} is in flight; try again later.")
        # A key's age is the gateway's, in real time: never measured on a test clock.
        look_up = must_look_up(latest, now=database_now() if customer.test_clock_id else now)
        latest.outcome = PaymentAttempt.UNKNOWN
        latest.started_at = now
        latest.save(update_fields=["outcome", "started_at"])
        request = _request(invoice, customer, latest)
        if look_up:
            # The PaymentIntent the attempt made, when it is known (a confirmation's, or a create's that answered).
            request = replace(request, payment_intent_id=latest.payment_intent_id or invoice.payment_intent_id)
        return ChargePlan(latest.id, invoice.id, invoice.subscription_id, request, look_up=look_up)

    attempt = new_attempt(invoice, customer, number=(latest.attempt_number if latest else 0) + 1, now=now)
    attempt.save(force_insert=True)
    if not attempt.payment_method:
        # Nothing to send. Recorded as a decline by record_outcome (the caller runs it in this
        # same transaction when ``known_result`` is set).
        known = gw.ChargeResult(
            outcome=gw.DECLINED,
            decline_code="payment_method_missing",
            error_message="The customer has no default payment method.",
        )
        return ChargePlan(attempt.id, invoice.id, invoice.subscription_id, None, known_result=known)
    return plan_for(invoice, customer, attempt)


def new_attempt(invoice: Invoice, customer: Customer, *, number: int, now: datetime) -> PaymentAttempt:
    """Unsaved payment attempt ``number`` of an open invoice: ``amount_due`` of its currency, outcome ``unknown``.

    It charges the customer's current default payment method under :func:`_new_attempt_key`; with
    no payment method it has no key (nothing will be sent). ``now``: the attempt's time
    (:func:`attempt_time`: the clock's on a test clock, else the DB's now()).
    """
    attempt = PaymentAttempt(
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        invoice=invoice,
        attempt_number=number,
        payment_intent_id=invoice.payment_intent_id,
        payment_method=customer.default_payment_method,
        amount=invoice.amount_due,
        currency=invoice.currency,
        outcome=PaymentAttempt.UNKNOWN,
        started_at=now,
        completed_at=now,
    )
    if attempt.payment_method:
        attempt.idempotency_key = _new_attempt_key(invoice, number)
    return attempt


def plan_for(invoice: Invoice, customer: Customer, attempt: PaymentAttempt) -> ChargePlan:
    """The step-2 plan of a reserved ``attempt`` that has a payment method to charge."""
    return ChargePlan(attempt.id, invoice.id, invoice.subscription_id, _request(invoice, customer, attempt))


def _new_attempt_key(invoice: Invoice, number: int) -> str:
    """The key of new attempt ``number``: confirm the invoice's PaymentIntent, or create it.

    The create key is ``hc:{invoice}:create``, unless an earlier attempt took it without a
    PaymentIntent coming of it (its card was declined when attached, before the create request):
    that key stays bound to the earlier body (another payment method), so this attempt creates
    under ``hc:{invoice}:create:{n}``. Still one PaymentIntent per invoice: none exists yet.
    """
    if invoice.payment_intent_id:
        return gw.attempt_key(invoice.id, number)
    if number > 1 and invoice.payment_attempts.filter(idempotency_key=gw.create_key(invoice.id)).exists():
        return f"{gw.create_key(invoice.id)}:{number}"
    return gw.create_key(invoice.id)


def _request(invoice: Invoice, customer: Customer, attempt: PaymentAttempt) -> gw.ChargeRequest:
    # Everything that shapes the body under the key comes from the attempt row (frozen when it
    # was reserved) or from ids that never change once known.
    confirms = not attempt.idempotency_key.startswith(gw.create_key(invoice.id))
    return gw.ChargeRequest(
        invoice_id=invoice.id,
        customer_id=customer.id,
        customer_email=customer.email,
        customer_name=customer.name,
        gateway_customer_id=customer.gateway_customer_id,
        payment_method=attempt.payment_method,
        attach_payment_method=customer.gateway_payment_method != attempt.payment_method,
        amount=attempt.amount,
        currency=attempt.currency,
        idempotency_key=attempt.idempotency_key,
        payment_intent_id=""
        if attempt.idempotency_key.startswith(gw.create_key(invoice.id))
        else attempt.payment_intent_id,
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        # A credit note reduced amount_due since the PaymentIntent was created: its amount follows first.
        # No credit note is issued while an attempt is open, so a same-key re-send sees the same value.
        update_amount=confirms and invoice.pre_payment_credit_notes_amount > 0,
    )


def settle_without_charge_locked(invoice: Invoice, customer: Customer, *, now: datetime) -> PaymentAttempt:
    """Settle an open invoice whose ``amount_due`` is zero or under the gateway's minimum, without a call.

    Zero: paid. Under the minimum (e.g. 50 cents USD, :func:`hardcount.money.minimum_charge`):
    the amount is carried to the customer's balance as a debit for the next invoice, and the
    invoice is marked paid, as Stripe does; ``amount_paid`` stays 0 (no money moved; the ledger
    entry ``carried_debit`` links the invoice). Emits ``invoice.paid``.
    """
    latest = invoice.payment_attempts.order_by("-attempt_number").first()
    if invoice.amount_due > 0:
        carry_debit_locked(customer, invoice, at=now)
    attempt = settled_attempt(invoice, number=(latest.attempt_number if latest else 0) + 1, now=now)
    attempt.save(force_insert=True)
    invoice.status = Invoice.PAID
    invoice.paid_at = now
    invoice.save(update_fields=["status", "paid_at"])
    invoice_event(invoice, "invoice.paid", created_at=now)
    return attempt


def settled_attempt(invoice: Invoice, *, number: int, now: datetime) -> PaymentAttempt:
    """The attempt row (not saved) of an invoice settled without a call: ``succeeded``, ``settled_without_charge``,
    for the invoice's ``amount_due`` (minor units, its currency), started and completed at ``now``."""
    return PaymentAttempt(
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        invoice=invoice,
        attempt_number=number,
        amount=invoice.amount_due,
        currency=invoice.currency,
        outcome=PaymentAttempt.SUCCEEDED,
        settled_without_charge=True,
        started_at=now,
        completed_at=now,
    )


def needs_no_charge(invoice: Invoice) -> bool:
    """True when ``amount_due`` is zero or below the currency's minimum charge."""
    return invoice.amount_due < minimum_charge(invoice.currency)


# --- step 2 ---------------------------------------------------------------------------------------------------------


@dataclass
class GatewayCall:
    """Step 2 of ``plan`` bound to its account: :meth:`call` makes it without touching the database.

    Built on the caller's connection by :func:`bind_send` (which account charges the invoice's tenant
    may need a query); ``gateway`` is None when there is nothing to call or the account could not be
    had (``error``: the exception, answered as an ``error`` outcome). ``account`` names the account
    for its rate limit; ``requests`` is how many requests the call makes.
    """

    plan: ChargePlan
    gateway: gw.Gateway | None = None
    error: Exception | None = None

    @property
    def account(self) -> str:
        return getattr(self.gateway, "account", "") or ""

    @property
    def livemode(self) -> bool:
        return bool(self.plan.request and self.plan.request.livemode)

    @property
    def requests(self) -> int:
        """The requests :meth:`call` sends: a lookup one (more only for a long list); a charge one, plus one to
        create the gateway customer, one to attach the payment method and one to update the amount."""
        req = self.plan.request
        if self.plan.known_result is not None or req is None or self.gateway is None:
            return 0
        if self.plan.look_up:
            return 1
        updates = bool(req.payment_intent_id) and req.update_amount
        return 1 + (not req.gateway_customer_id) + req.attach_payment_method + updates

    def call(self) -> gw.ChargeResult:
        """The gateway call (no transaction open, no database access): the charge, or the lookup when
        ``plan.look_up``. Never raises for gateway trouble; an unexpected exception is an ``error`` outcome
        (a failure of the close). An account backing off after a 429 is not called: the answer is
        ``rate_limited`` (docs/decisions/0133-gateway-rate-limits.md)."""
        plan = self.plan
        if plan.known_result is not None:
            return plan.known_result
        assert plan.request is not None
        try:
            if self.error is not None:
                raise self.error
            assert self.gateway is not None
            if plan.look_up:
                return self.gateway.look_up(plan.request)
            return self.gateway.charge(plan.request)
        except Exception as exc:  # a bug or a library surprise: a failure, never a lost close
            log.exception("gateway call for %s raised", plan.invoice_id)
            return gw.ChargeResult(
                outcome=gw.ERROR,
                error_message=f"{type(exc).__name__}: {exc}",
                gateway_customer_id=plan.request.gateway_customer_id,
                payment_intent_id=plan.request.payment_intent_id,
            )


def bind_send(plan: ChargePlan) -> GatewayCall:
    """Bind ``plan``'s step 2 to the invoice's tenant's own account (:func:`billing.gateway_accounts.gateway_for`),
    on the caller's connection; never raises (an account that cannot be had is the call's ``error``)."""
    if plan.known_result is not None or plan.request is None:
        return GatewayCall(plan)
    try:
        return GatewayCall(plan, gateway_for(plan.request.tenant_id, plan.request.livemode))
    except Exception as exc:
        return GatewayCall(plan, error=exc)


def send(plan: ChargePlan) -> gw.ChargeResult:
    """Step 2: the gateway call for ``plan`` (no transaction open): the charge, or the lookup when
    ``plan.look_up``, in the invoice's tenant's own account (:func:`bind_send`, then
    :meth:`GatewayCall.call`). Never raises for gateway trouble."""
    return bind_send(plan).call()


# --- step 3 ---------------------------------------------------------------------------------------------------------


def is_current_period(subscription: Subscription, invoice: Invoice) -> bool:
    """True when ``invoice`` bills the subscription's first period not yet invoiced (its period has not advanced)."""
    price = subscription.price
    start = period_start(
        subscription.billing_cycle_anchor, price.interval, price.interval_count, subscription.periods_billed
    )
    return start == invoice.period_start


def period_advances(subscription: Subscription, invoice: Invoice) -> bool:
    """True when recording ``invoice``'s outcome moves the subscription past its period: the invoice bills
    the current period (:func:`is_current_period`) and the subscription was not canceled meanwhile. A cancel
    can land between a close's charge and its record (it waits for no charge); the canceled subscription
    keeps ``next_billing_at`` null and its period as the cancel left them, whatever the charge answered."""
    return subscription.status != Subscription.CANCELED and is_current_period(subscription, invoice)


def advance_period_locked(subscription: Subscription, invoice: Invoice) -> None:
    """Move the subscription past the invoice's period: ``next_billing_at`` = the next period's start."""
    subscription.current_period_start = invoice.period_start
    subscription.current_period_end = invoice.period_end
    subscription.periods_billed += 1
    subscription.next_billing_at = invoice.period_end


def clear_failure_state(subscription: Subscription) -> None:
    """A successful close clears the failure state (docs/reference/billing.md#retry-ladder)."""
    subscription.billing_failure_count = 0
    subscription.next_billing_attempt_at = None
    subscription.billing_parked_at = None
    subscription.last_billing_error = ""


def _has_other_open_invoices(subscription: Subscription, invoice: Invoice) -> bool:
    return subscription.invoices.filter(status=Invoice.OPEN).exclude(pk=invoice.pk).exists()


def act_on_paid_locked(subscription: Subscription | None, invoice: Invoice, *, now: datetime) -> None:
    """The subscription side of a paid invoice (subscription locked): advance its period if the
    invoice is for the current one, clear the failure state, and return it to ``active``."""
    if subscription is None:
        return
    other_open = subscription.status == Subscription.PAST_DUE and _has_other_open_invoices(subscription, invoice)
    if paid_changes(subscription, invoice, other_open_invoices=other_open):
        subscription.save()
        subscription_event(subscription, "subscription.updated", created_at=now)


def paid_changes(subscription: Subscription, invoice: Invoice, *, other_open_invoices: bool) -> bool:
    """Apply a paid invoice to the subscription in memory; True when anything changed (save it and emit
    ``subscription.updated``). The current period advances and the failure state clears; ``trialing``,
    or ``past_due`` with no ``other_open_invoices``, becomes ``active``."""
    changed = False
    if period_advances(subscription, invoice):
        advance_period_locked(subscription, invoice)
        clear_failure_state(subscription)
        changed = True
    if subscription.status == Subscription.TRIALING or (
        subscription.status == Subscription.PAST_DUE and not other_open_invoices
    ):
        subscription.status = Subscription.ACTIVE
        changed = True
    return changed


def act_on_declined_locked(
    subscription: Subscription | None, invoice: Invoice, *, now: datetime, decline_code: str
) -> None:
    """The subscription side of a declined invoice: advance the period (the invoice stays open),
    ``past_due``, and the dunning run of the invoice (a declined invoice gets dunning,
    docs/reference/dunning.md#dunning-runs)."""
    if subscription is not None:
        advanced, became_past_due = declined_changes(subscription, invoice)
        if advanced or became_past_due:
            subscription.save()
        declined_events(subscription, advanced=advanced, became_past_due=became_past_due, now=now)
    run = dunning_services.start_dunning(invoice, declined_at=now, decline_code=decline_code)
    if subscription is not None and subscription.status == Subscription.CANCELED:
        # A cancel that landed while this charge was in flight: nothing more is collected, as for a run of a
        # subscription canceled later (the dunning pass's subscription_canceled end).
        dunning_services.subscription_canceled_locked(run.id, at=now)


def declined_changes(subscription: Subscription, invoice: Invoice) -> tuple[bool, bool]:
    """Apply a declined invoice to the subscription in memory; ``(advanced, became_past_due)`` (save it when
    either is true, then :func:`declined_events`). The current period advances (the invoice stays open) and
    the failure state clears; ``trialing`` or ``active`` becomes ``past_due``."""
    advanced = period_advances(subscription, invoice)
    if advanced:
        advance_period_locked(subscription, invoice)
        clear_failure_state(subscription)
    became_past_due = subscription.status in (Subscription.TRIALING, Subscription.ACTIVE)
    if became_past_due:
        subscription.status = Subscription.PAST_DUE
    return advanced, became_past_due


def declined_events(subscription: Subscription, *, advanced: bool, became_past_due: bool, now: datetime) -> None:
    """The events of :func:`declined_changes`: ``subscription.past_due``, then ``subscription.updated``."""
    if became_past_due:
        subscription_event(subscription, "subscription.past_due", created_at=now)
    if advanced:
        subscription_event(subscription, "subscription.updated", created_at=now)


def act_on_pending_locked(subscription: Subscription | None, invoice: Invoice, *, now: datetime) -> None:
    """The subscription side of a payment that finishes later (``processing``, ``requires_action``).

    The invoice stays ``open`` and the period advances, as after a decline, but the
    subscription's status stays and nothing goes on the retry ladder or to dunning: the payment
    was not refused, it is not finished (docs/reference/payments.md).
    """
    if subscription is None or not period_advances(subscription, invoice):
        return
    advance_period_locked(subscription, invoice)
    clear_failure_state(subscription)
    subscription.save()
    subscription_event(subscription, "subscription.updated", created_at=now)


def action_required(result: gw.ChargeResult) -> dict:
    """The keys ``invoice.payment_action_required`` adds to the invoice: what the tenant needs to bring the
    customer back to authenticate (Stripe.js ``handleNextAction`` with ``client_secret``;
    https://docs.stripe.com/payments/paymentintents/lifecycle). The invoice's own ``hosted_invoice_url`` is
    the page where the customer can do it themselves (docs/reference/invoice-documents.md)."""
    return {
        "payment_intent": {
            "id": result.payment_intent_id,
            "object": "payment_intent",
            "status": result.payment_intent_status,
            "client_secret": result.client_secret or None,
            "next_action": result.next_action,
        },
    }


def save_failure_locked(subscription: Subscription, *, error: str, fresh: bool = False) -> tuple[int, bool]:
    """Save a failed close on a wall-clock subscription (locked): one more failure on the retry
    ladder, ``subscription.billing_failed`` (or ``subscription.billing_parked`` for the 8th).
    Returns ``(failure_number, parked)``. Test-clock subscriptions keep the reason on the clock
    instead (their failures are not saved, docs/reference/billing.md#failures-that-are-not-saved)."""
    if subscription.test_clock_id:
        TestClock.objects.filter(pk=subscription.test_clock_id).update(last_failure=error[:2000])
        return 0, False
    count, next_at, parked_at, failed_at = record_billing_failure(subscription.id, error=error, fresh=fresh)
    subscription.billing_failure_count = count
    subscription.next_billing_attempt_at = next_at
    subscription.billing_parked_at = parked_at
    subscription.last_billing_error = error[:2000]
    subscription_event(
        subscription,
        "subscription.billing_parked" if parked_at else "subscription.billing_failed",
        created_at=failed_at,
    )
    return count, parked_at is not None


def write_billing_attempt(
    run: BillingRun | None, subscription_id: str, outcome: Outcome, *, now: datetime
) -> BillingAttempt | None:
    """The run's history row for one subscription (inside the caller's transaction)."""
    if run is None:
        return None
    row = billing_attempt_row(run, subscription_id, outcome, now=now)
    row.save(force_insert=True)
    return row


def billing_attempt_row(run: BillingRun, subscription_id: str, outcome: Outcome, *, now: datetime) -> BillingAttempt:
    """The run's history row for one subscription's :class:`Outcome` (not saved; the error cut to 2,000 characters)."""
    return BillingAttempt(
        run=run,
        subscription_id=subscription_id,
        invoice_id=outcome.invoice_id,
        outcome=BillingAttempt.Outcome(outcome.kind),
        error=outcome.error[:2000],
        failure_number=outcome.failure_number,
        created_at=now,
    )


def record_outcome(
    plan: ChargePlan,
    result: gw.ChargeResult,
    *,
    fence: Fence = NO_FENCE,
    save_failure: bool = False,
    fresh_ladder: bool = False,
    run: BillingRun | None = None,
    as_of: datetime | None = None,
    retry_of: str | None = None,
    on_record=None,
) -> Outcome:
    """Step 3: record ``result`` on the attempt and act on it, in one fenced transaction.

    Locks subscription → invoice → attempt → customer (the order every billing writer uses),
    then the invoice's dunning run when dunning acts on the outcome. ``save_failure``: an
    indefinite outcome of the invoice's current period is saved on the subscription (the
    drain's close); elsewhere (reconciler, pay API) a failure only stays on the attempt. A
    PaymentIntent that finishes later (:attr:`billing.gateway.ChargeResult.pending`) is neither a
    failure nor a decline: ``payment_pending``, the period advances (:func:`act_on_pending_locked`),
    and ``requires_action`` emits ``invoice.payment_action_required`` once per entry into that state.
    ``retry_of``: the dunning run this charge retries; a failure puts it off
    (:func:`dunning.services.retry_failed_locked`). ``on_record(invoice, attempt, outcome)``
    runs inside the transaction, last (the close's test seam, ``billing.services.close.hooks``).
    Returns the :class:`Outcome`; writes ``run``'s billing attempt row when given.
    """
    with transaction.atomic(), outbox_services.deferred_events():
        fence.check()
        subscription, invoice, attempt, customer = charge_rows_locked(
            subscription_id=plan.subscription_id, invoice_id=plan.invoice_id, attempt_id=plan.attempt_id
        )
        clock_id = invoice_clock_id(invoice, subscription)
        now = billing_time(clock_id, as_of)

        customer_fields = note_gateway_ids(customer, attempt, result)
        if customer_fields:
            customer.save(update_fields=customer_fields)

        if attempt.outcome != PaymentAttempt.UNKNOWN and not is_open(attempt):
            # Someone recorded a definite outcome first (a racing same-key re-send, or the PaymentIntent's
            # inbound event): theirs stands and they acted on it. The close's count says what it came to.
            kind = {PaymentAttempt.SUCCEEDED: OutcomeKind.BILLED, PaymentAttempt.DECLINED: OutcomeKind.DECLINED}.get(
                attempt.outcome, OutcomeKind.SKIPPED
            )
            outcome = Outcome(
                kind, invoice.id, error=f"attempt already recorded as {attempt.outcome}" if kind == "skipped" else ""
            )
            if plan.subscription_id:
                write_billing_attempt(run, plan.subscription_id, outcome, now=now)
            return outcome

        previous_status = attempt.payment_intent_status
        apply_result(attempt, result, completed_at=attempt_time(now, test_clock_id=clock_id, as_of=as_of))
        attempt.save()
        invoice_fields = []  # saved with the outcome's own invoice update, or at the end
        if result.payment_intent_id and not invoice.payment_intent_id:
            invoice.payment_intent_id = result.payment_intent_id
            invoice_fields.append("payment_intent_id")

        if result.outcome == gw.SUCCEEDED:
            outcome = Outcome(OutcomeKind.BILLED, invoice.id)
            if invoice.status == Invoice.OPEN:
                mark_paid(invoice, now=now)
                invoice.save(update_fields=[*PAID_FIELDS, *invoice_fields])
                invoice_fields = []
                invoice_event(invoice, "invoice.paid", created_at=now)
                if invoice.attempt_count > 1:
                    # Dunning starts only on a recorded decline, which counted an attempt before this
                    # one: a first attempt has no run to stop (saves a query per close).
                    dunning_services.stop_dunning(invoice, ended_at=now, recovered=True)
            act_on_paid_locked(subscription, invoice, now=now)
        elif result.outcome == gw.DECLINED:
            outcome = Outcome(OutcomeKind.DECLINED, invoice.id, error=f"declined: {result.decline_code}")
            invoice.attempt_count += 1
            invoice.save(update_fields=["attempt_count", *invoice_fields])
            invoice_fields = []
            act_on_declined_locked(subscription, invoice, now=now, decline_code=result.decline_code)
            # After dunning took the decline, so the event says when the next retry is (Stripe's
            # next_payment_attempt; null when none is scheduled).
            invoice_event(
                invoice,
                "invoice.payment_failed",
                created_at=now,
                extra={"next_payment_attempt": iso(dunning_services.next_payment_attempt(invoice.id))},
            )
        elif result.rate_limited:
            # The account's rate limit, not the invoice's failure: off the retry ladder; the attempt stays
            # open (a transient 429), so the next close re-sends it under its key once the gate opens.
            outcome = Outcome(OutcomeKind.SKIPPED, invoice.id, error=f"rate limited: {result.error_message}")
            if retry_of is not None:
                wait = timedelta(seconds=result.retry_after_s or gw.BACKOFF_BASE_S)
                dunning_services.payment_in_flight_locked(retry_of, until=(as_of or database_now()) + wait)
        elif result.pending:
            outcome = Outcome(OutcomeKind.PAYMENT_PENDING, invoice.id, error=result.error_message)
            act_on_pending_locked(subscription, invoice, now=now)
            if result.payment_intent_status == gw.REQUIRES_ACTION and previous_status != gw.REQUIRES_ACTION:
                invoice_event(invoice, "invoice.payment_action_required", created_at=now, extra=action_required(result))
        else:
            error = f"{result.outcome}: {result.error_message}"
            outcome = Outcome(OutcomeKind.FAILED, invoice.id, error=error)
            if save_failure and subscription is not None and period_advances(subscription, invoice):
                outcome.failure_number, _parked = save_failure_locked(subscription, error=error, fresh=fresh_ladder)
                outcome.saved = not subscription.test_clock_id
        if invoice_fields:
            invoice.save(update_fields=invoice_fields)
        if retry_of is not None and outcome.kind == OutcomeKind.FAILED:
            # A decline or a payment moved the run on above (start_dunning / stop_dunning).
            dunning_services.retry_failed_locked(retry_of, error=outcome.error, at=as_of or database_now())
        elif retry_of is not None and outcome.kind == OutcomeKind.PAYMENT_PENDING:
            # Neither a decline nor a failure: the run waits (its retry slot kept) while the payment finishes.
            at = as_of or database_now()
            dunning_services.payment_in_flight_locked(retry_of, until=at + pending_poll_interval())
        if on_record is not None:
            on_record(invoice, attempt, outcome)
        if plan.subscription_id:
            write_billing_attempt(run, plan.subscription_id, outcome, now=now)
        return outcome


class PaymentIntentEffect(StrEnum):
    """What :func:`record_payment_intent` did with a PaymentIntent's state."""

    RECORDED = "recorded"  # recorded on the invoice's open attempt (or a new one for a payment made by the customer)
    NOT_OPEN = "not_open"  # the invoice is paid, void or uncollectible: nothing changes
    OTHER_PAYMENT_INTENT = "other_payment_intent"  # not the invoice's PaymentIntent
    NO_CHANGE = "no_change"  # the latest attempt already has a definite outcome this state does not change


def record_payment_intent(invoice_id: str, result: gw.ChargeResult) -> tuple[PaymentIntentEffect, Outcome | None]:
    """Record what the gateway says a PaymentIntent of ``invoice_id`` became (``result``: its classification), once.

    For inbound Stripe events (:mod:`billing.stripe_webhooks`): the rows' locks and the attempt's
    state decide, never the order events arrive in. Locks subscription → invoice → attempt →
    customer (:func:`record_outcome`'s order). An invoice not ``open`` changes nothing (a
    ``payment_failed`` after ``succeeded`` leaves it paid), nor does a PaymentIntent other than the
    invoice's. The latest attempt still open (``unknown``: sent, processing, requiring action, or
    its answer lost) takes ``result`` as :func:`record_outcome` records a charge's answer, events and
    all; one already definite is changed only by a success (the customer paid on-session with the
    PaymentIntent's ``client_secret`` after a decline), recorded as a new attempt with no key.
    Returns the effect and the recorded :class:`Outcome` (None when nothing was recorded). Raises
    ``Invoice.DoesNotExist`` for an unknown invoice.
    """
    # paid, void and uncollectible are final: an invoice read in one of them needs no lock to say so (the
    # drain's claims skip locked subscriptions, so an event about a paid invoice should not hold one).
    subscription_id, status = Invoice.objects.values_list("subscription_id", "status").get(pk=invoice_id)
    if status not in (Invoice.DRAFT, Invoice.OPEN):
        return PaymentIntentEffect.NOT_OPEN, None
    with transaction.atomic():
        _subscription, invoice = subscription_and_invoice_locked(invoice_id, subscription_id=subscription_id)
        if invoice is None or invoice.status != Invoice.OPEN:
            return PaymentIntentEffect.NOT_OPEN, None
        if invoice.payment_intent_id and invoice.payment_intent_id != result.payment_intent_id:
            return PaymentIntentEffect.OTHER_PAYMENT_INTENT, None
        latest = payment_attempt_qs_select_for_update().filter(invoice=invoice).order_by("-attempt_number").first()
        if latest is not None and (latest.outcome == PaymentAttempt.UNKNOWN or is_open(latest)):
            attempt = latest
        elif result.outcome == gw.SUCCEEDED:
            now = billing_time(invoice_clock_id(invoice, _subscription))
            attempt = PaymentAttempt(
                tenant_id=invoice.tenant_id,
                livemode=invoice.livemode,
                invoice=invoice,
                attempt_number=(latest.attempt_number if latest else 0) + 1,
                payment_intent_id=result.payment_intent_id,
                payment_method=latest.payment_method if latest else "",
                amount=invoice.amount_due,
                currency=invoice.currency,
                outcome=PaymentAttempt.UNKNOWN,
                started_at=now,
                completed_at=now,
            )
            attempt.save(force_insert=True)
        else:
            return PaymentIntentEffect.NO_CHANGE, None
        plan = ChargePlan(attempt.id, invoice.id, invoice.subscription_id, None)
        return PaymentIntentEffect.RECORDED, record_outcome(plan, result)


def note_gateway_ids(customer: Customer, attempt: PaymentAttempt, result: gw.ChargeResult) -> list[str]:
    """Keep the gateway's customer id and attached payment method on the customer (in memory); the changed fields."""
    fields = []
    if result.gateway_customer_id and customer.gateway_customer_id != result.gateway_customer_id:
        customer.gateway_customer_id = result.gateway_customer_id
        fields.append("gateway_customer_id")
    if result.payment_method_attached and customer.gateway_payment_method != attempt.payment_method:
        customer.gateway_payment_method = attempt.payment_method
        fields.append("gateway_payment_method")
    return fields


ATTEMPT_RESULT_FIELDS = (
    "outcome",
    "decline_code",
    "error_message",
    "http_status",
    "completed_at",
    "payment_intent_id",
    "payment_intent_status",
)


def apply_result(attempt: PaymentAttempt, result: gw.ChargeResult, *, completed_at: datetime) -> None:
    """Write the gateway's answer on the attempt in memory (:data:`ATTEMPT_RESULT_FIELDS`); texts are truncated
    to their columns, and a PaymentIntent id or status the answer lacks keeps the attempt's own."""
    attempt.outcome = result.outcome
    attempt.decline_code = result.decline_code[:100]
    attempt.error_message = result.error_message[:2000]
    attempt.http_status = result.http_status
    attempt.completed_at = completed_at
    if result.payment_intent_status:
        attempt.payment_intent_status = result.payment_intent_status
    if result.payment_intent_id:
        attempt.payment_intent_id = result.payment_intent_id


PAID_FIELDS = ("status", "amount_paid", "paid_at", "attempt_count")


def mark_paid(invoice: Invoice, *, now: datetime) -> None:
    """An open invoice paid by a charge, in memory (:data:`PAID_FIELDS`): ``amount_paid = amount_due``, one
    more attempt counted."""
    invoice.status = Invoice.PAID
    invoice.amount_paid = invoice.amount_due
    invoice.paid_at = now
    invoice.attempt_count += 1


def invoice_clock_id(invoice: Invoice, subscription: Subscription | None) -> str | None:
    """The test clock an invoice's billing time follows (its subscription's, else its customer's)."""
    if subscription is not None:
        return subscription.test_clock_id
    return Customer.objects.only("test_clock_id").get(pk=invoice.customer_id).test_clock_id
