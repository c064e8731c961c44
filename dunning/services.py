"""Dunning's entry points (SPEC §5): what billing calls inside its own transactions, the tenant's
policy, and the pass that retries due runs.

A declined invoice gets one :class:`~dunning.models.DunningRun`. Its schedule (docs/decisions/0070):
retry k of n is due ``retry_days[k-1]`` days after the schedule's anchor, the first decline
(default 1, 3, 5 and 7 days); the run is frozen to the tenant's ``retry_days`` when it starts.
Each retry charges the customer's current default payment method under its own idempotency key
(:func:`billing.services.collection.retry_invoice_payment`). The invoice paid (by a retry or any
other way) ends the run as ``recovered``; voided, as ``ended``; a decline of the last retry
exhausts it: the invoice becomes ``uncollectible`` and the subscription takes the tenant's final
action, ``unpaid`` or ``canceled``. A hard decline (:data:`HARD_DECLINE_CODES`) stops the
retries until the customer's payment method changes (:func:`payment_method_changed`), which
makes the run due at once (docs/decisions/0071).

Billing imports this module (``start_dunning`` and ``stop_dunning`` run inside its recording
transactions), so it imports nothing from billing at load time; the retry pass lives in
:mod:`dunning.retries` and :func:`process_due` loads it on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction

from dunning.models import DEFAULT_RETRY_DAYS, DunningRun, DunningSettings
from dunning.representations import dunning_run_data
from dunning.schedule import last_retry_at, next_retry_at, retry_at
from hardcount.errors import InvalidRequestError
from hardcount.fencing import NO_FENCE, Fence
from outbox.services import emit_event

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
    emit_event(tenant_id=run.tenant_id, livemode=run.livemode, type=type_, data=dunning_run_data(run), created_at=at)


# --- what billing calls -----------------------------------------------------------------------------------------------


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
    run = DunningRun.objects.select_for_update().filter(invoice_id=invoice.id).first()
    opened = run is None
    if opened:
        policy = get_settings(tenant_id=invoice.tenant_id, livemode=invoice.livemode)
        run = DunningRun(
            tenant_id=invoice.tenant_id,
            livemode=invoice.livemode,
            invoice_id=invoice.id,
            test_clock_id=_invoice_clock_id(invoice),
            first_declined_at=declined_at,
            schedule_anchor_at=declined_at,
            retry_days=list(policy.retry_days),
            created_at=declined_at,
        )
    elif run.status != DunningRun.ACTIVE:
        return run  # the run ended (its subscription was canceled): nothing more is collected
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
    if opened:
        run.save(force_insert=True)
    else:
        run.save()
    if (opened or retry_outcome) and (k < n or run.retry_requested_at is not None):
        emit_run_event(run, "dunning.retry_scheduled", declined_at)
    return run


def stop_dunning(invoice, *, ended_at: datetime, recovered: bool = False) -> None:
    """End the active dunning run of ``invoice``, if any, inside the caller's transaction.

    ``recovered``: the invoice was paid — by one of the run's retries (``end_reason``
    ``retry_succeeded``) or another way (``paid``). Otherwise it was voided (``ended``,
    ``voided``).
    """
    run = DunningRun.objects.select_for_update().filter(invoice_id=invoice.id, status=DunningRun.ACTIVE).first()
    if run is None:
        return
    if recovered:
        reason = DunningRun.RETRY_SUCCEEDED if run.attempt_started_at is not None else DunningRun.PAID
        end_run_locked(run, DunningRun.RECOVERED, reason, at=ended_at)
    else:
        end_run_locked(run, DunningRun.ENDED, DunningRun.VOIDED, at=ended_at)


def end_run_locked(run: DunningRun, status: str, reason: str, *, at: datetime) -> None:
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
    runs = list(
        DunningRun.objects.select_for_update()
        .filter(invoice__customer_id=customer_id, status=DunningRun.ACTIVE)
        .order_by("created_at", "id")
    )
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
    final_action: str
    updated_at: datetime | None


def get_settings(*, tenant_id: str, livemode: bool) -> Policy:
    """The tenant's policy for the mode; the defaults (1, 3, 5, 7 days; ``unpaid``) without a row."""
    row = DunningSettings.objects.filter(tenant_id=tenant_id, livemode=livemode).first()
    if row is None:
        return Policy(tenant_id, livemode, DEFAULT_RETRY_DAYS, DunningSettings.UNPAID, None)
    return Policy(tenant_id, livemode, tuple(row.retry_days), row.final_action, row.updated_at)


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
    if final_action is not None and final_action not in (DunningSettings.UNPAID, DunningSettings.CANCELED):
        raise InvalidRequestError("final_action must be 'unpaid' or 'canceled'.", param="final_action")
    with transaction.atomic():
        row, _created = DunningSettings.objects.select_for_update().get_or_create(
            tenant_id=tenant_id, livemode=livemode
        )
        if days is not None:
            row.retry_days = list(days)
        if final_action is not None:
            row.final_action = final_action
        row.save()
    return get_settings(tenant_id=tenant_id, livemode=livemode)


# --- the retry pass ---------------------------------------------------------------------------------------------------


def process_due(
    *,
    livemode: bool,
    as_of: datetime | None = None,
    test_clock_id: str | None = None,
    fence: Fence = NO_FENCE,
    limit: int | None = None,
    on_page: Callable[[], object] | None = None,
) -> int:
    """Act on every dunning run due in one mode: retry it, or apply its end state. Returns how many.

    Wall-clock runs (``test_clock_id`` None) are due by ``as_of`` (None: the DB's now()) and
    runs on a test clock are never touched; with ``test_clock_id``, only that clock's runs,
    due by ``as_of`` (None: the clock's ``frozen_time``). At most ``limit`` runs (None: all);
    ``on_page()`` runs after each page of up to 50 runs.
    Every write is fenced by ``fence``; raises :class:`~hardcount.fencing.LeaseLost` at a safe
    point once the fence is no longer alive. See :func:`dunning.retries.process_due`.
    """
    # Loaded here, not at import: dunning.retries imports billing's services, which import this module.
    from dunning import retries

    return retries.process_due(
        livemode=livemode, as_of=as_of, test_clock_id=test_clock_id, fence=fence, limit=limit, on_page=on_page
    )


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
    "HARD_DECLINE_CODES",
    "MAX_RETRIES",
    "MAX_RETRY_DAY",
    "Policy",
    "end_run_locked",
    "get_settings",
    "is_hard_decline",
    "last_retry_at",
    "next_due_at",
    "next_payment_attempt",
    "next_retry_at",
    "payment_method_changed",
    "process_due",
    "retry_at",
    "start_dunning",
    "stop_dunning",
    "update_settings",
    "validate_retry_days",
]
