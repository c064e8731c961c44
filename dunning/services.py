"""Dunning's state and policy (docs/reference/dunning.md): the run's transitions billing calls inside its
own transactions, and the tenant's policy.

A declined invoice gets one :class:`~dunning.models.DunningRun`. Its schedule (docs/decisions/0070):
retry k of n is due ``retry_days[k-1]`` days after the schedule's anchor, the first decline
(default 1, 3, 5 and 7 days); the run is frozen to the tenant's ``retry_days`` when it starts.
Each retry charges the customer's current default payment method under its own idempotency key
(billing's ``retry_invoice_payment``). The invoice paid (by a retry or any
other way) ends the run as ``recovered``; voided, as ``ended``; a decline of the last retry
exhausts it: the invoice becomes ``uncollectible`` and the subscription takes the tenant's final
action, ``unpaid`` or ``canceled``. A hard decline (:data:`HARD_DECLINE_CODES`) stops the
retries until the customer's payment method changes (:func:`payment_method_changed`), which
makes the run due at once (docs/decisions/0071).

Dunning is a leaf (docs/decisions/0120): it imports nothing of billing. Billing coordinates.
Its pass (:mod:`billing.services.dunning_pass`) claims due runs with :func:`due_runs_locked`
and :func:`claim_locked`, then charges or settles each invoice in billing's own transactions,
which call this module's state functions last, after billing's rows are locked: a decline
(:func:`start_dunning`), a payment or a void (:func:`stop_dunning`), a gateway failure
(:func:`retry_failed_locked`), nothing to collect (:func:`payment_in_flight_locked`,
:func:`subscription_canceled_locked`, :func:`invoice_not_open_locked`), exhaustion
(:func:`exhaust_locked`). Rows are locked through :mod:`dunning.lock_objects` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from django.db import connection, transaction

from dunning import lock_objects
from dunning.models import DEFAULT_RETRY_DAYS, DunningRun, DunningSettings
from dunning.representations import dunning_run_data
from dunning.schedule import last_retry_at, next_retry_at, retry_at
from hardcount.bulk import insert_models
from hardcount.errors import InvalidRequestError
from hardcount.times import database_now
from outbox.services import emit_for

# The policy's final actions (``unpaid`` or ``canceled``), for callers that may not import the models.
FinalAction = DunningSettings.FinalAction

# Decline codes that retrying the same card cannot cure: the card is gone, blocked or refused
# for good, or there is none (Stripe's "do not try again" codes, and its advice for
# ``do_not_honor`` and ``authentication_required`` off-session). No automatic retry until the
# customer's payment method changes.
HARD_DECLINE_CODES = frozenset(
    {
        "authentication_required",
        "card_not_supported",
        "currency_not_supported",
        "do_not_honor",
        "expired_card",
        "fraudulent",
        "incorrect_number",
        "invalid_account",
        "lost_card",
        "merchant_blacklist",
        "new_account_information_available",
        "no_action_taken",
        "payment_method_missing",
        "pickup_card",
        "restricted_card",
        "revocation_of_all_authorizations",
        "revocation_of_authorization",
        "security_violation",
        "service_not_allowed",
        "stolen_card",
        "stop_payment_order",
        "transaction_not_allowed",
    }
)

MAX_RETRIES = 8
MAX_RETRY_DAY = 60
# A retry whose call failed (gateway down, 5xx, timeout) is tried again this much later,
# without using up a scheduled retry (docs/decisions/0072).
ERROR_RETRY_DELAY = timedelta(hours=1)


class ClaimAction(StrEnum):
    """What a claimed run is due for (:func:`claim_locked`)."""

    RETRY = "retry"  # charge its invoice again
    SETTLE = "settle"  # apply its end state (exhaustion)
    NOTHING = "nothing"  # it was marked due early; put back on schedule


class RunRevived(Exception):
    """Raised by :func:`exhaust_locked`: the run was revived (a new payment method) after its claim.

    The caller's transaction must roll back: the run is retried instead of exhausted.
    """


def is_hard_decline(decline_code: str) -> bool:
    """True when ``decline_code`` means the same payment method will keep being declined."""
    return decline_code in HARD_DECLINE_CODES


def next_payment_attempt(invoice_id: str) -> datetime | None:
    """The next automatic charge of an invoice (Stripe's ``next_payment_attempt``), or None.

    Read inside the transaction that recorded a decline, after :func:`start_dunning`, for the
    ``invoice.payment_failed`` event.
    """
    run = DunningRun.objects.filter(invoice_id=invoice_id).first()
    return next_retry_at(run) if run is not None else None


def _invoice_clock_id(invoice) -> str | None:
    """The test clock the invoice's billing time follows: its subscription's, else its customer's."""
    if invoice.subscription_id:
        return invoice.subscription.test_clock_id
    return invoice.customer.test_clock_id


def emit_run_event(run: DunningRun, type_: str, at: datetime) -> None:
    """Emit ``type_`` (``dunning.retry_scheduled``, ``dunning.exhausted``) with the run's representation."""
    emit_for(run, type_, dunning_run_data(run), created_at=at)


# --- what billing's payments call -------------------------------------------------------------------------------------


def start_dunning(invoice, *, declined_at: datetime, decline_code: str) -> DunningRun:
    """Take a decline of ``invoice`` (a ``billing.Invoice``): open its dunning run, or move the open one on.

    Must run inside the transaction that records the decline (raises ``RuntimeError``
    otherwise), after billing has locked the invoice, so the run changes exactly when the
    decline is recorded. ``declined_at`` is the billing time (a test clock's time where one
    applies). Every decline of the invoice comes here:

    - the first one opens the run: retry 1 is due ``retry_days[0]`` after it;
    - the outcome of one of the run's retries schedules the next retry, or, after the last,
      makes the end state due at once;
    - another decline (``POST /v1/invoices/{id}/pay``) keeps the schedule;
    - a hard decline (:data:`HARD_DECLINE_CODES`) makes the run wait for a new payment method
      until the last retry's time.

    Emits ``dunning.retry_scheduled`` when the run opens and after each of its retries, unless
    its end state is due. Returns the run.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("start_dunning must run inside the transaction that records the decline")
    run = lock_objects.get_run_of_invoice_locked(invoice.id)
    opened = run is None
    if opened:
        policy = get_settings(tenant_id=invoice.tenant_id, livemode=invoice.livemode)
        run = _new_run(invoice, declined_at=declined_at, policy=policy, test_clock_id=_invoice_clock_id(invoice))
    elif run.status != DunningRun.ACTIVE:
        return run  # the run ended (its subscription was canceled): nothing more is collected
    scheduled = _take_decline(run, opened=opened, declined_at=declined_at, decline_code=decline_code)
    if opened:
        run.save(force_insert=True)
    else:
        run.save()
    if scheduled:
        emit_run_event(run, "dunning.retry_scheduled", declined_at)
    return run


def start_dunning_for_first_declines(declines: list[tuple], *, declined_at: datetime) -> list[DunningRun]:
    """:func:`start_dunning` for many invoices at once, each at its first decline: one insert for their runs.

    ``declines`` are ``(invoice, decline_code, test_clock_id)``: invoices locked by the caller, whose
    first payment attempt was just declined, so none has a run yet (the run's unique invoice makes
    the insert fail otherwise, and the caller's transaction with it); ``test_clock_id`` is the clock
    of the invoice's subscription. Opens each run as :func:`start_dunning` does (the same rule,
    :func:`_take_decline`), with one policy read per tenant and mode, and emits their
    ``dunning.retry_scheduled``. Returns the runs, in order.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("start_dunning_for_first_declines must run inside the transaction that records them")
    policies: dict[tuple[str, bool], Policy] = {}
    runs, scheduled = [], []
    for invoice, decline_code, test_clock_id in declines:
        key = (invoice.tenant_id, invoice.livemode)
        if key not in policies:
            policies[key] = get_settings(tenant_id=invoice.tenant_id, livemode=invoice.livemode)
        run = _new_run(invoice, declined_at=declined_at, policy=policies[key], test_clock_id=test_clock_id)
        runs.append(run)
        scheduled.append(_take_decline(run, opened=True, declined_at=declined_at, decline_code=decline_code))
    insert_models(DunningRun, runs)
    for run, emit in zip(runs, scheduled, strict=True):
        run._state.adding = False
        if emit:
            emit_run_event(run, "dunning.retry_scheduled", declined_at)
    return runs


def _new_run(invoice, *, declined_at: datetime, policy: Policy, test_clock_id: str | None) -> DunningRun:
    """The run a first decline of ``invoice`` opens (not saved): the policy's schedule, anchored at the decline."""
    return DunningRun(
        tenant_id=invoice.tenant_id,
        livemode=invoice.livemode,
        invoice_id=invoice.id,
        test_clock_id=test_clock_id,
        first_declined_at=declined_at,
        schedule_anchor_at=declined_at,
        retry_days=list(policy.retry_days),
        created_at=declined_at,
    )


def _take_decline(run: DunningRun, *, opened: bool, declined_at: datetime, decline_code: str) -> bool:
    """Move ``run`` on for a decline (in memory; the rules of :func:`start_dunning`). True when the run's next
    retry is now scheduled (``dunning.retry_scheduled`` is due)."""
    run.last_decline_code = (decline_code or "")[:100]
    retry_outcome = run.attempt_started_at is not None
    run.attempt_started_at = None
    run.last_error = ""
    n, k = len(run.retry_days), run.retries_done
    if retry_outcome and run.retry_requested_at is not None:
        # The payment method changed while this retry was under way (it may have charged the
        # old one): the requested retry follows at once.
        run.waiting_for_payment_method = False
        run.next_attempt_at = declined_at
    elif is_hard_decline(decline_code):
        run.waiting_for_payment_method = True
        run.retry_requested_at = None
        run.next_attempt_at = declined_at if k >= n else max(last_retry_at(run), declined_at)
    elif opened or retry_outcome or run.retry_requested_at is not None:
        # A payment-method change asked for a retry, and someone (POST /pay) just tried the new
        # method: the request is served.
        run.retry_requested_at = None
        run.next_attempt_at = retry_at(run, k + 1) if k < n else declined_at
    return (opened or retry_outcome) and (k < n or run.retry_requested_at is not None)


def stop_dunning(invoice, *, ended_at: datetime, recovered: bool = False) -> None:
    """End the active dunning run of ``invoice``, if any, inside the caller's transaction.

    ``recovered``: the invoice was paid — by one of the run's retries (``end_reason``
    ``retry_succeeded``) or another way (``paid``). Otherwise it was voided (``ended``,
    ``voided``).
    """
    run = lock_objects.get_active_run_of_invoice_locked(invoice.id)
    if run is None:
        return
    if recovered:
        reason = DunningRun.RETRY_SUCCEEDED if run.attempt_started_at is not None else DunningRun.PAID
        end_run_locked(run, DunningRun.RECOVERED, reason, at=ended_at)
    else:
        end_run_locked(run, DunningRun.ENDED, DunningRun.VOIDED, at=ended_at)


def end_run_locked(run: DunningRun, status: DunningRun.Status, reason: DunningRun.EndReason, *, at: datetime) -> None:
    """Move a locked active run to ``status`` (not ``active``) for ``reason``; nothing is due any more."""
    run.status = status
    run.end_reason = reason
    run.ended_at = at
    run.next_attempt_at = None
    run.attempt_started_at = None
    run.retry_requested_at = None
    run.waiting_for_payment_method = False
    run.save()


def payment_method_changed(customer_id: str, *, at: datetime) -> int:
    """The customer's default payment method changed: each of its active runs retries at once.

    Runs inside the transaction that changes the method (after it locked the customer). A run
    waiting after a hard decline stops waiting. If the run's next scheduled retry time has
    passed (it waited), the schedule moves so that this retry is that one and the later ones
    keep their spacing; otherwise this is an extra retry and the schedule stays. Emits
    ``dunning.retry_scheduled`` per run. Returns how many runs were touched.
    """
    runs = lock_objects.active_runs_of_customer_locked(customer_id)
    for run in runs:
        k = run.retries_done
        run.waiting_for_payment_method = False
        run.retry_requested_at = at
        if run.attempt_started_at is None:
            if k < len(run.retry_days) and retry_at(run, k + 1) < at:
                run.schedule_anchor_at = at - timedelta(days=run.retry_days[k])
            run.next_attempt_at = at
        # else: a retry is under way (claimed); its outcome makes the requested retry due at once.
        run.save()
        emit_run_event(run, "dunning.retry_scheduled", at)
    return len(runs)


# --- the tenant's policy ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A tenant's dunning policy for one mode: ``retry_days`` (days after the first decline,
    strictly increasing) and ``final_action`` (``unpaid`` or ``canceled``); ``updated_at`` is
    None while the defaults apply."""

    tenant_id: str
    livemode: bool
    retry_days: tuple[int, ...]
    final_action: FinalAction
    updated_at: datetime | None


def get_settings(*, tenant_id: str, livemode: bool) -> Policy:
    """The tenant's policy for the mode; the defaults (1, 3, 5, 7 days; ``unpaid``) without a row."""
    row = DunningSettings.objects.filter(tenant_id=tenant_id, livemode=livemode).first()
    if row is None:
        return Policy(tenant_id, livemode, DEFAULT_RETRY_DAYS, FinalAction.UNPAID, None)
    return Policy(tenant_id, livemode, tuple(row.retry_days), FinalAction(row.final_action), row.updated_at)


