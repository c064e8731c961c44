"""Test clocks (docs/reference/domain.md#test-clocks): create, delete, and advance month after month in the background.

A test clock is a test-mode ``frozen_time``. Customers and subscriptions attached to it are
billed by that time only: the wall-clock drain never touches them, and everything the close
writes for them (invoice dates, period bounds, events' ``created``, dunning due times) uses the
clock's time, never the wall clock.

Advancing (:func:`advance_test_clock`) is asynchronous, as in Stripe: the request marks the clock
``advancing`` with its ``advance_target`` and returns at once; a background thread
(:func:`start_advance`, one database connection of its own) walks time forward instant by
instant (:func:`run_advance`). At each instant — the earliest ``next_billing_at`` or dunning due
time of the clock's objects — the clock's ``frozen_time`` is set to it, the dunning pass and the
billing drain run ``as_of`` that instant, and the walk moves to the next instant, until nothing
is due by the target; then ``frozen_time = target``, the clock is ``ready`` again and
``test_clock.advanced`` is emitted. So every period in between is billed in order, at its own
time: renewals, trials ending, ``cancel_at_period_end`` taking effect, dunning retries.

Crash safety (docs/decisions/0080-test-clock-advance-runs-in-the-background.md, 0182): the thread
holds a claim on the clock (:mod:`hardcount.claims`) for the whole walk, renewed by its process's
heartbeat. The claim of a process that dies lapses one ``HARDCOUNT_CLAIM_TTL_S`` after its last
beat, so "``advancing`` and no live claim" means the advance was orphaned; the billing tick
(:func:`resume_stalled_advances`) and a read of the clock
through the API resume it toward its recorded target. Every step of the walk is idempotent (the
drain's exactly-once guards, the monotonic clock update), so resuming is safe at any point.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta

from dateutil.relativedelta import relativedelta
from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Case, DateTimeField, Exists, F, OuterRef, Q, Value, When

from billing.events import test_clock_event
from billing.models import (
    BillingAttempt,
    BillingRun,
    Customer,
    PaymentAttempt,
    Price,
    Subscription,
    SubscriptionItem,
    TestClock,
)
from billing.models.subscriptions import BILLABLE_STATUSES
from billing.queries import usage_close_delay_s
from billing.services import dunning_pass, pausing
from billing.services.drain import drain_due
from billing.services.payments import charges_in_flight, in_flight_window
from dunning import services as dunning_services
from hardcount import claims
from hardcount.errors import InvalidRequestError, NotFoundError, StateConflictError, business_rule_codes
from hardcount.times import iso

log = logging.getLogger("billing.clocks")

# Clock times stay where period arithmetic (anchor + n × interval, up to three years) is safe.
EARLIEST_FROZEN_TIME = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_FROZEN_TIME = datetime(2200, 1, 1, tzinfo=UTC)
# The longest single advance. A daily subscription over five years is ~1,800 billing instants:
# bounded work for one background walk. Advance again to go further.
MAX_ADVANCE = relativedelta(years=5)

# Closes in parallel per page of a clock's drain. A clock's subscriptions all belong to one tenant,
# and every finalisation holds that tenant's gapless invoice-number counter until it commits, so
# more parallel closes only queue on that lock (and on the GIL): 200 subscriptions × 6 months
# measured 72 invoices/s with 1, 78 with 2, 48 with 4 and 34 with 8 (the drain's default).
ADVANCE_CONCURRENCY = 2


# The advance lock: a claim (hardcount.claims) on this key that the walker holds for its whole walk,
# kept alive by the process's claims heartbeat. A crashed process stops beating, so its claim lapses
# one HARDCOUNT_CLAIM_TTL_S later, and a clock ``advancing`` with no live claim is one nobody walks.
def _advance_key(clock_id: str) -> str:
    return f"test_clock:{clock_id}"


class TestClockAdvancing(StateConflictError):
    """409: the clock is advancing; wait until its ``status`` is ``ready``."""

    __test__ = False
    default_code = "test_clock_advancing"


class TestClockInUse(StateConflictError):
    """409: customers or subscriptions are attached to the clock (decision 0081)."""

    __test__ = False
    default_code = "test_clock_in_use"


# 422s for rules the OpenAPI document can state only in prose (time ranges, relative to the clock).
BUSINESS_RULE_CODES = business_rule_codes(
    "frozen_time_out_of_range", "test_clock_time_not_later", "test_clock_advance_too_far", "test_mode_only"
)


class AdvanceFailed(Exception):
    """An advance cannot go on (a drain ended by a database error); the clock stops where it got to."""


# --- create, retrieve, delete ---------------------------------------------------------------------------------------


def _check_frozen_time(value: datetime, *, param: str = "frozen_time") -> None:
    if not EARLIEST_FROZEN_TIME <= value < LATEST_FROZEN_TIME:
        raise InvalidRequestError(
            f"{param} must be from {iso(EARLIEST_FROZEN_TIME)} up to (not including) {iso(LATEST_FROZEN_TIME)}.",
            code="frozen_time_out_of_range",
            param=param,
        )


def _get(clock_id: str, *, tenant_id: str, livemode: bool, lock: bool = False) -> TestClock:
    queryset = TestClock.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=clock_id)
    if lock:
        queryset = queryset.select_for_update()
    clock = queryset.first()
    if clock is None:
        raise NotFoundError(f"No such test clock: '{clock_id}'.", param="id")
    return clock


def create_test_clock(*, tenant_id: str, livemode: bool, frozen_time: datetime, name: str = "") -> TestClock:
    """Create a ``ready`` test clock at ``frozen_time`` (aware, UTC) and emit ``test_clock.created``.

    Test mode only, as in Stripe: a live key gets :class:`InvalidRequestError` ``test_mode_only``.
    ``frozen_time`` must lie in [1970-01-01, 2200-01-01) (``frozen_time_out_of_range``); it may
    be in the past or the future of the wall clock.
    """
    if livemode:
        raise InvalidRequestError(
            "Test clocks exist in test mode only; use a test key.", code="test_mode_only", param=None
        )
    _check_frozen_time(frozen_time)
    with transaction.atomic():
        clock = TestClock.objects.create(tenant_id=tenant_id, livemode=livemode, frozen_time=frozen_time, name=name)
        test_clock_event(clock, "test_clock.created")
    return clock


def delete_test_clock(*, tenant_id: str, livemode: bool, clock_id: str) -> TestClock:
    """Delete a clock that nothing is attached to and emit ``test_clock.deleted``; returns the deleted clock.

    Raises :class:`NotFoundError`, :class:`TestClockAdvancing` (409) while it advances, and
    :class:`TestClockInUse` (409) while a customer or subscription is attached: their invoices,
    payments and ledger are history dated by the clock, and detaching them would hand them to
    the wall-clock drain at a time that means nothing to it (decision 0081).
    """
    with transaction.atomic():
        clock = _get(clock_id, tenant_id=tenant_id, livemode=livemode, lock=True)
        if clock.status == TestClock.ADVANCING:
            raise TestClockAdvancing(f"Test clock {clock.id} is advancing; delete it once it is ready.")
        attached = Customer.objects.filter(test_clock_id=clock.id).exists() or clock.subscriptions.exists()
        if attached:
            raise TestClockInUse(
                f"Customers or subscriptions are attached to test clock {clock.id}; a clock with billing history "
                "cannot be deleted."
            )
        TestClock.objects.filter(pk=clock.id).delete()
        test_clock_event(clock, "test_clock.deleted")
    return clock


# --- advance --------------------------------------------------------------------------------------------------------


def advance_test_clock(*, tenant_id: str, livemode: bool, clock_id: str, frozen_time: datetime) -> TestClock:
    """Start advancing a clock to ``frozen_time``; returns the clock, ``advancing``, at once.

    The walk runs in a background thread started when this transaction commits
    (:func:`start_advance`); the clock returns to ``ready`` at ``frozen_time`` when it is done.
    Rules: ``frozen_time`` later than the clock's (``test_clock_time_not_later``), at most five
    years later (``test_clock_advance_too_far``) and before 2200 (``frozen_time_out_of_range``),
    all :class:`InvalidRequestError` (422); :class:`TestClockAdvancing` (409) when the clock is
    already advancing (an orphaned advance is resumed first, see :func:`resume_if_stalled`);
    :class:`NotFoundError` for a clock of another tenant or mode.
    """
    with transaction.atomic():
        clock = _get(clock_id, tenant_id=tenant_id, livemode=livemode, lock=True)
        if clock.status == TestClock.ADVANCING:
            stalled = not _advancer_alive(clock.id)
        else:
            stalled = None
            _check_frozen_time(frozen_time)
            if frozen_time <= clock.frozen_time:
                raise InvalidRequestError(
                    f"frozen_time must be later than the clock's current time, {iso(clock.frozen_time)}.",
                    code="test_clock_time_not_later",
                    param="frozen_time",
                )
            if frozen_time > clock.frozen_time + MAX_ADVANCE:
                raise InvalidRequestError(
                    "A test clock advances at most five years at a time; advance again to go further.",
                    code="test_clock_advance_too_far",
                    param="frozen_time",
                )
            clock.status = TestClock.ADVANCING
            clock.advance_target = frozen_time
            clock.last_failure = ""
            clock.save(update_fields=["status", "advance_target", "last_failure"])
            transaction.on_commit(lambda: start_advance(clock.id))
    if stalled is not None:
        if stalled:
            transaction.on_commit(lambda: start_advance(clock.id))
        raise TestClockAdvancing(
            f"Test clock {clock.id} is already advancing to {iso(clock.advance_target)}; "
            "advance it again once its status is ready."
        )
    return clock


# Threads this process started, by clock id (so tests and shutdown can wait for them).
_threads: dict[str, threading.Thread] = {}
_threads_lock = threading.Lock()
# At most this many walks at once per process (each holds 1 + ADVANCE_CONCURRENCY connections);
# the others wait before connecting. A waiting walk looks orphaned to other processes, which may
# take it over; the claim still lets one walker through.
MAX_WALKS_PER_PROCESS = 4
_walk_slots = threading.BoundedSemaphore(MAX_WALKS_PER_PROCESS)


def start_advance(clock_id: str) -> threading.Thread:
    """Run :func:`run_advance` for ``clock_id`` on a background thread with its own connection; returns it.

    A thread of this process already walking that clock is returned instead of a second one.
    Across processes the clock's claim lets exactly one walker through.
    """
    with _threads_lock:
        running = _threads.get(clock_id)
        if running is not None and running.is_alive():
            return running
        for finished in [key for key, thread in _threads.items() if not thread.is_alive()]:
            del _threads[finished]
        thread = threading.Thread(
            target=_advance_thread, args=(clock_id,), name=f"test-clock-advance-{clock_id}", daemon=True
        )
        _threads[clock_id] = thread
        thread.start()
        return thread


def _advance_thread(clock_id: str) -> None:
    with _walk_slots:
        try:
            run_advance(clock_id)
        except Exception:
            log.exception("advance of test clock %s ended by an error; it stays advancing until resumed", clock_id)
        finally:
            connections.close_all()


def wait_for_advances(timeout_s: float | None = None) -> bool:
    """Join this process's advance threads; True when all have finished (within ``timeout_s`` each)."""
    with _threads_lock:
        threads = list(_threads.values())
    for thread in threads:
        thread.join(timeout_s)
    return not any(thread.is_alive() for thread in threads)


