"""Manual billing runs (``POST /v1/billing/run``) drained in the background, under a leader lease of their own.

A drain over a large book outlives any request timeout, so the request only records the run,
``running``, and answers it at once (:func:`start_manual_run`). When that transaction commits, a
thread of the same process (:func:`start_manual_drain`, its own database connection) takes the
run's lease and drains: the same :func:`~billing.services.drain.drain_due` as before, over the
tenant's wall-clock subscriptions of one mode, skipping waiting and parked ones. The counts are
saved after every page, so ``GET /v1/billing/runs/{id}`` shows the progress, and the run ends
``completed`` (or ``failed``) as any drain does. One manual run per tenant and mode is in progress
at a time: a second request while one is ``running`` answers that one.

The lease (docs/decisions/0127-manual-runs-in-the-background.md) is a leader-lease row with role
``manual:{tenant_id}:{mode}`` in the kernel's lease store, taken, heartbeated and fenced as the
scheduler does with its roles (docs/reference/roles-and-leases.md): every write of the drain is
fenced by it and its liveness stamp is written after every page. A process that dies stops
heartbeating, so its lease expires; the billing tick (:func:`resume_stalled_manual_runs`), a
read of the run and a second request find the run ``running`` with its lease not held and
carry it on in the background under a new token. A drain that stopped for good (a bug, not a
lost lease) ends its run ``failed`` with the reason, so no run stays ``running`` forever.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction

from billing.models import BillingRun
from billing.services.drain import drain_due
from hardcount import tenancy
from hardcount.fencing import LeaseLost
from hardcount.scheduler.leadership import HeldLease, lease_store
from hardcount.times import database_now

log = logging.getLogger("billing.manual_runs")

# SERIALIZE_STARTS: two requests of one tenant and mode decide "start a run, or answer the one in
# progress" one after the other (transaction scoped: released at commit). The key is a 64-bit hash
# of the lease role (a collision would only make two tenants' requests wait for each other).
SERIALIZE_STARTS = "SELECT pg_advisory_xact_lock(hashtextextended('hardcount.manual_run:' || %s, 0))"
# How long a stopping process waits for its drains to reach a safe point and give their leases up.
STOP_WAIT_S = 5.0
# At most this many manual drains at once per process (each holds 1 + HARDCOUNT_BILLING_CONCURRENCY
# connections); the others wait before taking their lease, so another process may take them over.
MAX_DRAINS_PER_PROCESS = 4
_drain_slots = threading.BoundedSemaphore(MAX_DRAINS_PER_PROCESS)


def lease_role(tenant_id: str, livemode: bool) -> str:
    """The leader-lease role of a tenant's manual runs in one mode: ``manual:{tenant_id}:{live|test}``."""
    return f"manual:{tenant_id}:{'live' if livemode else 'test'}"


def _in_progress(tenant_id: str, livemode: bool) -> BillingRun | None:
    return (
        BillingRun.objects.filter(
            trigger=BillingRun.Trigger.MANUAL,
            tenant_id=tenant_id,
            livemode=livemode,
            status=BillingRun.Status.RUNNING,
            lease_role=lease_role(tenant_id, livemode),
        )
        .order_by("started_at")
        .first()
    )


def start_manual_run(*, tenant_id: str, livemode: bool) -> tuple[BillingRun, bool]:
    """The tenant's manual run of one mode: ``(run, True)`` for a new one, ``(run, False)`` for the one in progress.

    A new run is written ``running`` (``trigger=manual``, ``as_of`` and ``started_at`` the DB's
    now()) and drained in the background once the caller's transaction commits
    (:func:`start_manual_drain`). The one in progress is answered as it is; when nobody drains it
    (its process died) it is carried on in the background too (:func:`resume_if_stalled`).
    """
    role = lease_role(tenant_id, livemode)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(SERIALIZE_STARTS, [role])
        running = _in_progress(tenant_id, livemode)
        if running is not None:
            resume_if_stalled(running)
            return running, False
        now = database_now()
        run = BillingRun.objects.create(
            trigger=BillingRun.Trigger.MANUAL,
            tenant_id=tenant_id,
            livemode=livemode,
            as_of=now,
            started_at=now,
            lease_role=role,
        )
        transaction.on_commit(lambda: start_manual_drain(run.id))
    return run, True