def validate_retry_days(retry_days: list[int]) -> tuple[int, ...]:
    """1 to :data:`MAX_RETRIES` distinct whole days from 1 to :data:`MAX_RETRY_DAY`, returned sorted.

    Raises :class:`~hardcount.errors.InvalidRequestError` (422, ``param`` ``retry_days``).
    """
    if not 1 <= len(retry_days) <= MAX_RETRIES:
        raise InvalidRequestError(f"retry_days takes 1 to {MAX_RETRIES} entries.", param="retry_days")
    for i, day in enumerate(retry_days):
        if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= MAX_RETRY_DAY:
            raise InvalidRequestError(
                f"retry_days entries are whole days from 1 to {MAX_RETRY_DAY}.", param=f"retry_days.{i}"
            )
    if len(set(retry_days)) != len(retry_days):
        raise InvalidRequestError("retry_days entries must be distinct.", param="retry_days")
    return tuple(sorted(retry_days))


def update_settings(
    *, tenant_id: str, livemode: bool, retry_days: list[int] | None = None, final_action: str | None = None
) -> Policy:
    """Change what is given of the tenant's policy for the mode; returns the new policy.

    A new schedule applies to runs that start afterwards (a run keeps the schedule it started
    with); the final action applies to every run exhausted afterwards. Raises
    :class:`~hardcount.errors.InvalidRequestError` (422) for bad values.
    """
    days = validate_retry_days(retry_days) if retry_days is not None else None
    if final_action is not None and final_action not in FinalAction.values:
        raise InvalidRequestError("final_action must be 'unpaid' or 'canceled'.", param="final_action")
    with transaction.atomic():
        row, _created = lock_objects.settings_qs_select_for_update().get_or_create(
            tenant_id=tenant_id, livemode=livemode
        )
        if days is not None:
            row.retry_days = list(days)
        if final_action is not None:
            row.final_action = final_action
        row.save()
    return get_settings(tenant_id=tenant_id, livemode=livemode)