def run_advance(clock_id: str) -> bool:
    """Walk an ``advancing`` clock to its ``advance_target`` on this thread; False when there was nothing to do.

    Holds the clock's claim for the whole walk; returns False at once when another holder has it
    (that one is walking the clock), or when the clock is not ``advancing``; stops between two
    instants, leaving the clock to its new walker, if the claim lapsed meanwhile (this process
    stopped beating long enough for another to take over). An error that ends the walk
    (:class:`AdvanceFailed`, or any exception from the drain or dunning) returns the clock to
    ``ready`` where it got to, with ``last_failure`` saying why, and emits ``test_clock.advanced``;
    if even that cannot be written (the database went away) the clock stays ``advancing`` for
    :func:`resume_stalled_advances`.
    """
    if connection.in_atomic_block:
        raise RuntimeError("run_advance must not run inside a transaction: each step commits on its own")
    key = _advance_key(clock_id)
    if not claims.take([key]):
        return False
    try:
        clock = TestClock.objects.filter(pk=clock_id).first()
        if clock is None or clock.status != TestClock.ADVANCING or clock.advance_target is None:
            return False
        try:
            if not _walk(clock, still_ours=lambda: bool(claims.still_held([key]))):
                log.warning("advance of test clock %s: its claim lapsed; another walker has it", clock_id)
                return True
        except Exception as exc:
            log.exception("advance of test clock %s failed", clock_id)
            _stop_where_it_got(clock.id, exc)
            return True
        _finish(clock.id)
        return True
    finally:
        try:
            claims.release([key])
        except DatabaseError:
            connection.close()  # the claim lapses by itself