# --- the drain thread -------------------------------------------------------------------------------------------------

# Threads this process started, by run id (so tests and a stopping process can wait for them).
_threads: dict[str, threading.Thread] = {}
# The leases the threads hold, by run id (a stopping process asks them to stop at a safe point).
_leases: dict[str, HeldLease] = {}
_threads_lock = threading.Lock()


def start_manual_drain(run_id: str) -> threading.Thread:
    """Run :func:`run_manual_drain` for ``run_id`` on a background thread with its own connection; returns it.

    A thread of this process already draining that run is returned instead of a second one.
    Across processes the run's lease lets one drain through.
    """
    with _threads_lock:
        running = _threads.get(run_id)
        if running is not None and running.is_alive():
            return running
        for finished in [key for key, thread in _threads.items() if not thread.is_alive()]:
            del _threads[finished]
        thread = threading.Thread(
            target=_drain_thread, args=(run_id,), name=f"manual-billing-run-{run_id}", daemon=True
        )
        _threads[run_id] = thread
        thread.start()
        return thread


def _drain_thread(run_id: str) -> None:
    with _drain_slots:
        try:
            run_manual_drain(run_id)
        except Exception:
            log.exception("manual billing run %s: its drain stopped with an error", run_id)
        finally:
            connections.close_all()


def _take_lease(run: BillingRun) -> HeldLease | None:
    """The run's lease, held by a new holder of this process; None when another holder drains the run.

    The previous run of the tenant and mode may still be giving the role up (its run is
    ``completed`` but its release not yet committed), so a held lease is tried again until the
    lease's time to live has passed, for as long as the run is still ``running``.
    """
    store = lease_store()
    holder = store.new_holder_id()
    deadline = time.monotonic() + float(settings.HARDCOUNT_LEASE_TTL_S)
    while True:
        lease = store.try_acquire(run.lease_role, holder, clock=time.monotonic)
        if lease is not None:
            return lease
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
        if not BillingRun.objects.filter(pk=run.pk, status=BillingRun.Status.RUNNING).exists():
            return None


def run_manual_drain(run_id: str) -> bool:
    """Drain a ``running`` manual run on this thread, under its lease; False when there was nothing to do.

    Takes the run's lease (:func:`lease_role`) through the kernel's lease store and heartbeats it
    for the whole drain; returns False when another holder keeps it (that one drains the run) or
    when the run is no longer ``running``. Every write is fenced by the lease and the
    liveness stamp is written after every page. A lost lease stops the drain at its next safe
    point and leaves the run to whoever holds the lease next. Any other exception ends the run
    ``failed`` with the reason (then re-raised). The lease is released at the end.
    """
    if connection.in_atomic_block:
        raise RuntimeError("run_manual_drain must not run inside a transaction: each page commits on its own")
    run = BillingRun.objects.filter(pk=run_id).first()
    if not _background_manual(run):
        return False
    lease = _take_lease(run)
    if lease is None:
        return False
    lease.start_heartbeat()
    with _threads_lock:
        _leases[run_id] = lease
    try:
        ended = drain_due(
            livemode=run.livemode,
            trigger=BillingRun.Trigger.MANUAL,
            tenant_id=run.tenant_id,
            fence=lease,
            on_page=lease.stamp,
            run=run,
        )
        log.info(
            "manual billing run %s %s: %d attempted, %d billed, %d failed",
            ended.id,
            ended.status,
            ended.attempted,
            ended.billed,
            ended.failed,
        )
        return True
    except LeaseLost:
        # Lost, or this process is stopping: the run stays running for the next holder to carry on.
        log.warning("manual billing run %s stopped at a safe point: its lease is lost or released", run_id)
        return True
    except Exception as exc:
        _end_failed(run_id, lease, exc)
        raise
    finally:
        with _threads_lock:
            _leases.pop(run_id, None)
        lease.close(release_lease=True)


