"""The billing drain (docs/reference/billing.md#the-drain), the reconciler, and an operator's retry-billing.

``drain_due`` bills page after page of due subscriptions until a page comes back empty;
``page_size`` is a page size, never a cap. Each page is claimed with ``FOR UPDATE SKIP
LOCKED`` (:func:`billing.queries.claim_due_page`); its plain closes share their database steps
(:mod:`billing.services.page`) and its other closes run on up to ``concurrency`` threads, each with
its own database connection (``HARDCOUNT_BILLING_CONCURRENCY``, default 8). The page's charges go
to sender threads that hold no connection (:mod:`billing.services.charge_pool`, bounded per gateway
account), and the next page is claimed and prepared while they are out (decisions 0186, 0188). An
attempted subscription still due after its page (a failure not saved, one skipped, one several
periods behind) is marked with the run (:func:`billing.queries.mark_still_due`) and each claim
starts past the run's last one, so each is attempted at most once per run, a failing one never
leads every page, and nothing grows with the run (decision 0187). There is no circuit breaker: a
run never stops after N failures; a database error in the drain's own statements ends it. Why
parallel closes keep exactly-once: docs/decisions/0010-drain-claims-and-parallel-closes.md.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.models import Count, F, Q

from billing import gateway as gw
from billing.events import billing_run_event
from billing.lock_objects import customer_locked, subscription_and_invoice_locked, subscription_qs_select_for_update
from billing.models import BillingAttempt, BillingRun, Invoice, PaymentAttempt, Subscription, TestClock
from billing.queries import claim_due_page, mark_still_due
from billing.services import pausing
from billing.services.charge_pool import ChargePool, Pending
from billing.services.close import close_subscription_period, finalize_or_pend_locked, record_charge
from billing.services.close import hooks as close_hooks
from billing.services.credit_notes import reconcile_refunds
from billing.services.page import PreparedClose, prepare_page, record_page
from billing.services.payments import (
    GatewayCall,
    Outcome,
    OutcomeKind,
    PaymentInFlight,
    act_on_paid_locked,
    attempt_time,
    billing_time,
    bind_send,
    charging,
    in_flight_window,
    is_current_period,
    is_open,
    needs_no_charge,
    pending_poll_interval,
    record_outcome,
    reserve_attempt_locked,
    send,
    settle_without_charge_locked,
)
from billing.shards import Shard
from hardcount.errors import NotFoundError, StateConflictError
from hardcount.fencing import NO_FENCE, Fence, LeaseLost
from hardcount.times import database_now

log = logging.getLogger("billing.drain")

TRIGGERS = tuple(BillingRun.Trigger.values)


class BillingRetryNotAllowed(StateConflictError):
    """409: retry-billing needs a subscription that is waiting on the retry ladder or parked."""

    default_code = "subscription_not_failing"


class _Abandoned(Exception):
    """A close not started because the fence said stop (a safe point)."""


def drain_due(
    *,
    livemode: bool,
    trigger: str,
    tenant_id: str | None = None,
    test_clock_id: str | None = None,
    as_of: datetime | None = None,
    page_size: int | None = None,
    concurrency: int | None = None,
    fence: Fence = NO_FENCE,
    on_page: Callable[[BillingRun], None] | None = None,
    run: BillingRun | None = None,
    shard: Shard | None = None,
) -> BillingRun:
    """Bill every due subscription of one mode (optionally one tenant, or one test clock) and return the run.

    ``as_of``: the billing time of a test clock's drain (None: the DB's ``now()``, page by
    page); ``test_clock_id`` drains only that clock's subscriptions (as of its ``frozen_time``
    unless ``as_of`` is given), and wall-clock drains never touch clock subscriptions.
    ``fence.alive()`` is consulted before each page and each subscription (safe points), and
    ``fence.check()`` runs inside every write transaction. ``on_page(run)`` is called after each
    page with the counts so far (the liveness stamp). ``run``: a ``running`` run to carry on
    instead of starting one (a manual run in the background, :mod:`billing.services.manual_runs`):
    it takes ``fence``'s token, its counts are recounted from its billing attempts, and the
    subscriptions it attempted already are not attempted again; one that is no longer
    ``running`` is returned as it is. Returns the :class:`BillingRun`
    (``completed``, or ``failed`` with ``error`` when a database error ended it). Raises
    :class:`LeaseLost` when the lease is lost: the run then stops writing at once and stays as
    it was last written. ``shard``: only the subscriptions of its tenants (a scheduler drain of one
    billing shard, :mod:`billing.shards`; its run records the shard's lease in ``lease_role``).
    """
    if trigger not in TRIGGERS:
        raise ValueError(f"trigger must be one of {TRIGGERS}")
    page_size = page_size or settings.HARDCOUNT_BILLING_PAGE_SIZE
    concurrency = max(1, concurrency or settings.HARDCOUNT_BILLING_CONCURRENCY)
    if test_clock_id and as_of is None:
        as_of = TestClock.objects.only("frozen_time").get(pk=test_clock_id).frozen_time

    if run is None:
        run = _start_run(
            livemode=livemode,
            trigger=trigger,
            tenant_id=tenant_id,
            test_clock_id=test_clock_id,
            as_of=as_of,
            fence=fence,
            shard=shard,
        )
    elif not _carry_on(run, fence=fence):
        return BillingRun.objects.get(pk=run.pk)

    # Paused periods are invoiced without a charge, and pauses that have run out end, before any claim
    # (docs/reference/billing.md#pausing-collection).
    try:
        pausing.collect_paused(
            livemode=livemode, tenant_id=tenant_id, test_clock_id=test_clock_id, as_of=as_of, fence=fence, shard=shard
        )
    except DatabaseError as exc:
        log.error("billing drain %s ended by a database error: %s", run.id, exc)
        _finish_run(run, BillingRun.Status.FAILED, fence, error=f"database: {exc}")
        return run

    def close(item: tuple[str, int]) -> Outcome:
        if not fence.alive():
            raise _Abandoned()
        subscription_id, periods_billed = item
        return close_subscription_period(
            subscription_id,
            periods_billed=periods_billed,
            run=run,
            as_of=as_of,
            test_clock_id=test_clock_id,
            fence=fence,
        )

    pool = _ClosePool(concurrency)
    # A test clock's advance bills a clock's whole history against a test-mode gateway (localstripe in
    # development and tests): as many charges at once as its close threads, as before (docs/decisions/0186).
    charges = ChargePool(concurrency if test_clock_id else settings.HARDCOUNT_BILLING_CHARGES_IN_FLIGHT)
    # Pages in flight (HARDCOUNT_BILLING_PAGES_IN_FLIGHT): the next page is claimed and prepared while
    # this one's charges are out. A test clock's drain holds each page's charge locks on this session
    # until its outcomes are recorded, so its pages go one at a time (docs/decisions/0188).
    depth = 1 if test_clock_id else max(1, settings.HARDCOUNT_BILLING_PAGES_IN_FLIGHT)
    in_flight: deque[_Page] = deque()
    # Where the run's claims have got to (the last claimed (next_billing_at, id)); a lap that claimed
    # anything is followed by another from the start, for rows that were locked or not yet due.
    cursor: tuple[datetime, str] | None = None
    lap_claimed = exhausted = stopping = lap_ends = False
    try:
        while not (exhausted and not in_flight):
            # A page's charge locks (a test clock's) are freed once its outcomes are recorded.
            with charging() if depth == 1 else nullcontext():
                if not exhausted and not fence.alive():
                    # A safe point: no more claims; the pages in flight finish (their sends not yet
                    # started are abandoned) before the drain stops.
                    exhausted = stopping = True
                if not exhausted and not lap_ends:
                    try:
                        with transaction.atomic():
                            fence.check()
                            claimed = claim_due_page(
                                livemode=livemode,
                                tenant_id=tenant_id,
                                test_clock_id=test_clock_id,
                                as_of=as_of,
                                page_size=page_size,
                                run_id=run.id,
                                after=cursor,
                                shard=shard,
                                # Rows of the pages in flight are not marked yet, and one whose close has
                                # already committed may be due again past the cursor: pass over them too,
                                # so no run attempts a subscription twice (at most pages-in-flight pages).
                                exclude=[item[0] for flying in in_flight for item in flying.items],
                            )
                    except DatabaseError as exc:
                        log.error("billing drain %s ended by a database error: %s", run.id, exc)
                        _finish_run(run, BillingRun.Status.FAILED, fence, error=f"database: {exc}")
                        return run
                    if claimed:
                        cursor, lap_claimed = (claimed[-1][2], claimed[-1][0]), True
                        run.pages += 1
                        items = [(row[0], row[1]) for row in claimed]
                        tasks = partial(
                            _start_page_tasks,
                            items,
                            pool,
                            charges,
                            close,
                            run=run,
                            as_of=as_of,
                            test_clock_id=test_clock_id,
                            fence=fence,
                        )
                        in_flight.append(_start_page(items, pool, tasks, background=depth > 1))
                    elif cursor is not None and lap_claimed:
                        # The next lap starts once the pages in flight are recorded and their still-due rows marked.
                        cursor, lap_claimed, lap_ends = None, False, True
                    else:
                        exhausted = True
                if in_flight and (exhausted or lap_ends or len(in_flight) >= depth):
                    page = in_flight.popleft()
                    results = _finish_page(page, pool, run=run, as_of=as_of, test_clock_id=test_clock_id, fence=fence)
                    _count_page(results, run)
                    try:
                        with transaction.atomic():
                            fence.check()
                            mark_still_due(run.id, [item[0] for item in page.items], as_of=as_of)
                    except DatabaseError as exc:
                        log.error("billing drain %s ended by a database error: %s", run.id, exc)
                        _finish_run(run, BillingRun.Status.FAILED, fence, error=f"database: {exc}")
                        return run
                    _save_counts(run, fence)
                    if on_page is not None:
                        on_page(run)
                if not in_flight:
                    lap_ends = False
        if stopping:
            raise LeaseLost("billing lease lost: drain stopped at a safe point")
        _finish_run(run, BillingRun.Status.COMPLETED, fence)
    except LeaseLost:
        if trigger == BillingRun.Trigger.SCHEDULER:
            _end_stopped_run(run, fence)
        raise
    finally:
        charges.shutdown()
        pool.shutdown()
    return run


def _count_page(results: list, run: BillingRun) -> None:
    """Count a finished page's outcomes on ``run``; raise :class:`LeaseLost` after a lost lease, or the
    exception a close raised (a bug, a test's simulated kill)."""
    lease_lost = None
    for result in results:
        if isinstance(result, _Abandoned | LeaseLost):
            lease_lost = result
            continue
        if isinstance(result, BaseException):
            raise result
        run.count(result.kind)
    if lease_lost is not None:
        raise LeaseLost("billing lease lost during a page") from lease_lost


def _start_run(
    *,
    livemode: bool,
    trigger: str,
    tenant_id: str | None,
    test_clock_id: str | None,
    as_of: datetime | None,
    fence: Fence,
    shard: Shard | None = None,
) -> BillingRun:
    # A sharded run names its shard's lease; a single shard's is blank, as before shards.
    sharded = shard is not None and shard.count > 1
    role = shard.lease_role if sharded else ""
    # Only the lease holder runs scheduler drains: an older one still "running" died. A shard supersedes its own,
    # and shard 0 also the single leader's (left by a switch to shards); a single shard every one, as before.
    superseded = Q()
    if sharded:
        superseded = Q(lease_role=role) | Q(lease_role="") if shard.runs_singletons else Q(lease_role=role)
    with transaction.atomic():
        fence.check()
        now = database_now()
        if trigger == BillingRun.Trigger.SCHEDULER:
            dead = BillingRun.objects.select_for_update().filter(
                superseded, trigger=BillingRun.Trigger.SCHEDULER, livemode=livemode, status=BillingRun.Status.RUNNING
            )
            # A dead leader saved its counts only as each page ended: its record is completed from its attempts.
            for dead_run in dead:
                BillingRun.objects.filter(pk=dead_run.pk).update(
                    status=BillingRun.Status.ABANDONED,
                    finished_at=now,
                    error="superseded: its process stopped",
                    **_counts_of(dead_run),
                )
        return BillingRun.objects.create(
            trigger=trigger,
            tenant_id=tenant_id,
            livemode=livemode,
            test_clock_id=test_clock_id,
            as_of=as_of or now,
            started_at=now,
            lease_token=fence.token,
            lease_role=role,
        )


def _counts_of(run: BillingRun) -> dict[str, int]:
    """``attempted``, ``billed`` and ``failed`` of ``run``, counted from its billing attempts."""
    return run.attempts.aggregate(
        attempted=Count("id"),
        billed=Count("id", filter=Q(outcome__in=BillingAttempt.COUNTED_AS_BILLED)),
        failed=Count("id", filter=Q(outcome=BillingAttempt.Outcome.FAILED)),
    )


def _carry_on(run: BillingRun, *, fence: Fence) -> bool:
    """Take over a ``running`` run under ``fence`` (its token and its counts so far, from its billing attempts).

    False when the run is no longer ``running``. ``run`` is updated in memory. The subscriptions it
    attempted that were still due carry its mark (``claimed_by_run``), so its claims pass over them.
    """
    with transaction.atomic():
        fence.check()
        current = BillingRun.objects.select_for_update().filter(pk=run.pk, status=BillingRun.Status.RUNNING).first()
        if current is None:
            return False
        counts = _counts_of(current)
        run.attempted, run.billed, run.failed = counts["attempted"], counts["billed"], counts["failed"]
        run.pages, run.lease_token = current.pages, fence.token
        BillingRun.objects.filter(pk=run.pk).update(
            attempted=run.attempted, billed=run.billed, failed=run.failed, lease_token=run.lease_token
        )
        return True


def _end_stopped_run(run: BillingRun, fence: Fence) -> None:
    """End a scheduler ``run`` that stopped at a safe point ``abandoned``, if its lease is still ours.

    A graceful shutdown stops the drain while the lease is held and then releases it; a run left
    ``running`` would sit under a released lease until the next leader supersedes it. The write is
    fenced: after a lease truly lost (the fence refuses) nothing is written and the successor
    supersedes the run as before. Scheduler runs only: a manual run that stops is carried on by the
    next holder of its own lease (:mod:`billing.services.manual_runs`).
    """
    try:
        with transaction.atomic():
            fence.check()
            BillingRun.objects.filter(pk=run.pk, status=BillingRun.Status.RUNNING).update(
                status=BillingRun.Status.ABANDONED,
                finished_at=database_now(),
                error="stopped at a safe point: its process was shutting down",
                pages=run.pages,
                attempted=run.attempted,
                billed=run.billed,
                failed=run.failed,
            )
    except (LeaseLost, DatabaseError):
        log.info("billing run %s stays running: its lease could not be confirmed at the stop", run.id)


def _save_counts(run: BillingRun, fence: Fence) -> None:
    with transaction.atomic():
        fence.check()
        BillingRun.objects.filter(pk=run.pk).update(
            pages=run.pages, attempted=run.attempted, billed=run.billed, failed=run.failed
        )


def _finish_run(run: BillingRun, status: str, fence: Fence, *, error: str = "") -> None:
    run.status = status
    run.error = error
    try:
        with transaction.atomic():
            fence.check()
            run.finished_at = database_now()
            run.save()
            if run.tenant_id:
                # A test clock's run is one of the clock's objects: its event is dated by the clock.
                created_at = run.as_of if run.test_clock_id else run.finished_at
                billing_run_event(run, "billing_run.completed", created_at=created_at)
    except LeaseLost:
        raise
    except DatabaseError:
        if status != BillingRun.Status.FAILED:
            raise
        log.error("could not record the end of billing run %s", run.id)


@dataclass
class _Page:
    """A page under way: its claimed ``items``; each task is ``("send", PreparedClose, Pending)`` or
    ``("close", item, Pending)``. Started in the background, ``tasks`` is None and ``started`` the
    :class:`Pending` of step 1, whose result is the tasks (or the exception step 1's thread met)."""

    items: list[tuple[str, int]]
    tasks: list[tuple[str, object, Pending]] | None
    started: Pending | None = None


def _start_page(
    page: list[tuple[str, int]],
    pool: _ClosePool,
    tasks: Callable[[], list[tuple[str, object, Pending]]],
    *,
    background: bool,
) -> _Page:
    """Start closing every claimed ``(subscription id, periods_billed)`` of a page; :func:`_finish_page` ends it.

    ``tasks`` is the page's :func:`_start_page_tasks`, bound to its arguments: step 1 and the start of the page's
    sends and per-close closes. ``background``: it runs on one of ``pool``'s threads, so the drain's thread
    records the page before while this one is prepared (decision 0228); otherwise here and now (a test clock's
    drain, whose charge locks live on this thread's session).
    """
    if background:
        return _Page(page, None, pool.submit(_call, tasks))
    return _Page(page, tasks())


def _call(fn: Callable[[], object]) -> object:
    return fn()


def _start_page_tasks(
    page: list[tuple[str, int]],
    pool: _ClosePool,
    charges: ChargePool,
    close: Callable[[tuple[str, int]], Outcome],
    *,
    run: BillingRun,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
) -> list[tuple[str, object, Pending]]:
    """Step 1 of a page and the start of its sends and per-close closes; the page's tasks (:func:`_start_page`).

    Plain closes share their step 1 (:mod:`billing.services.page`, unless ``HARDCOUNT_BILLING_PAGE_CLOSE`` is
    off), and their charges go to ``charges`` (bound to their accounts on step 1's connection first); every other
    close runs on ``pool`` with the full rules. A database error (or a bug) in step 1 hands its closes to the
    per-close path instead.
    """
    prepared, settled, others = [], {}, page
    if settings.HARDCOUNT_BILLING_PAGE_CLOSE:
        try:
            prepared, settled, others = prepare_page(
                page, run=run, as_of=as_of, test_clock_id=test_clock_id, fence=fence
            )
        except LeaseLost:
            raise
        except Exception:
            log.exception("page close of billing run %s: step 1 failed; closing its page one by one", run.id)
    for p in prepared:
        if close_hooks.after_prepare:
            close_hooks.after_prepare(p.plan)

    def charge(call: GatewayCall) -> gw.ChargeResult:
        if not fence.alive():
            raise _Abandoned()
        result = call.call()
        if close_hooks.after_charge:
            close_hooks.after_charge(call.plan, result)
        return result

    tasks: list[tuple[str, object, Pending]] = []
    for p in prepared:
        call = bind_send(p.plan)
        pending = charges.submit(
            lambda call=call: charge(call), account=call.account, livemode=call.livemode, requests=call.requests
        )
        tasks.append(("send", p, pending))
    for item in page:
        if item[0] in settled:  # closed in step 1: nothing to pay
            done = Pending()
            done.set_result(settled[item[0]])
            tasks.append(("close", item, done))
    tasks += [("close", item, pool.submit(close, item)) for item in others]
    return tasks


def _finish_page(
    page: _Page,
    pool: _ClosePool,
    *,
    run: BillingRun,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
) -> list:
    """Wait for a started page and record it; its Outcomes, or the exceptions raised.

    The successful charges of its plain closes share one step 3 (:func:`record_page`); every other
    charge is recorded one by one on ``pool`` with the full rules. A database error (or a bug) in
    step 3 hands its charges to the per-close record instead. Lost lease: nothing more is written
    once a send saw it (the results say so).
    """
    tasks = page.tasks
    if page.started is not None:
        tasks = page.started.result()
        if isinstance(tasks, BaseException):  # a lost lease, or a bug: the drain's thread decides
            return [tasks]
    results, charged = [], []
    for kind, value, pending in tasks:
        result = pending.result()
        if kind == "send" and not isinstance(result, BaseException):
            charged.append((value, result))
        else:
            results.append(result)
    if not charged or any(isinstance(r, BaseException) for r in results):
        # A lost lease writes nothing more; another exception ends the drain. The charges sent stay
        # reserved attempts, re-sent under their keys by the next close or the reconciler.
        return results
    recorded, leftover = {}, charged
    try:
        recorded, leftover = record_page(charged, run=run, as_of=as_of, test_clock_id=test_clock_id, fence=fence)
    except LeaseLost:
        raise
    except Exception:
        log.exception("page close of billing run %s: step 3 failed; recording its charges one by one", run.id)

    def record(item: tuple[PreparedClose, object]) -> Outcome:
        prepared_close, result = item
        return record_charge(
            prepared_close.plan,
            result,
            periods_billed=prepared_close.item[1],
            run=run,
            as_of=as_of,
            test_clock_id=test_clock_id,
            fence=fence,
        )

    return results + list(recorded.values()) + pool.map(record, leftover)


class _ClosePool:
    """Up to ``size`` worker threads, each with its own database connection, closed at shutdown.

    ``submit(fn, item)`` queues one call and returns its :class:`Pending`; ``map(fn, items)`` runs
    them all and returns results in item order; an exception (including a ``BaseException`` such as
    a test's simulated kill) is returned in place of the result. With ``size`` 1 every call runs on
    the caller's thread and connection, at once.
    """

    def __init__(self, size: int):
        self.size = size
        self._tasks: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._starting = threading.Lock()

    def _worker(self) -> None:
        try:
            while True:
                task = self._tasks.get()
                if task is None:
                    return
                fn, item, pending = task
                try:
                    pending.set_result(fn(item))
                except BaseException as exc:  # handed to the drain's thread, which decides
                    pending.set_result(exc)
        finally:
            connections.close_all()

    def submit(self, fn: Callable, item: object) -> Pending:
        """Run ``fn(item)`` on a worker (with ``size`` 1, here and now); its :class:`Pending` result."""
        if self.size == 1:
            pending = Pending()
            try:
                pending.set_result(fn(item))
            except (_Abandoned, LeaseLost) as exc:
                pending.set_result(exc)
            return pending
        self._start_threads(self.size)
        pending = Pending()
        self._tasks.put((fn, item, pending))
        return pending

    def _start_threads(self, wanted: int) -> None:
        with self._starting:  # a page's step 1 submits its closes from a worker too
            while len(self._threads) < min(self.size, wanted):
                thread = threading.Thread(target=self._worker, name=f"billing-close-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def map(self, fn: Callable, items: list) -> list:
        if self.size == 1:
            out = []
            for item in items:
                try:
                    out.append(fn(item))
                except (_Abandoned, LeaseLost) as exc:
                    out.append(exc)
            return out
        self._start_threads(len(items))
        pendings = []
        for item in items:
            pendings.append(Pending())
            self._tasks.put((fn, item, pendings[-1]))
        return [pending.result() for pending in pendings]

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()


# --- retry-billing --------------------------------------------------------------------------------------------------


def retry_billing(subscription_id: str, *, tenant_id: str, livemode: bool) -> BillingAttempt:
    """An operator's retry of a waiting or parked subscription: clear its failure state and attempt once, now.

    Runs as a one-subscription ``manual`` billing run. Success leaves the subscription with
    ``billing_failure_count`` 0 and its next period scheduled; a failure starts the ladder
    afresh (failure 1, 15 minutes). Raises :class:`NotFoundError` for an unknown subscription
    (or another tenant's or mode's) and :class:`BillingRetryNotAllowed` (409) unless the
    subscription is waiting or parked. Returns the run's :class:`BillingAttempt`.
    """
    with transaction.atomic():
        sub = (
            subscription_qs_select_for_update()
            .filter(tenant_id=tenant_id, livemode=livemode, pk=subscription_id)
            .first()
        )
        if sub is None:
            raise NotFoundError(f"No such subscription: '{subscription_id}'.", param="id")
        if sub.billing_state not in ("waiting", "parked") or sub.status not in Subscription.BILLABLE_STATUSES:
            raise BillingRetryNotAllowed(
                f"Subscription {sub.id} is neither waiting on the retry ladder nor parked; nothing to retry."
            )
        now = database_now()
        run = BillingRun.objects.create(
            trigger=BillingRun.Trigger.MANUAL, tenant_id=tenant_id, livemode=livemode, as_of=now, started_at=now
        )
        periods_billed = sub.periods_billed
    outcome = close_subscription_period(
        sub.id, periods_billed=periods_billed, run=run, test_clock_id=sub.test_clock_id, manual_retry=True
    )
    run.pages = 1
    run.count(outcome.kind)
    _finish_run(run, BillingRun.Status.COMPLETED, NO_FENCE)
    return run.attempts.get(subscription_id=sub.id)


# --- reconcile ------------------------------------------------------------------------------------------------------


def reconcile(*, livemode: bool, fence: Fence = NO_FENCE, limit: int = 500) -> dict:
    """The billing tick's reconciler for one mode: tax-pending invoices, then payments left unresolved.

    1. Draft invoices with ``tax_status=pending``: finalise and charge them once the tax
       provider answers (the pass stops at the first one it still cannot tax).
    2. Open invoices whose latest attempt is ``unknown`` (a timeout, a reset, a process that
       died between charge and record, a PaymentIntent processing) and older than the in-flight
       window (on a test clock: whose charge lock nobody holds): re-send it under the same key, or
       look its PaymentIntent up when it is processing or its key may have expired
       (:func:`billing.services.payments.must_look_up`), and record what the gateway says. A
       PaymentIntent that finishes later (``processing``, ``requires_action``) is looked up at
       most once per :func:`~billing.services.payments.pending_poll_interval` (its own inbound
       events are the first word; this is the fallback).
       Transient errors on invoices whose period has already advanced are resolved the same way;
       those of a subscription still on that period are left to the retry ladder.
    3. Open ``subscription_update`` invoices (a change's, ``always_invoice``) with no attempt, older than the
       in-flight window (on a test clock: at once, the reservation's charge lock deciding): the change's
       request died between its commit and its charge; charged as ``pay_invoice`` would (not while the
       subscription's collection is paused).

    4. Refunds left ``unknown`` (their sender died between the credit note's commit and the gateway's
       answer) or ``pending``: :func:`billing.services.credit_notes.reconcile_refunds`.

    At most ``limit`` invoices per pass. Returns counts: ``tax_finalized``, ``tax_pending``,
    ``payments_resolved``, ``payments_unresolved``, ``refunds_resolved``, ``refunds_unresolved``. Raises
    :class:`LeaseLost` like the drain.
    """
    counts = {"tax_finalized": 0, "tax_pending": 0, "payments_resolved": 0, "payments_unresolved": 0}
    pending_ids = list(
        Invoice.objects.filter(livemode=livemode, status=Invoice.DRAFT, tax_status=Invoice.TAX_PENDING)
        .order_by("created_at")
        .values_list("id", flat=True)[:limit]
    )
    for index, invoice_id in enumerate(pending_ids):
        if not fence.alive():
            raise LeaseLost("billing lease lost: reconcile stopped at a safe point")
        result = _reconcile_tax(invoice_id, fence)
        if result == "pending":
            counts["tax_pending"] = len(pending_ids) - index
            break
        if result == "finalized":
            counts["tax_finalized"] += 1

    with transaction.atomic():
        now = database_now()
        cutoff = now - in_flight_window()
    # A PaymentIntent that finishes later tells us by its own event: polled at a modest cadence only.
    polled_recently = (
        Q(payment_intent_status__in=gw.PENDING_STATUSES)
        & Q(started_at__gte=now - pending_poll_interval())
        & Q(invoice__customer__test_clock__isnull=True)
    )
    transient_error = Q(outcome=PaymentAttempt.ERROR) & (
        Q(http_status__isnull=True) | Q(http_status__in=[409, 429]) | Q(http_status__gte=500)
    )
    ladder_owned = Q(outcome=PaymentAttempt.ERROR, invoice__period_start=F("invoice__subscription__next_billing_at"))
    # A test clock's attempt is dated by the clock, not the wall clock: whether it is still in
    # flight is its charge lock's to say (the reservation below skips one that is).
    sent_before_cutoff = Q(started_at__lt=cutoff) | Q(invoice__customer__test_clock__isnull=False)
    candidates = (
        PaymentAttempt.objects.filter(
            sent_before_cutoff,
            Q(outcome=PaymentAttempt.UNKNOWN) | transient_error,
            livemode=livemode,
            invoice__status=Invoice.OPEN,
            settled_without_charge=False,
        )
        .exclude(idempotency_key="")
        .exclude(ladder_owned)
        .exclude(polled_recently)
        .select_related("invoice")
        .order_by("started_at")[:limit]
    )
    for attempt in candidates:
        if not fence.alive():
            raise LeaseLost("billing lease lost: reconcile stopped at a safe point")
        resolved = _reconcile_payment(attempt, fence)
        if resolved is None:
            continue
        counts["payments_resolved" if resolved else "payments_unresolved"] += 1

    # A change's own invoice (always_invoice) is charged by the change's request right after it commits; a
    # request that died in between left it open with no attempt at all, which nothing above would charge.
    uncharged = (
        Invoice.objects.filter(
            Q(created_at__lt=cutoff) | Q(customer__test_clock__isnull=False),
            livemode=livemode,
            status=Invoice.OPEN,
            billing_reason=Invoice.UPDATE,
            payment_attempts__isnull=True,
        )
        .order_by("created_at")
        .values_list("id", flat=True)[:limit]
    )
    for invoice_id in uncharged:
        if not fence.alive():
            raise LeaseLost("billing lease lost: reconcile stopped at a safe point")
        resolved = _reconcile_uncharged(invoice_id, fence)
        if resolved is None:
            continue
        counts["payments_resolved" if resolved else "payments_unresolved"] += 1

    counts.update(reconcile_refunds(livemode=livemode, fence=fence, limit=limit))
    return counts


def _reconcile_tax(invoice_id: str, fence: Fence) -> str:
    """``finalized`` (and charged), ``pending`` (provider still down), ``held`` (its tax carried it past one
    payment: left to an operator, decision 0231) or ``skipped``."""
    with charging():
        return _reconcile_tax_charging(invoice_id, fence)


def _reconcile_tax_charging(invoice_id: str, fence: Fence) -> str:
    with transaction.atomic():
        fence.check()
        invoice = Invoice.objects.filter(pk=invoice_id).only("subscription_id").first()
        if invoice is None:
            return "skipped"
        sub, invoice = subscription_and_invoice_locked(
            invoice_id, subscription_id=invoice.subscription_id, skip_locked=True
        )
        if invoice is None or invoice.status != Invoice.DRAFT or invoice.tax_status != Invoice.TAX_PENDING:
            return "skipped"
        clock_id = sub.test_clock_id if sub else None
        now = billing_time(clock_id)
        if sub is not None and pausing.collection_paused(sub, now=now):
            return "skipped"  # finalised and charged once collection resumes
        if not finalize_or_pend_locked(invoice, now=now):
            return "held" if invoice.hold_reason else "pending"
        customer = customer_locked(invoice.customer_id)
        if needs_no_charge(invoice):
            settle_without_charge_locked(invoice, customer, now=now)
            act_on_paid_locked(sub, invoice, now=now)
            return "finalized"
        plan = reserve_attempt_locked(invoice, customer, now=attempt_time(now, test_clock_id=clock_id, as_of=None))
        if plan.known_result is not None:
            record_outcome(plan, plan.known_result, fence=fence)
            return "finalized"
    record_outcome(plan, send(plan), fence=fence)
    return "finalized"


def _reconcile_uncharged(invoice_id: str, fence: Fence) -> bool | None:
    """Charge an open invoice that has no attempt, as ``pay_invoice`` would; True resolved, False unresolved, None
    skipped (locked, no longer open, or charged meanwhile)."""
    with charging():
        with transaction.atomic():
            fence.check()
            found = Invoice.objects.filter(pk=invoice_id).only("subscription_id").first()
            if found is None:
                return None
            sub, invoice = subscription_and_invoice_locked(
                invoice_id, subscription_id=found.subscription_id, skip_locked=True
            )
            if invoice is None or invoice.status != Invoice.OPEN or invoice.payment_attempts.exists():
                return None
            customer = customer_locked(invoice.customer_id)
            now = billing_time(customer.test_clock_id)
            if sub is not None and pausing.collection_paused(sub, now=now):
                return None  # charged once collection resumes
            if needs_no_charge(invoice):
                settle_without_charge_locked(invoice, customer, now=now)
                act_on_paid_locked(sub, invoice, now=now)
                return True
            try:
                plan = reserve_attempt_locked(
                    invoice, customer, now=attempt_time(now, test_clock_id=customer.test_clock_id, as_of=None)
                )
            except PaymentInFlight:
                return None
            if plan.known_result is not None:
                outcome = record_outcome(plan, plan.known_result, fence=fence)
                return outcome.kind not in (OutcomeKind.FAILED, OutcomeKind.PAYMENT_PENDING)
        outcome = record_outcome(plan, send(plan), fence=fence)
        return outcome.kind not in (OutcomeKind.FAILED, OutcomeKind.PAYMENT_PENDING)


def _reconcile_payment(attempt: PaymentAttempt, fence: Fence) -> bool | None:
    """Re-send an unresolved attempt under its key, or look it up; True resolved, False unresolved, None skipped."""
    with charging():
        return _reconcile_payment_charging(attempt, fence)


def _reconcile_payment_charging(attempt: PaymentAttempt, fence: Fence) -> bool | None:
    with transaction.atomic():
        fence.check()
        sub, invoice = subscription_and_invoice_locked(
            attempt.invoice_id, subscription_id=attempt.invoice.subscription_id, skip_locked=True
        )
        if invoice is None or invoice.status != Invoice.OPEN:
            return None
        latest = invoice.payment_attempts.order_by("-attempt_number").first()
        if latest is None or latest.pk != attempt.pk or not is_open(latest):
            return None
        if latest.outcome == PaymentAttempt.ERROR and sub is not None and is_current_period(sub, invoice):
            return None  # the retry ladder owns it
        customer = customer_locked(invoice.customer_id)
        now = attempt_time(billing_time(customer.test_clock_id), test_clock_id=customer.test_clock_id, as_of=None)
        try:
            plan = reserve_attempt_locked(invoice, customer, now=now)
        except PaymentInFlight:
            return None
    outcome = record_outcome(plan, send(plan), fence=fence)
    return outcome.kind not in (OutcomeKind.FAILED, OutcomeKind.PAYMENT_PENDING)