def _walk(clock: TestClock, *, still_ours=lambda: True) -> bool:
    """Process every instant from the clock's time to its target, in order (see the module docstring).

    False when ``still_ours()``, asked before each instant, says the walk is no longer this thread's.
    """
    target = clock.advance_target
    instant = clock.frozen_time
    _wait_out_payments_in_flight(clock)
    if not _due_by(clock, instant):
        instant = _next_instant(clock, after=instant, target=target)
    while instant is not None:
        if not still_ours():
            return False
        _set_time(clock.id, instant)
        if _process_instant(clock, instant):
            # A subscription closed a period and its next one is due by this instant too (a clock
            # set ahead of an anchor, or periods caught up after a failure): bill it at this instant.
            continue
        # Whatever else is still due by this instant failed here; the drain tries it again (once)
        # at every later instant, and the clock's last_failure says why.
        instant = _next_instant(clock, after=instant, target=target)
    return True


def _wait_out_payments_in_flight(clock: TestClock) -> None:
    """Wait while another holder sends a payment of the clock's invoices (has its charge lock), at most
    the in-flight window.

    The attempts of a clock are dated by the clock, so in flight is what their charge locks say
    (:func:`billing.services.payments.charging`): a walker that died mid-charge lost its locks with
    its claims (one claim TTL after its last heartbeat), and the drain re-sends its attempts under
    their own keys. A live sender
    (``POST /v1/invoices/{id}/pay``, the reconciler) finishes within the window
    (:func:`billing.services.payments.in_flight_window`, on the monotonic clock); until then the
    drain would skip its subscription as "being charged elsewhere".
    """
    deadline = time.monotonic() + in_flight_window().total_seconds()
    while True:
        unknown = list(
            PaymentAttempt.objects.filter(
                outcome=PaymentAttempt.UNKNOWN, invoice__customer__test_clock_id=clock.id
            ).values_list("invoice_id", flat=True)
        )
        in_flight = charges_in_flight(unknown)
        if not in_flight or time.monotonic() >= deadline:
            return
        log.info("test clock %s waits for %d payment(s) another session is sending", clock.id, len(in_flight))
        time.sleep(0.05)