# --- what billing's dunning pass calls --------------------------------------------------------------------------------


def due_runs_locked(
    *, livemode: bool, as_of: datetime, test_clock_id: str | None, exclude: list[str], limit: int
) -> list[DunningRun]:
    """Lock up to ``limit`` runs of one mode due by ``as_of``, skipping locked ones; oldest due first.

    ``test_clock_id`` None: wall-clock runs only, else only that clock's; ``exclude``: run ids
    the caller has handled already in its pass. Inside the caller's claim transaction
    (:data:`dunning.queries.CLAIM_DUE_RUNS`); each run then goes through :func:`claim_locked`.
    """
    return lock_objects.due_runs_locked(
        livemode=livemode, as_of=as_of, test_clock_id=test_clock_id, exclude=exclude, limit=limit
    )


def claim_locked(run: DunningRun, *, now: datetime, hold_until: datetime) -> ClaimAction:
    """Record what a due run (locked, :func:`due_runs_locked`) is due for at ``now``, and save it.

    A retry counts the scheduled retry whose time has come (``retries_done``) and marks it
    started (``attempt_started_at``); a retry asked for by a payment-method change, or one that
    never reached a definite outcome, is taken up again without using another scheduled retry.
    The end state is due when the last retry was declined or the run waits for a new payment
    method. A claimed run's ``next_attempt_at`` moves to ``hold_until``, out of every other
    claim while the caller acts on it; a run marked due early goes back on schedule
    (``NOTHING``).
    """
    n, k = len(run.retry_days), run.retries_done
    if run.attempt_started_at is not None:
        action = ClaimAction.RETRY  # resume a retry that has no definite outcome yet
    elif run.retry_requested_at is not None:
        run.retry_requested_at = None
        if k < n and retry_at(run, k + 1) <= now:
            run.retries_done = k + 1
        run.attempt_started_at = now
        action = ClaimAction.RETRY
    elif run.waiting_for_payment_method or k >= n:
        action = ClaimAction.SETTLE
    elif retry_at(run, k + 1) <= now:
        run.retries_done = k + 1
        run.attempt_started_at = now
        action = ClaimAction.RETRY
    else:
        run.next_attempt_at = retry_at(run, k + 1)
        action = ClaimAction.NOTHING
    if action != ClaimAction.NOTHING:
        run.next_attempt_at = hold_until
    run.save()
    return action


