"""The dunning pass: claim due runs, then retry each one's invoice or apply its end state.

A page of due runs is claimed in one fenced transaction (``SELECT … FOR UPDATE SKIP LOCKED``,
:data:`dunning.queries.CLAIM_DUE_RUNS`) that also decides and records what each run is due
for, before any charge:

- a **retry**: the scheduled retry whose time has come is counted (``retries_done``) and marked
  started (``attempt_started_at``); a retry asked for by a payment-method change, or one that
  never reached a definite outcome (a crash, a gateway error), is taken up again without using
  another scheduled retry;
- the **end state**: the last retry was declined, or a run waiting for a new payment method
  reached the last retry's time.

The claim also pushes ``next_attempt_at`` past the claim window (:func:`claim_window`), so no
other loop — a second replica, a deposed leader, a clock's advance — can claim the run again
while this one charges it: a run is confirmed at most once per claim. If the loop dies, the run
falls due again when the window ends, and the retry resumes: an attempt whose outcome is
unknown is re-sent under its own idempotency key (SPEC §4), never charged anew.

Then, outside that transaction, each run goes to billing
(:mod:`billing.services.collection`), whose transactions lock subscription → invoice and run
dunning's hooks last, so the run changes together with the invoice: a decline moves the
schedule (:func:`dunning.services.start_dunning`), a payment ends the run
(:func:`dunning.services.stop_dunning`), a gateway failure retries the run an hour later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction

from billing.services import collection
from billing.services.payments import billing_time, in_flight_window
from dunning import queries
from dunning.models import DunningRun
from dunning.schedule import retry_at
from dunning.services import emit_run_event, end_run_locked, get_settings
from hardcount.fencing import NO_FENCE, Fence, LeaseLost
from hardcount.times import database_now

log = logging.getLogger("dunning.retries")

PAGE_SIZE = 50
# A retry whose call failed (gateway down, 5xx, timeout) is tried again this much later,
# without using up a scheduled retry (docs/decisions/0072).
ERROR_RETRY_DELAY = timedelta(hours=1)

RETRY, SETTLE, NOTHING = "retry", "settle", "nothing"


def claim_window() -> timedelta:
    """How long a claimed run stays out of every other claim: twice the in-flight window
    (:func:`billing.services.payments.in_flight_window`), longer than any one retry's calls."""
    return 2 * in_flight_window()


@dataclass
class Hooks:
    """Test seam: ``after_claim(run_ids)`` once each page's claim has committed (also for an
    empty page). None in production."""

    after_claim: Callable[[list[str]], None] | None = None


hooks = Hooks()


@dataclass(frozen=True)
class Claim:
    """One claimed run: its id, its invoice, and what it is due for (``RETRY`` or ``SETTLE``)."""

    run_id: str
    invoice_id: str
    action: str


class _Revived(Exception):
    """The run was revived (a new payment method) between its claim and its end state: roll back."""


def process_due(
    *,
    livemode: bool,
    as_of: datetime | None = None,
    test_clock_id: str | None = None,
    fence: Fence = NO_FENCE,
    limit: int | None = None,
    on_page: Callable[[], object] | None = None,
) -> int:
    """Act on every due dunning run of one mode (see :func:`dunning.services.process_due`); returns how many.

    Page after page until a claim comes back empty; each run is acted on at most once per pass
    (plus its end state, when its last retry is declined in this pass). ``on_page()`` runs after
    each page (the role's liveness stamp, so a long pass never looks stale).
    """
    if test_clock_id is not None and as_of is None:
        as_of = billing_time(test_clock_id)
    handled: list[str] = []
    while limit is None or len(handled) < limit:
        if not fence.alive():
            raise LeaseLost("dunning lease lost: stopped at a safe point")
        size = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit - len(handled))
        claims = _claim_page(
            livemode=livemode, as_of=as_of, test_clock_id=test_clock_id, exclude=handled, size=size, fence=fence
        )
        if hooks.after_claim is not None:
            hooks.after_claim([c.run_id for c in claims])
        if not claims:
            break
        for claim in claims:
            if not fence.alive():
                raise LeaseLost("dunning lease lost: stopped at a safe point")
            handled.append(claim.run_id)
            try:
                _act(claim, as_of=as_of, fence=fence)
            except LeaseLost:
                raise
            except Exception:
                # A deadlock, a lost connection or a bug in one run must not stop the others: the
                # run stays claimed and is taken up again when its claim window ends.
                log.exception(
                    "dunning run %s (%s) failed; resumed after its claim window", claim.run_id, claim.invoice_id
                )
        if on_page is not None:
            on_page()
    return len(handled)


