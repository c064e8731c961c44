"""Health endpoints: ``/health/live`` and ``/health/ready`` (docs/reference/roles-and-leases.md).

``/health/live`` answers 200 whenever the process serves requests. ``/health/ready``
answers 200 when the database answers and 503 when it does not; its body lists every
scheduler role with its lease holder, fencing token, last stamp and whether it is stale
(stamp older than 2 × the role's interval). Staleness is reported in the body (and the
metrics) only: a stale role does not make the replica unready, since another replica
may be the one that should run it. Lease rows are read through the registered lease store
(:func:`hardcount.scheduler.leadership.lease_store`): the kernel imports no app. A registered
metrics provider with a ``readiness()`` method adds its counts to the body (billing's: the
subscriptions whose collection is paused, per mode).
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import DatabaseError, connection, transaction
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from hardcount.metrics import metrics_providers, reported, role_intervals
from hardcount.scheduler.leadership import LeaseStatus, lease_store

STALE_AFTER_INTERVALS = 2


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def role_health(lease: LeaseStatus | None, interval_s: float | None) -> dict:
    """One role's entry of the ready body; ``lease`` None when the role has never been held."""
    stamp_age_s = None if lease is None else lease.stamp_age_s
    stale = None
    if interval_s is not None:
        stale = stamp_age_s is None or stamp_age_s > STALE_AFTER_INTERVALS * interval_s
    return {
        "holder": None if lease is None else lease.holder,
        "token": None if lease is None else lease.token,
        "held": bool(lease is not None and lease.held),
        "acquired_at": None if lease is None else _iso(lease.acquired_at),
        "heartbeat_at": None if lease is None else _iso(lease.heartbeat_at),
        "expires_at": None if lease is None else _iso(lease.expires_at),
        "last_stamp_at": None if lease is None else _iso(lease.last_stamp_at),
        "last_stamp_holder": (lease.last_stamp_holder or None) if lease is not None else None,
        "last_tick_at": None if lease is None else _iso(lease.last_tick_at),
        "stamp_age_s": None if stamp_age_s is None else round(stamp_age_s, 3),
        "interval_s": interval_s,
        "stale": stale,
    }


# csrf_exempt: these read-only probes take no cookie session, and a POST gets require_GET's 405 (with Allow)
# rather than the CSRF check's 403 HTML page.
@csrf_exempt
@require_GET
def live(request):
    """200 ``{"status": "ok"}``: the process is up. Touches nothing."""
    return JsonResponse({"status": "ok"})


@csrf_exempt
@require_GET
def ready(request):
    """200 with each role's lease when the database answers (within 2 s); 503 otherwise."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = '2s'")
            leases = {lease.role: lease for lease in lease_store().lease_statuses()}
            with connection.cursor() as cursor:
                cursor.execute("SELECT now()")
                db_now = cursor.fetchone()[0]
            counts: dict = {}
            for provider in metrics_providers():
                readiness = getattr(provider, "readiness", None)
                if readiness is not None:
                    counts.update(readiness())
    except DatabaseError as exc:
        return JsonResponse(
            {"status": "unavailable", "database": "unreachable", "error": type(exc).__name__}, status=503
        )
    intervals = role_intervals()
    leases = {role: lease for role, lease in leases.items() if reported(lease, intervals)}
    roles = {name: role_health(leases.get(name), intervals.get(name)) for name in sorted({*intervals, *leases})}
    return JsonResponse({"status": "ok", "database": "ok", "db_now": _iso(db_now), "roles": roles, **counts})
