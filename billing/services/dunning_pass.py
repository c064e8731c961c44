"""The dunning pass: claim due runs, then retry each one's invoice or apply its end state.

Billing coordinates and dunning is a leaf (docs/decisions/0120): the pass is billing's, and it
changes runs only through :mod:`dunning.services`. A page of due runs is claimed in one fenced
transaction (``SELECT … FOR UPDATE SKIP LOCKED``, :data:`dunning.queries.CLAIM_DUE_RUNS`) that
also decides and records what each run is due for, before any charge
(:func:`dunning.services.claim_locked`):

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
unknown is re-sent under its own idempotency key (docs/reference/billing.md), never charged anew.

Then, outside that transaction, each run's invoice goes through :mod:`billing.services.collection`,
whose transactions lock subscription → invoice and call dunning's state functions last, so the
run changes together with the invoice: a decline moves the schedule
(:func:`dunning.services.start_dunning`), a payment ends the run
(:func:`dunning.services.stop_dunning`), a gateway failure retries the run an hour later
(:func:`dunning.services.retry_failed_locked`), exhaustion ends it
(:func:`dunning.services.exhaust_locked`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction

from billing.services import collection
from billing.services.payments import billing_time, in_flight_window
from dunning import services as dunning_services
from dunning.services import ClaimAction
from hardcount.fencing import NO_FENCE, Fence, LeaseLost
from hardcount.times import database_now

log = logging.getLogger("billing.dunning_pass")

PAGE_SIZE = 50


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
    action: ClaimAction


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
    due by ``as_of`` (None: the clock's ``frozen_time``). At most ``limit`` runs (None: all).
    Page after page of up to :data:`PAGE_SIZE` until a claim comes back empty; each run is acted
    on at most once per pass (plus its end state, when its last retry is declined in this
    pass). ``on_page()`` runs after each page (the role's liveness stamp, so a long pass never
    looks stale). Every write is fenced by ``fence``; raises
    :class:`~hardcount.fencing.LeaseLost` at a safe point once the fence is no longer alive.
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
    if claim.action == ClaimAction.RETRY:
        _retry(claim, as_of=as_of, fence=fence)
        if dunning_services.end_state_due(claim.run_id, as_of=as_of):
            _settle(claim, as_of=as_of, fence=fence)
    elif claim.action == ClaimAction.SETTLE:
        _settle(claim, as_of=as_of, fence=fence)


# --- claim ------------------------------------------------------------------------------------------------------------


def _claim_page(
    *, livemode: bool, as_of: datetime | None, test_clock_id: str | None, exclude: list[str], size: int, fence: Fence
) -> list[Claim]:
    with transaction.atomic():
        fence.check()
        now = as_of or database_now()
        runs = dunning_services.due_runs_locked(
            livemode=livemode, as_of=now, test_clock_id=test_clock_id, exclude=exclude, limit=size
        )
        claims = []
        for run in runs:
            action = _decide_locked(run, now)
            if action != ClaimAction.NOTHING:
                claims.append(Claim(run.id, run.invoice_id, action))
        return claims


def _decide_locked(run, now: datetime) -> ClaimAction:
    """What a due run (locked) is due for, recorded on the run; a claimed run is held for :func:`claim_window`."""
    return dunning_services.claim_locked(run, now=now, hold_until=now + claim_window())


# --- retry and end state ----------------------------------------------------------------------------------------------


def _retry(claim: Claim, *, as_of: datetime | None, fence: Fence) -> None:
    result = collection.retry_invoice_payment(claim.invoice_id, run_id=claim.run_id, as_of=as_of, fence=fence)
    log.info("dunning retry of %s (%s): %s", claim.invoice_id, claim.run_id, _describe(result))


def _describe(result: collection.CollectionResult) -> str:
    if result.outcome is None:
        return result.kind
    return f"{result.outcome.kind} {result.outcome.error}".strip()


def _settle(claim: Claim, *, as_of: datetime | None, fence: Fence) -> None:
    """Exhaust the run: its invoice ``uncollectible``, the subscription per the tenant's final action."""
    final_action = dunning_services.final_action_of(claim.run_id)
    try:
        result = collection.mark_uncollectible(
            claim.invoice_id, run_id=claim.run_id, final_action=final_action, as_of=as_of, fence=fence
        )
    except dunning_services.RunRevived:
        log.info("dunning run %s got a new payment method before its end state; retrying instead", claim.run_id)
        return
    log.info("dunning end state of %s (%s): %s", claim.invoice_id, claim.run_id, result.kind)


__all__ = ["PAGE_SIZE", "Claim", "claim_window", "hooks", "process_due"]