def _act(claim: Claim, *, as_of: datetime | None, fence: Fence) -> None:
    if claim.action == RETRY:
        _retry(claim, as_of=as_of, fence=fence)
        if _settle_due(claim.run_id, as_of=as_of):
            _settle(claim, as_of=as_of, fence=fence)
    elif claim.action == SETTLE:
        _settle(claim, as_of=as_of, fence=fence)


# --- claim ------------------------------------------------------------------------------------------------------------


def _claim_page(
    *, livemode: bool, as_of: datetime | None, test_clock_id: str | None, exclude: list[str], size: int, fence: Fence
) -> list[Claim]:
    with transaction.atomic():
        fence.check()
        now = as_of or database_now()
        ids = queries.claim_due_runs(
            livemode=livemode, as_of=now, test_clock_id=test_clock_id, exclude=exclude, limit=size
        )
        claims = []
        for run in DunningRun.objects.filter(pk__in=ids).order_by("next_attempt_at", "id"):
            action = _decide_locked(run, now)
            run.save()
            if action != NOTHING:
                claims.append(Claim(run.id, run.invoice_id, action))
        return claims


def _decide_locked(run: DunningRun, now: datetime) -> str:
    """What a due run (locked) is due for, recorded on the run; pushes ``next_attempt_at`` past the claim window."""
    n, k = len(run.retry_days), run.retries_done
    if run.attempt_started_at is not None:
        action = RETRY  # resume a retry that has no definite outcome yet
    elif run.retry_requested_at is not None:
        run.retry_requested_at = None
        if k < n and retry_at(run, k + 1) <= now:
            run.retries_done = k + 1
        run.attempt_started_at = now
        action = RETRY
    elif run.waiting_for_payment_method or k >= n:
        action = SETTLE
    elif retry_at(run, k + 1) <= now:
        run.retries_done = k + 1
        run.attempt_started_at = now
        action = RETRY
    else:
        run.next_attempt_at = retry_at(run, k + 1)  # was marked due early: put it back on schedule
        return NOTHING
    run.next_attempt_at = now + claim_window()
    return action


# --- retry ------------------------------------------------------------------------------------------------------------


def _retry(claim: Claim, *, as_of: datetime | None, fence: Fence) -> None:
    def on_record(invoice, attempt, outcome) -> None:
        # Declines and payments were taken by start_dunning / stop_dunning in this transaction.
        if outcome.kind != "failed":
            return
        run = _lock_active(claim.run_id)
        if run is None:
            return
        run.last_error = outcome.error[:2000]
        run.next_attempt_at = _now(as_of) + ERROR_RETRY_DELAY
        run.save()

    result = collection.retry_invoice_payment(
        claim.invoice_id, as_of=as_of, fence=fence, on_record=on_record, on_skip=_on_skip(claim, as_of)
    )
    log.info("dunning retry of %s (%s): %s", claim.invoice_id, claim.run_id, _describe(result))


def _describe(result: collection.CollectionResult) -> str:
    if result.outcome is None:
        return result.kind
    return f"{result.outcome.kind} {result.outcome.error}".strip()


# --- end state --------------------------------------------------------------------------------------------------------