def retry_failed_locked(run_id: str, *, error: str, at: datetime) -> None:
    """The retry's charge failed (a gateway error, no definite outcome): try again :data:`ERROR_RETRY_DELAY`
    after ``at``, keeping the retry's slot. ``error`` is saved (2,000 characters). No-op unless active."""
    run = lock_objects.get_active_run_locked(run_id)
    if run is None:
        return
    run.last_error = error[:2000]
    run.next_attempt_at = at + ERROR_RETRY_DELAY
    run.save()


def payment_in_flight_locked(run_id: str, *, until: datetime) -> None:
    """A payment of the run's invoice is in flight (it may have charged the card): act on the run again at
    ``until``. No-op unless active."""
    run = lock_objects.get_active_run_locked(run_id)
    if run is None:
        return
    run.next_attempt_at = until
    run.save()


def collection_paused_locked(run_id: str, *, until: datetime) -> None:
    """The invoice's subscription has its collection paused (billing's pause_collection): nothing is retried or
    settled; act on the run again at ``until``. The retry the claim started stays started, so no scheduled
    retry is used up while paused. No-op unless active."""
    run = lock_objects.get_active_run_locked(run_id)
    if run is None:
        return
    run.next_attempt_at = until
    run.save()


def subscription_canceled_locked(run_id: str, *, at: datetime) -> None:
    """Nothing more is collected for the invoice's canceled subscription: the run ends (``ended``,
    ``subscription_canceled``) at ``at``. No-op unless active."""
    run = lock_objects.get_active_run_locked(run_id)
    if run is None:
        return
    end_run_locked(run, DunningRun.ENDED, DunningRun.SUBSCRIPTION_CANCELED, at=at)