def _process_instant(clock: TestClock, instant: datetime) -> bool:
    """Dunning retries, then billing, due by ``instant``. True when a subscription that closed a
    period in this pass has another one due by ``instant`` (the instant needs another pass)."""
    resume_at = pausing.next_resume_at(test_clock_id=clock.id, after=None)
    if resume_at is not None and resume_at <= instant:
        # A pause that runs out at this instant ends before its dunning and billing (the drain would
        # end it too, but only when something is due to bill).
        pausing.collect_paused(
            livemode=clock.livemode, tenant_id=clock.tenant_id, test_clock_id=clock.id, as_of=instant
        )
    dunning_at = _dunning_next_due(clock, after=None)
    if dunning_at is not None and dunning_at <= instant:
        _dunning_process(clock, instant)
    billing_at = _billing_next_due(clock, after=None)
    if billing_at is None or billing_at > instant:
        return False
    run = drain_due(
        livemode=clock.livemode,
        trigger=BillingRun.TEST_CLOCK,
        tenant_id=clock.tenant_id,
        test_clock_id=clock.id,
        as_of=instant,
        concurrency=getattr(settings, "HARDCOUNT_TEST_CLOCK_CONCURRENCY", ADVANCE_CONCURRENCY),
    )
    if run.status == BillingRun.FAILED:
        raise AdvanceFailed(f"billing run {run.id} at {iso(instant)} ended: {run.error}")
    # The outcomes a run counts as billed are those whose close moved the subscription to its next period.
    closed = BillingAttempt.objects.filter(run=run, outcome__in=BillingAttempt.COUNTED_AS_BILLED).values(
        "subscription_id"
    )
    return _billable(clock).filter(pk__in=closed, next_billing_at__lte=instant).exists()