def _settle_due(run_id: str, *, as_of: datetime | None) -> bool:
    """True when the run's end state is due right after its retry (the last retry was declined)."""
    run = DunningRun.objects.filter(pk=run_id, status=DunningRun.ACTIVE).first()
    if run is None or run.attempt_started_at is not None or run.retry_requested_at is not None:
        return False
    if not (run.waiting_for_payment_method or run.retries_done >= len(run.retry_days)):
        return False
    return run.next_attempt_at is not None and run.next_attempt_at <= _now(as_of)


def _settle(claim: Claim, *, as_of: datetime | None, fence: Fence) -> None:
    """Exhaust the run: its invoice ``uncollectible``, the subscription per the tenant's final action."""
    run = DunningRun.objects.get(pk=claim.run_id)
    policy = get_settings(tenant_id=run.tenant_id, livemode=run.livemode)

    def on_marked(invoice, subscription) -> None:
        if subscription is not None:
            # Every run of the subscription, locked in (created_at, id) order — the order a
            # payment-method change locks a customer's runs in — before any is changed.
            siblings = list(
                DunningRun.objects.select_for_update()
                .filter(invoice__subscription_id=subscription.id, status=DunningRun.ACTIVE)
                .order_by("created_at", "id")
            )
        run = _lock_active(claim.run_id)
        if run is None or run.attempt_started_at is not None or run.retry_requested_at is not None:
            raise _Revived
        at = invoice.marked_uncollectible_at
        reason = (
            DunningRun.NO_NEW_PAYMENT_METHOD if run.retries_done < len(run.retry_days) else DunningRun.RETRIES_EXHAUSTED
        )
        end_run_locked(run, DunningRun.EXHAUSTED, reason, at=at)
        emit_run_event(run, "dunning.exhausted", at)
        if subscription is not None and subscription.status == "canceled":
            # Nothing more is collected for a canceled subscription: its other runs end too.
            for other in siblings:
                if other.pk != run.pk:
                    end_run_locked(other, DunningRun.ENDED, DunningRun.SUBSCRIPTION_CANCELED, at=at)

    try:
        result = collection.mark_uncollectible(
            claim.invoice_id,
            final_action=policy.final_action,
            as_of=as_of,
            fence=fence,
            on_marked=on_marked,
            on_skip=_on_skip(claim, as_of),
        )
    except _Revived:
        log.info("dunning run %s got a new payment method before its end state; retrying instead", claim.run_id)
        return
    log.info("dunning end state of %s (%s): %s", claim.invoice_id, claim.run_id, result.kind)


# --- shared -----------------------------------------------------------------------------------------------------------


def _on_skip(claim: Claim, as_of: datetime | None) -> Callable[[str, str], None]:
    """The hook for a run billing found nothing to do for (inside billing's transaction)."""

    def on_skip(kind: str, invoice_status: str) -> None:
        run = _lock_active(claim.run_id)
        if run is None:
            return
        now = _now(as_of)
        if kind == collection.IN_FLIGHT:
            run.next_attempt_at = now + in_flight_window()
            run.save()
        elif kind == collection.SUBSCRIPTION_CANCELED:
            end_run_locked(run, DunningRun.ENDED, DunningRun.SUBSCRIPTION_CANCELED, at=now)
        elif invoice_status == "paid":
            end_run_locked(run, DunningRun.RECOVERED, DunningRun.PAID, at=now)
        elif invoice_status == "void":
            end_run_locked(run, DunningRun.ENDED, DunningRun.VOIDED, at=now)
        elif invoice_status == "uncollectible":
            end_run_locked(run, DunningRun.EXHAUSTED, DunningRun.INVOICE_SETTLED, at=now)
        else:
            end_run_locked(run, DunningRun.ENDED, DunningRun.INVOICE_SETTLED, at=now)

    return on_skip


def _lock_active(run_id: str) -> DunningRun | None:
    return DunningRun.objects.select_for_update().filter(pk=run_id, status=DunningRun.ACTIVE).first()


def _now(as_of: datetime | None) -> datetime:
    return as_of or database_now()


__all__ = ["ERROR_RETRY_DELAY", "PAGE_SIZE", "Claim", "claim_window", "hooks", "process_due"]
