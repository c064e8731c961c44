"""Prometheus metrics of SPEC §8, computed from the database at scrape time.

``/metrics`` serves django-prometheus's metrics (requests, database calls) plus the
:class:`HardcountCollector`. Metrics that describe the database — lease stamps, due and
failing subscriptions, billing runs and attempts, the delivery backlog — are computed by
SQL when Prometheus scrapes, so every replica reports the same, exact values whatever
process did the work, and they survive restarts. To keep the project package from
importing billing's models, the collector reads the tables by the names SPEC §2 fixes
(``billing_subscription`` …) with the named statements below (decision record 0021).

Metrics:

- ``hardcount_scheduler_last_run_timestamp_seconds{role}``: when the role's last tick completed (Unix s).
- ``hardcount_leader_last_tick_age_seconds{role}``: age of the role's liveness stamp (last tick or drain page).
- ``hardcount_leader_is_leader{role}``: 1 when a scheduler runtime in *this process* holds the role;
  summed over all scraped processes it is 1 per role.
- ``hardcount_billing_due_subscriptions{mode}``: wall-clock subscriptions due now, excluding waiting and parked ones.
- ``hardcount_billing_oldest_due_age_seconds{mode}``: how long the oldest of them has been due (0 when none).
- ``hardcount_billing_failing_subscriptions{mode,state}``: subscriptions with a saved billing failure,
  ``state="waiting"`` (on the retry ladder) or ``"parked"``.
- ``hardcount_billing_cycle_duration_seconds``: histogram of scheduler drains' durations (billing runs).
- ``hardcount_billing_invoices_total{mode,outcome}``: subscriptions attempted by billing runs, by outcome
  (``billed``, ``declined``, ``tax_pending``, ``failed``, ``skipped``).
- ``hardcount_outbox_deliveries_due_backlog``: deliveries due and unclaimed.
- ``hardcount_outbox_delivery_attempts_total{outcome}``: counted by the delivery executor as it writes
  attempts (:mod:`outbox.metrics`), in the process that runs it.
- ``hardcount_clock_skew_seconds``: this process's clock minus the database's (positive: the app is ahead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection, transaction
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hardcount.logfmt import logfmt
from hardcount.scheduler import configured_roles, process_leadership
from leases.services import lease_statuses

logger = logging.getLogger("hardcount.metrics")

BILLABLE_STATUSES = ("trialing", "active", "past_due")
MODES = {True: "live", False: "test"}
# Buckets of the billing cycle histogram, in seconds (a drain of nothing is milliseconds; a
# large book at the 1 h default interval may take many minutes).
CYCLE_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)

# Wall-clock subscriptions due now, per mode, and the oldest due time's age. Same predicate
# as the drain's due page (SPEC §4): billable status, not on a test clock, not parked, not
# waiting on the retry ladder (next_billing_attempt_at in the future). Uses subscription_due_idx.
DUE_SUBSCRIPTIONS = """
SELECT livemode, count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(next_billing_at)), 0)::float8
FROM billing_subscription
WHERE next_billing_at <= now()
  AND status IN ('trialing', 'active', 'past_due')
  AND test_clock_id IS NULL
  AND billing_parked_at IS NULL
  AND (next_billing_attempt_at IS NULL OR next_billing_attempt_at <= now())
GROUP BY livemode
"""

# Subscriptions with a saved billing failure, per mode: waiting on the ladder, or parked.
FAILING_SUBSCRIPTIONS = """
SELECT livemode,
       count(*) FILTER (WHERE billing_parked_at IS NULL),
       count(*) FILTER (WHERE billing_parked_at IS NOT NULL)
FROM billing_subscription
WHERE (next_billing_attempt_at IS NOT NULL OR billing_parked_at IS NOT NULL)
  AND status IN ('trialing', 'active', 'past_due')