def _due_by(clock: TestClock, instant: datetime) -> bool:
    for next_due in (
        _billing_next_due(clock, after=None),
        _dunning_next_due(clock, after=None),
        pausing.next_resume_at(test_clock_id=clock.id, after=None),
    ):
        if next_due is not None and next_due <= instant:
            return True
    return False


def _next_instant(clock: TestClock, *, after: datetime, target: datetime) -> datetime | None:
    """The earliest due instant of the clock's objects in ``(after, target]``, or None."""
    candidates = [
        at
        for at in (
            _billing_next_due(clock, after=after),
            _dunning_next_due(clock, after=after),
            pausing.next_resume_at(test_clock_id=clock.id, after=after),
        )
        if at is not None and at <= target
    ]
    return min(candidates, default=None)


def _billable(clock: TestClock):
    """The clock's subscriptions the drain may bill (billable status, not parked, a next billing time)."""
    return Subscription.objects.filter(
        test_clock_id=clock.id,
        status__in=BILLABLE_STATUSES,
        billing_parked_at__isnull=True,
        next_billing_at__isnull=False,
    )


def _billing_next_due(clock: TestClock, *, after: datetime | None) -> datetime | None:
    """The earliest time one of the clock's billable, unparked subscriptions falls due (after ``after``):
    its ``next_billing_at``, or for one billing usage that time plus the grace (docs/decisions/0165)."""
    metered = SubscriptionItem.objects.filter(subscription_id=OuterRef("pk"), price__usage_type=Price.METERED)
    delay = timedelta(seconds=usage_close_delay_s(test_clock_id=clock.id))
    due_at = Case(
        When(Q(periods_billed__gt=0) & Exists(metered), then=F("next_billing_at") + Value(delay)),
        default=F("next_billing_at"),
        output_field=DateTimeField(),
    )
    subscriptions = _billable(clock).annotate(due_at=due_at)
    if after is not None:
        subscriptions = subscriptions.filter(due_at__gt=after)
    return subscriptions.order_by("due_at").values_list("due_at", flat=True).first()


# --- dunning (docs/reference/dunning.md): the clock's dunning runs are due by the clock, like its subscriptions -----


def _dunning_process(clock: TestClock, instant: datetime) -> int:
    """Retry (or end) the clock's dunning runs due by ``instant``; returns how many were acted on."""
    return dunning_pass.process_due(livemode=clock.livemode, as_of=instant, test_clock_id=clock.id)


def _dunning_next_due(clock: TestClock, *, after: datetime | None) -> datetime | None:
    """The earliest due time of the clock's active dunning runs (after ``after``)."""
    return dunning_services.next_due_at(livemode=clock.livemode, test_clock_id=clock.id, after=after)


# --- the clock row --------------------------------------------------------------------------------------------------