def _end_failed(run_id: str, lease: HeldLease, exc: Exception) -> None:
    """A drain ended by a bug: the run ends ``failed`` with the reason, under the lease (best effort)."""
    try:
        with transaction.atomic():
            lease.check()
            BillingRun.objects.filter(pk=run_id, status=BillingRun.Status.RUNNING).update(
                status=BillingRun.Status.FAILED,
                finished_at=database_now(),
                error=f"{type(exc).__name__}: {exc}"[:2000],
            )
    except (DatabaseError, LeaseLost):
        log.exception("could not record the end of manual billing run %s; it is carried on when found stalled", run_id)


def wait_for_manual_runs(timeout_s: float | None = None) -> bool:
    """Join this process's manual-run threads; True when all have finished (within ``timeout_s`` each)."""
    with _threads_lock:
        threads = list(_threads.values())
    for thread in threads:
        thread.join(timeout_s)
    return not any(thread.is_alive() for thread in threads)


def stop_manual_drains(timeout_s: float = STOP_WAIT_S) -> bool:
    """Ask this process's drains to stop at their next safe point and release their leases; True when all ended.

    Called when the process exits, so a restarted web worker hands its runs over at once (the next
    read, request or billing tick carries them on) instead of after the lease's time to live.
    """
    with _threads_lock:
        leases = list(_leases.values())
    for lease in leases:
        lease.request_stop()
    deadline = time.monotonic() + timeout_s
    with _threads_lock:
        threads = list(_threads.values())
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


atexit.register(stop_manual_drains)


# --- runs whose process died ------------------------------------------------------------------------------------------


def _background_manual(run: BillingRun | None) -> bool:
    """Whether ``run`` is a ``running`` manual run drained in the background under its own lease.

    A sharded scheduler run records its shard's lease too (``billing:<index>``): it is the scheduler's to
    carry on or supersede, never a manual drain's.
    """
    return (
        run is not None
        and run.trigger == BillingRun.Trigger.MANUAL
        and run.status == BillingRun.Status.RUNNING
        and bool(run.lease_role)
    )


def _held_roles(roles: set[str]) -> set[str]:
    """Which of ``roles`` some holder's lease holds right now (by the database's clock).

    Lease rows belong to no tenant: a request reads them as the cross-tenant role.
    """
    with tenancy.cross_tenant():
        statuses = lease_store().lease_statuses()
    return {status.role for status in statuses if status.role in roles and status.held}


def resume_if_stalled(run: BillingRun) -> bool:
    """Carry a ``running`` manual run on in the background if nobody holds its lease; True when resumed.

    Called when the API reads the run and when a second request finds it in progress, so a client
    polling a run whose process died heals it. The thread starts when the caller's transaction
    commits (at once outside one).
    """
    if not _background_manual(run) or _held_roles({run.lease_role}):
        return False
    transaction.on_commit(lambda: start_manual_drain(run.id))
    return True


def resume_stalled_manual_runs(*, livemode: bool | None = None) -> list[str]:
    """Carry on every ``running`` manual run (of one mode, or both) whose lease nobody holds; their ids.

    The billing tick calls this: a run whose process died (SIGKILL, a recycled web worker) is
    picked up within one billing interval. Each is drained on a thread of this process.
    """
    runs = BillingRun.objects.filter(trigger=BillingRun.Trigger.MANUAL, status=BillingRun.Status.RUNNING).exclude(
        lease_role=""
    )
    if livemode is not None:
        runs = runs.filter(livemode=livemode)
    pending = dict(runs.values_list("id", "lease_role"))
    held = _held_roles(set(pending.values()))
    resumed = []
    for run_id, role in pending.items():
        if role not in held:
            start_manual_drain(run_id)
            resumed.append(run_id)
    return resumed


__all__ = [
    "lease_role",
    "resume_if_stalled",
    "resume_stalled_manual_runs",
    "run_manual_drain",
    "start_manual_drain",
    "start_manual_run",
    "stop_manual_drains",
    "wait_for_manual_runs",
]
