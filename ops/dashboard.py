"""The operators' dashboard on the admin index: the money and the trouble an operator opens it for.

Per mode: monthly recurring revenue by currency, amounts collected today and this month by
currency, amounts in dunning and failing (charges without an answer) by currency — named SQL in
``ops/sql/dashboard.sql``, aggregated in the database (docs/decisions/0137) — then subscriptions
due now and how long the oldest has been due, subscriptions waiting on the retry ladder and
parked, dunning runs in progress; the webhook backlog per endpoint with open circuits flagged;
and each scheduler role's leader, fencing token and tick age (stale past 2 × its interval, as
``/health/ready`` says). Counts shared with ``/metrics`` come from the same SQL
(:mod:`billing.metrics`, :mod:`outbox.metrics`, decision record 0021). Everything is read in one
short transaction with a statement timeout. Each link opens the admin list behind a number. The
admin index shows it through ``ops/templates/ops/admin_index.html`` (set as the admin site's
index template in :mod:`ops.admin`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import DatabaseError, connection, transaction

from billing import metrics as billing_metrics
from hardcount import tenancy
from hardcount.health import role_health
from hardcount.ids import PREFIXES, floor_id
from hardcount.logfmt import logfmt
from hardcount.metrics import role_intervals
from leases.services import lease_statuses
from ops import sql as named_sql
from outbox import metrics as outbox_metrics

logger = logging.getLogger("hardcount.admin")

# Dunning runs still retrying, per mode (answered by the partial index dunning_due_idx).
DUNNING_IN_PROGRESS = """
SELECT livemode, count(*) FROM dunning_dunningrun WHERE status = 'active' GROUP BY livemode
"""


# Endpoints the backlog table lists at most (open circuits first, then the longest queues).
BACKLOG_ENDPOINTS = 20


@dataclass(frozen=True)
class CurrencyFigures:
    """One mode's money in one currency, every amount in integer minor units of ``currency`` (lower case).

    ``mrr``: active and past_due subscriptions' prices per month (``subscriptions`` of them);
    ``collected_today`` / ``collected_month``: succeeded charges since 00:00 UTC today / the 1st;
    ``in_dunning``: amount due on open invoices with an active dunning run (``in_dunning_invoices``);
    ``failing``: amount due on open invoices whose charge got no answer (``failing_invoices``).
    """

    currency: str
    mrr: int = 0
    subscriptions: int = 0
    collected_today: int = 0
    collected_month: int = 0
    in_dunning: int = 0
    in_dunning_invoices: int = 0
    failing: int = 0
    failing_invoices: int = 0


@dataclass(frozen=True)
class ModeFigures:
    """One mode's billing figures: counts of subscriptions and runs, ``oldest_due_age_s`` in seconds, and
    ``money``: one :class:`CurrencyFigures` per currency that has any figure, by currency code."""

    mode: str
    due: int
    oldest_due_age_s: float
    waiting: int
    parked: int
    dunning_in_progress: int
    money: list[CurrencyFigures] = field(default_factory=list)


@dataclass(frozen=True)
class EndpointBacklog:
    """One webhook endpoint's queue: ``queued`` pending or retrying deliveries, ``due`` of them due now, and
    whether its circuit is open (until ``circuit_open_until``) or it is disabled."""

    endpoint_id: str
    mode: str
    url: str
    enabled: bool
    disabled_reason: str
    circuit_open: bool
    circuit_open_until: object
    consecutive_failures: int
    queued: int
    due: int


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
    endpoints: list[EndpointBacklog] = field(default_factory=list)
    roles: list[RoleFigures] = field(default_factory=list)
    error: str = ""


def _rows(sql: str, params: dict | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _money_by_mode() -> dict[bool, list[CurrencyFigures]]:
    """The four money statements of ``ops/sql/dashboard.sql``, merged per mode and currency."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT date_trunc('month', now(), 'UTC')")
        month_start = cursor.fetchone()[0]
    # A day's margin: an attempt's id is made (by the app's clock) when it is reserved, before the charge completes.
    since_id = floor_id(PREFIXES["payment_attempt"], month_start - timedelta(days=1))
    figures: dict[tuple[bool, str], dict[str, int]] = {}

    def put(livemode: bool, currency: str, **values: int) -> None:
        figures.setdefault((livemode, currency), {}).update(values)

    for livemode, currency, mrr, count in _rows(named_sql.statement("dashboard", "mrr_by_currency")):
        put(livemode, currency, mrr=mrr, subscriptions=count)
    collected = _rows(named_sql.statement("dashboard", "collected_by_currency"), {"since_id": since_id})
    for livemode, currency, today, month, _charges in collected:
        put(livemode, currency, collected_today=today, collected_month=month)
    for livemode, currency, amount, count in _rows(named_sql.statement("dashboard", "in_dunning_by_currency")):
        put(livemode, currency, in_dunning=amount, in_dunning_invoices=count)
    for livemode, currency, amount, count in _rows(named_sql.statement("dashboard", "failing_by_currency")):
        put(livemode, currency, failing=amount, failing_invoices=count)
    by_mode: dict[bool, list[CurrencyFigures]] = {}
    for (livemode, currency), values in sorted(figures.items()):
        by_mode.setdefault(livemode, []).append(CurrencyFigures(currency, **values))
    return by_mode


def _backlog_by_endpoint() -> list[EndpointBacklog]:
    rows = _rows(named_sql.statement("dashboard", "webhook_backlog_by_endpoint"), {"limit": BACKLOG_ENDPOINTS})
    return [
        EndpointBacklog(row[0], billing_metrics.MODES[row[1]], *row[2:])  # columns in the statement's order
        for row in rows
    ]


def dashboard() -> Dashboard:
    """Read the dashboard's figures (a few indexed statements, 5 s statement timeout).

    Never raises for a database error: the page shows :attr:`Dashboard.error` instead.
    """
    try:
        with tenancy.cross_tenant(), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = '5s'")
            due = billing_metrics.due_by_mode()
            failing = billing_metrics.failing_by_mode()
            dunning = dict(_rows(DUNNING_IN_PROGRESS))
            backlog = _rows(outbox_metrics.DELIVERY_BACKLOG)[0][0]
            money = _money_by_mode()
            endpoints = _backlog_by_endpoint()
            leases = {lease.role: lease for lease in lease_statuses()}
    except DatabaseError as exc:
        logger.warning(logfmt("admin_dashboard_db_error", error=type(exc).__name__, detail=str(exc)[:200]))
        return Dashboard(error=f"The database did not answer ({type(exc).__name__}).")

    modes = []
    for livemode, mode in billing_metrics.MODES.items():
        count, oldest_age_s = due.get(livemode, (0, 0.0))
        waiting, parked = failing.get(livemode, (0, 0))
        modes.append(
            ModeFigures(mode, count, oldest_age_s, waiting, parked, dunning.get(livemode, 0), money.get(livemode, []))
        )

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
    return Dashboard(modes=modes, delivery_backlog=backlog, endpoints=endpoints, roles=roles)


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