def _set_time(clock_id: str, instant: datetime) -> None:
    """Move the advancing clock's ``frozen_time`` to ``instant``; never backwards (a resumed walk may repeat one)."""
    TestClock.objects.filter(pk=clock_id, status=TestClock.ADVANCING, frozen_time__lte=instant).update(
        frozen_time=instant
    )


def _finish(clock_id: str) -> None:
    """The target is reached: ``frozen_time = target``, ``ready``, ``test_clock.advanced`` (one transaction)."""
    with transaction.atomic():
        clock = TestClock.objects.select_for_update().get(pk=clock_id)
        if clock.status != TestClock.ADVANCING or clock.advance_target is None:
            return
        clock.frozen_time = max(clock.frozen_time, clock.advance_target)
        clock.status = TestClock.READY
        clock.advance_target = None
        still_due = _billable(clock).filter(next_billing_at__lte=clock.frozen_time).count()
        if still_due and not clock.last_failure:
            # Not a failure the close recorded (those set last_failure themselves): say what is left.
            clock.last_failure = (
                f"{still_due} subscription(s) still due at {iso(clock.frozen_time)}: their period could not be "
                "closed during the advance; the next advance tries them again."
            )
        clock.save(update_fields=["frozen_time", "status", "advance_target", "last_failure"])
        test_clock_event(clock, "test_clock.advanced")


def _stop_where_it_got(clock_id: str, exc: Exception) -> None:
    """An error ended the walk: ``ready`` at the last instant reached, ``last_failure`` set, event emitted."""
    try:
        with transaction.atomic():
            clock = TestClock.objects.select_for_update().get(pk=clock_id)
            if clock.status != TestClock.ADVANCING:
                return
            target = clock.advance_target
            clock.status = TestClock.READY
            clock.advance_target = None
            clock.last_failure = (
                f"advance to {iso(target)} stopped at {iso(clock.frozen_time)}: {type(exc).__name__}: {exc}"
            )[:2000]
            clock.save(update_fields=["status", "advance_target", "last_failure"])
            test_clock_event(clock, "test_clock.advanced")
    except DatabaseError:
        log.exception("could not record the failed advance of %s; it stays advancing until resumed", clock_id)


# --- orphaned advances ----------------------------------------------------------------------------------------------


def _advancer_alive(clock_id: str) -> bool:
    """True when some holder has a live claim on the clock (someone is walking it)."""
    return bool(claims.held_elsewhere([_advance_key(clock_id)]))


def resume_if_stalled(clock: TestClock) -> bool:
    """Resume ``clock``'s walk in the background if it is ``advancing`` but nobody walks it; True when resumed.

    Called when the API reads a clock, so a client polling an orphaned advance heals it. The
    thread starts when the caller's transaction commits (never, inside a test's transaction).
    """
    if clock.status != TestClock.ADVANCING or _advancer_alive(clock.id):
        return False
    transaction.on_commit(lambda: start_advance(clock.id))
    return True


def resume_stalled_advances(*, livemode: bool = False) -> list[str]:
    """Resume every orphaned advance (``advancing``, no live claim) of one mode in the background; their ids.

    The billing tick calls this in its test-mode pass: an advance whose process died (SIGKILL,
    a recycled web worker) is picked up within one billing interval.
    """
    resumed = []
    for clock_id in TestClock.objects.filter(livemode=livemode, status=TestClock.ADVANCING).values_list(
        "id", flat=True
    ):
        if not _advancer_alive(clock_id):
            start_advance(clock_id)
            resumed.append(clock_id)
    return resumed


__all__ = [
    "BUSINESS_RULE_CODES",
    "MAX_ADVANCE",
    "AdvanceFailed",
    "TestClockAdvancing",
    "TestClockInUse",
    "advance_test_clock",
    "create_test_clock",
    "delete_test_clock",
    "resume_if_stalled",
    "resume_stalled_advances",
    "run_advance",
    "start_advance",
    "wait_for_advances",
]