GROUP BY livemode
"""

# Durations of finished scheduler drains, bucketed (cumulative counts, then count and sum).
CYCLE_DURATIONS = """
WITH runs AS (
    SELECT EXTRACT(EPOCH FROM finished_at - started_at)::float8 AS d
    FROM billing_billingrun WHERE trigger = 'scheduler' AND finished_at IS NOT NULL
)
SELECT {buckets}, count(*), COALESCE(sum(d), 0)::float8 FROM runs
""".format(buckets=", ".join(f"count(*) FILTER (WHERE d <= {b})" for b in CYCLE_BUCKETS_S))

# Billing attempts per mode and outcome: append-only history, so the counts only grow.
BILLING_OUTCOMES = """
SELECT r.livemode, a.outcome, count(*)
FROM billing_billingattempt a JOIN billing_billingrun r ON r.id = a.run_id
GROUP BY r.livemode, a.outcome
"""

# Deliveries the executors could claim now (SPEC §6 claim predicate), not yet claimed.
DELIVERY_BACKLOG = """
SELECT count(*) FROM outbox_delivery
WHERE status IN ('pending', 'retrying') AND fire_after <= now()
  AND (claim_expires_at IS NULL OR claim_expires_at < now())
"""

DB_EPOCH = "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"


def role_intervals() -> dict[str, float]:
    """Configured role name → interval in seconds; empty (and logged) when the configuration is broken."""
    try:
        return {role.name: float(role.interval_s) for role in configured_roles()}
    except ImproperlyConfigured as exc:
        logger.warning(logfmt("roles_misconfigured", error=str(exc)))
        return {}


def measure_clock_skew_s() -> float:
    """This process's ``time.time()`` minus the database's ``clock_timestamp()``, in seconds.

    The app's reading is the midpoint of the round trip, so network latency does not count as skew.
    """
    with connection.cursor() as cursor:
        before = time.time()
        cursor.execute(DB_EPOCH)
        db_now = cursor.fetchone()[0]
        after = time.time()
    return (before + after) / 2 - db_now


def _rows(sql: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchall()


class HardcountCollector(Collector):
    """Yields the SPEC §8 metrics on each scrape (one short read-only transaction of a few queries).

    With ``close_connection`` the thread's database connection is closed after each scrape
    (for the throwaway threads of :func:`serve_metrics`). A database error skips the
    database metrics of that scrape and is logged; the scrape itself still succeeds.
    """

    def __init__(self, *, close_connection: bool = False) -> None:
        self.close_connection = close_connection

    def describe(self) -> Iterator[Metric]:
        # Names only: registration must not touch the database.
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        try:
            self._fill(families)
        except DatabaseError as exc:
            logger.warning(logfmt("metrics_db_error", error=type(exc).__name__, detail=str(exc)[:200]))
            # Leadership is this process's own state: still worth reporting without the database.
            families = {"is_leader": self._families()["is_leader"]}
            self._fill_leadership(families, role_intervals())
        finally:
            if self.close_connection:
                connection.close()
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {
            "last_run": GaugeMetricFamily(
                "hardcount_scheduler_last_run_timestamp_seconds",
                "When the role's last tick completed (Unix seconds, database clock).",
                labels=["role"],
            ),
            "tick_age": GaugeMetricFamily(
                "hardcount_leader_last_tick_age_seconds",
                "Age of the role's liveness stamp: its last completed tick or billing drain page.",
                labels=["role"],
            ),
            "is_leader": GaugeMetricFamily(
                "hardcount_leader_is_leader",
                "1 when a scheduler runtime in this process holds the role's lease.",
                labels=["role"],
            ),
            "due": GaugeMetricFamily(
                "hardcount_billing_due_subscriptions",
                "Wall-clock subscriptions due for billing now, excluding waiting and parked ones.",
                labels=["mode"],
            ),
            "oldest_due": GaugeMetricFamily(
                "hardcount_billing_oldest_due_age_seconds",
                "How long the oldest due subscription has been due (0 when none is).",
                labels=["mode"],
            ),
            "failing": GaugeMetricFamily(
                "hardcount_billing_failing_subscriptions",
                "Subscriptions with a saved billing failure: waiting on the retry ladder, or parked.",
                labels=["mode", "state"],
            ),
            "cycle": HistogramMetricFamily(
                "hardcount_billing_cycle_duration_seconds",
                "Durations of the scheduler's billing drains (billing runs), in seconds.",
            ),
            "outcomes": CounterMetricFamily(
                "hardcount_billing_invoices",
                "Subscriptions attempted by billing runs, by outcome (billed, declined, tax_pending, failed, skipped).",
                labels=["mode", "outcome"],
            ),
            "backlog": GaugeMetricFamily(
                "hardcount_outbox_deliveries_due_backlog",
                "Webhook deliveries due now and not claimed by an executor.",
            ),
            "skew": GaugeMetricFamily(
                "hardcount_clock_skew_seconds",
                "This process's clock minus the database's clock, in seconds (positive: the app is ahead).",
            ),
        }

    def _fill(self, families: dict[str, Metric]) -> None:
        intervals = role_intervals()
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = '5s'")
            leases = lease_statuses()
            due = {row[0]: row[1:] for row in _rows(DUE_SUBSCRIPTIONS)}
            failing = {row[0]: row[1:] for row in _rows(FAILING_SUBSCRIPTIONS)}
            cycle = _rows(CYCLE_DURATIONS)[0]
            outcomes = _rows(BILLING_OUTCOMES)
            backlog = _rows(DELIVERY_BACKLOG)[0][0]
        families["skew"].add_metric([], measure_clock_skew_s())

        for lease in leases:
            if lease.last_tick_at is not None:
                families["last_run"].add_metric([lease.role], lease.last_tick_at.timestamp())
            if lease.stamp_age_s is not None:
                families["tick_age"].add_metric([lease.role], lease.stamp_age_s)
        self._fill_leadership(families, intervals, [lease.role for lease in leases])

        for livemode, mode in MODES.items():
            count, oldest_age_s = due.get(livemode, (0, 0.0))
            families["due"].add_metric([mode], count)
            families["oldest_due"].add_metric([mode], oldest_age_s)
            waiting, parked = failing.get(livemode, (0, 0))
            families["failing"].add_metric([mode, "waiting"], waiting)
            families["failing"].add_metric([mode, "parked"], parked)

        cumulative = cycle[: len(CYCLE_BUCKETS_S)]
        total, total_s = cycle[len(CYCLE_BUCKETS_S)], cycle[len(CYCLE_BUCKETS_S) + 1]
        buckets = [(repr(b), n) for b, n in zip(CYCLE_BUCKETS_S, cumulative, strict=True)] + [("+Inf", total)]
        families["cycle"].add_metric([], buckets, total_s)

        for livemode, outcome, count in outcomes:
            families["outcomes"].add_metric([MODES[livemode], outcome], count)
        families["backlog"].add_metric([], backlog)

    @staticmethod
    def _fill_leadership(families: dict[str, Metric], intervals: dict[str, float], more: list[str] = ()) -> None:
        for role, leading in sorted(process_leadership([*intervals, *more]).items()):
            families["is_leader"].add_metric([role], 1 if leading else 0)


_install_lock = threading.Lock()
_installed: HardcountCollector | None = None


def install(*, close_connection: bool = False) -> HardcountCollector:
    """Register the collector in prometheus_client's default registry (once per process)."""
    global _installed  # noqa: PLW0603 - one collector per process registry
    with _install_lock:
        if _installed is None:
            import outbox.metrics  # noqa: F401 - registers the delivery attempts counter in this process

            _installed = HardcountCollector(close_connection=close_connection)
            REGISTRY.register(_installed)
        return _installed


def metrics_view(request):
    """``GET /metrics``: django-prometheus's exporter, with the SPEC §8 collector installed."""
    from django_prometheus.exports import ExportToDjangoView

    install()
    return ExportToDjangoView(request)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - a metrics port is meant to be scraped
    """Serve this process's metrics on ``addr:port`` from a background thread (``runscheduler --metrics-port``)."""
    install(close_connection=True)
    start_http_server(port, addr=addr, registry=REGISTRY)
