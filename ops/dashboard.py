"""The operators' dashboard on the admin index: the figures of ``/metrics`` an operator wants first.

Per mode: subscriptions due now and how long the oldest has been due, subscriptions waiting on
the retry ladder and parked, dunning runs in progress; the webhook delivery backlog; and each
scheduler role's leader, fencing token and tick age (stale past 2 × its interval, as
``/health/ready`` says). The numbers come from the same SQL as the metrics
(:mod:`billing.metrics`, :mod:`outbox.metrics`, decision record 0021) in one short read-only
transaction, so the dashboard and Prometheus never disagree. Each link opens the admin list
behind a number. The admin index shows it through ``ops/templates/ops/admin_index.html``
(set as the admin site's index template in :mod:`ops.admin`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.db import DatabaseError, connection, transaction

from billing import metrics as billing_metrics
from hardcount.health import role_health
from hardcount.logfmt import logfmt
from hardcount.metrics import role_intervals
from leases.services import lease_statuses
from outbox import metrics as outbox_metrics

logger = logging.getLogger("hardcount.admin")

# Dunning runs still retrying, per mode (answered by the partial index dunning_due_idx).
DUNNING_IN_PROGRESS = """
SELECT livemode, count(*) FROM dunning_dunningrun WHERE status = 'active' GROUP BY livemode
"""


@dataclass(frozen=True)
class ModeFigures:
    """One mode's billing figures: counts of subscriptions and runs, ``oldest_due_age_s`` in seconds."""

    mode: str
    due: int
    oldest_due_age_s: float
    waiting: int
    parked: int
    dunning_in_progress: int


@dataclass(frozen=True)
class RoleFigures:
    """One scheduler role's lease: holder (None: nobody), fencing token, tick age in seconds, stale flag."""

    role: str
    holder: str | None
    held: bool
    token: int | None
    tick_age_s: float | None
    interval_s: float | None
    stale: bool | None


@dataclass(frozen=True)
class Dashboard:
    """What the admin index shows; ``error`` is set (and the figures empty) when the database did not answer."""

    modes: list[ModeFigures] = field(default_factory=list)
    delivery_backlog: int | None = None
    roles: list[RoleFigures] = field(default_factory=list)
    error: str = ""


def _rows(sql: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchall()


def dashboard() -> Dashboard:
    """Read the dashboard's figures (a few indexed statements, 5 s statement timeout).

    Never raises for a database error: the page shows :attr:`Dashboard.error` instead.
    """
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = '5s'")
            due = billing_metrics.due_by_mode()
            failing = billing_metrics.failing_by_mode()
            dunning = dict(_rows(DUNNING_IN_PROGRESS))
            backlog = _rows(outbox_metrics.DELIVERY_BACKLOG)[0][0]
            leases = {lease.role: lease for lease in lease_statuses()}
    except DatabaseError as exc:
        logger.warning(logfmt("admin_dashboard_db_error", error=type(exc).__name__, detail=str(exc)[:200]))
        return Dashboard(error=f"The database did not answer ({type(exc).__name__}).")

    modes = []
    for livemode, mode in billing_metrics.MODES.items():
        count, oldest_age_s = due.get(livemode, (0, 0.0))
        waiting, parked = failing.get(livemode, (0, 0))
        modes.append(ModeFigures(mode, count, oldest_age_s, waiting, parked, dunning.get(livemode, 0)))

    intervals = role_intervals()
    roles = []
    for name in sorted({*intervals, *leases}):
        health = role_health(leases.get(name), intervals.get(name))
        roles.append(
            RoleFigures(
                role=name,
                holder=health["holder"] if health["held"] else None,
                held=health["held"],
                token=health["token"],
                tick_age_s=health["stamp_age_s"],
                interval_s=health["interval_s"],
                stale=health["stale"],
            )
        )
    return Dashboard(modes=modes, delivery_backlog=backlog, roles=roles)


def format_age(seconds: float | None) -> str:
    """``42 s``, ``3 min``, ``1 h``, ``5 h 12 min``, ``2 d 4 h``; ``—`` for None."""
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        hours, minutes = divmod(s, 3600)
        return f"{hours} h {minutes // 60} min" if minutes >= 60 else f"{hours} h"
    days, hours = s // 86400, s % 86400 // 3600
    return f"{days} d {hours} h" if hours else f"{days} d"