def invoice_not_open_locked(run_id: str, *, invoice_status: str, at: datetime) -> None:
    """The run's invoice left ``open`` without the run (``invoice_status``, billing's): the run ends at ``at``.

    ``paid``: ``recovered`` (``paid``); ``void``: ``ended`` (``voided``); ``uncollectible``:
    ``exhausted`` (``invoice_settled``); anything else: ``ended`` (``invoice_settled``).
    No-op unless active.
    """
    run = lock_objects.get_active_run_locked(run_id)
    if run is None:
        return
    if invoice_status == "paid":
        end_run_locked(run, DunningRun.RECOVERED, DunningRun.PAID, at=at)
    elif invoice_status == "void":
        end_run_locked(run, DunningRun.ENDED, DunningRun.VOIDED, at=at)
    elif invoice_status == "uncollectible":
        end_run_locked(run, DunningRun.EXHAUSTED, DunningRun.INVOICE_SETTLED, at=at)
    else:
        end_run_locked(run, DunningRun.ENDED, DunningRun.INVOICE_SETTLED, at=at)


def exhaust_locked(run_id: str, *, at: datetime, subscription_id: str | None, subscription_canceled: bool) -> None:
    """The run's invoice was marked ``uncollectible`` at ``at``: the run is ``exhausted``; emits ``dunning.exhausted``.

    Inside the transaction that marked the invoice (its subscription, ``subscription_id``,
    locked before it). Every active run of that subscription is locked first
    (:func:`dunning.lock_objects.active_runs_of_subscription_locked`), then the run; when the
    final action canceled the subscription (``subscription_canceled``) its other runs end
    (``subscription_canceled``). The reason is ``no_new_payment_method`` when scheduled retries
    were left (a hard decline), else ``retries_exhausted``. Raises :class:`RunRevived` when
    the run is no longer active or a retry of it was started or asked for since its claim.
    """
    siblings = [] if subscription_id is None else lock_objects.active_runs_of_subscription_locked(subscription_id)
    run = lock_objects.get_active_run_locked(run_id)
    if run is None or run.attempt_started_at is not None or run.retry_requested_at is not None:
        raise RunRevived(run_id)
    reason = (
        DunningRun.NO_NEW_PAYMENT_METHOD if run.retries_done < len(run.retry_days) else DunningRun.RETRIES_EXHAUSTED
    )
    end_run_locked(run, DunningRun.EXHAUSTED, reason, at=at)
    emit_run_event(run, "dunning.exhausted", at)
    if subscription_canceled:
        for other in siblings:
            if other.pk != run.pk:
                end_run_locked(other, DunningRun.ENDED, DunningRun.SUBSCRIPTION_CANCELED, at=at)


def end_state_due(run_id: str, *, as_of: datetime | None) -> bool:
    """True when the run's end state is due by ``as_of`` (None: the DB's now()) right after its retry:
    the last retry was declined, or a hard decline made it wait past its last retry's time."""
    run = DunningRun.objects.filter(pk=run_id, status=DunningRun.ACTIVE).first()
    if run is None or run.attempt_started_at is not None or run.retry_requested_at is not None:
        return False
    if not (run.waiting_for_payment_method or run.retries_done >= len(run.retry_days)):
        return False
    return run.next_attempt_at is not None and run.next_attempt_at <= (as_of or database_now())


def final_action_of(run_id: str) -> FinalAction:
    """The final action the run's tenant sets for its mode now (read when the run is exhausted)."""
    run = DunningRun.objects.get(pk=run_id)
    return get_settings(tenant_id=run.tenant_id, livemode=run.livemode).final_action


def next_due_at(*, test_clock_id: str, livemode: bool = False, after: datetime | None = None) -> datetime | None:
    """The earliest time an active run on the test clock is due (later than ``after`` if given), or None.

    For the clock's advance (:mod:`billing.services.clocks`): it steps its time to each due instant.
    """
    runs = DunningRun.objects.filter(
        test_clock_id=test_clock_id, livemode=livemode, status=DunningRun.ACTIVE, next_attempt_at__isnull=False
    )
    if after is not None:
        runs = runs.filter(next_attempt_at__gt=after)
    return runs.order_by("next_attempt_at").values_list("next_attempt_at", flat=True).first()


__all__ = [
    "ERROR_RETRY_DELAY",
    "HARD_DECLINE_CODES",
    "MAX_RETRIES",
    "MAX_RETRY_DAY",
    "ClaimAction",
    "FinalAction",
    "Policy",
    "RunRevived",
    "claim_locked",
    "due_runs_locked",
    "emit_run_event",
    "end_run_locked",
    "end_state_due",
    "exhaust_locked",
    "final_action_of",
    "get_settings",
    "invoice_not_open_locked",
    "is_hard_decline",
    "last_retry_at",
    "next_due_at",
    "next_payment_attempt",
    "next_retry_at",
    "payment_in_flight_locked",
    "payment_method_changed",
    "retry_at",
    "retry_failed_locked",
    "start_dunning",
    "stop_dunning",
    "subscription_canceled_locked",
    "update_settings",
    "validate_retry_days",
]
