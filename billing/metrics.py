"""billing's metrics on ``/metrics`` (docs/reference/metrics.md), computed from its tables at scrape time.

:class:`BillingMetrics` is the provider billing registers with the kernel's collector
(:func:`hardcount.metrics.register_metrics`, from ``BillingConfig.ready()``); the collector calls
:meth:`BillingMetrics.collect` inside its scrape transaction (docs/decisions/0021, 0121). The
operators' dashboard (:mod:`ops.dashboard`) reads the same statements, so the admin and
Prometheus never disagree.

- ``hardcount_billing_due_subscriptions{mode}``: wall-clock subscriptions due now, excluding waiting and parked ones.
- ``hardcount_billing_oldest_due_age_seconds{mode}``: how long the oldest of them has been due (0 when none).
- ``hardcount_billing_failing_subscriptions{mode,state}``: subscriptions with a saved billing failure,
  ``state="waiting"`` (on the retry ladder) or ``"parked"``.
- ``hardcount_billing_paused_subscriptions{mode}``: subscriptions of a billable status whose payment collection is
  paused (``pause_collection``), wall-clock and test-clock ones alike; the due gauge leaves their paused periods out.
- ``hardcount_billing_shard_due_subscriptions{mode,shard}`` and
  ``hardcount_billing_shard_oldest_due_age_seconds{mode,shard}``: the same two per billing shard (``shard`` is the
  shard's lease role, ``billing`` or ``billing:<index>``, :mod:`billing.shards`), so a shard whose leader is stuck
  shows apart from the others.
- ``hardcount_billing_cycle_duration_seconds``: histogram of scheduler drains' durations (billing runs).
- ``hardcount_billing_invoices_total{mode,outcome}``: subscriptions attempted by billing runs, by outcome
  (``billed``, ``declined``, ``tax_pending``, ``failed``, ``skipped``).
"""

from __future__ import annotations

from django.db import connection
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from billing.models.subscriptions import BILLABLE_STATUSES
from billing.queries import due_predicate
from billing.shards import SHARD_OF_SQL, configured_count, lease_role

MODES = {True: "live", False: "test"}
# Buckets of the billing cycle histogram, in seconds (a drain of nothing is milliseconds; a
# large book at the 1 h default interval may take many minutes).
CYCLE_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)

# Wall-clock subscriptions due now, per mode, and the oldest due time's age: the drain's own due
# predicate (billing.queries.due_predicate), so the gauge counts what the next drain would bill.
_DUE, _DUE_PARAMS = due_predicate(test_clock_id=None, as_of=None)
DUE_SUBSCRIPTIONS = f"""
SELECT livemode, count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(next_billing_at)), 0)::float8
FROM billing_subscription
WHERE {_DUE}
GROUP BY livemode
"""

# The same per mode and billing shard (billing.shards.SHARD_OF_SQL over the subscription's tenant; its %s is the count).
DUE_SUBSCRIPTIONS_BY_SHARD = f"""
SELECT livemode, {SHARD_OF_SQL.format(column="tenant_id")} AS shard, count(*),
       COALESCE(EXTRACT(EPOCH FROM now() - min(next_billing_at)), 0)::float8
FROM billing_subscription
WHERE {_DUE}
GROUP BY 1, 2
"""

# Subscriptions of a billable status with a saved billing failure, per mode: waiting on the ladder, or parked.
FAILING_SUBSCRIPTIONS = """
SELECT livemode,
       count(*) FILTER (WHERE billing_parked_at IS NULL),
       count(*) FILTER (WHERE billing_parked_at IS NOT NULL)
FROM billing_subscription
WHERE (next_billing_attempt_at IS NOT NULL OR billing_parked_at IS NOT NULL)
  AND status = ANY(%s::text[])
GROUP BY livemode
"""


# Subscriptions of a billable status with collection paused, per mode (the partial index subscription_paused_idx).
PAUSED_SUBSCRIPTIONS = """
SELECT livemode, count(*)
FROM billing_subscription
WHERE pause_collection_behavior <> ''
  AND status = ANY(%s::text[])
GROUP BY livemode
"""


def due_by_mode() -> dict[bool, tuple[int, float]]:
    """``{livemode: (due count, oldest due age in seconds)}`` for the modes that have any (caller's transaction)."""
    return {row[0]: row[1:] for row in _rows(DUE_SUBSCRIPTIONS, _DUE_PARAMS)}


def due_by_shard(count: int) -> dict[tuple[bool, int], tuple[int, float]]:
    """``{(livemode, shard index): (due count, oldest due age in seconds)}`` among ``count`` shards, for those that have
    any (caller's transaction)."""
    return {(row[0], row[1]): row[2:] for row in _rows(DUE_SUBSCRIPTIONS_BY_SHARD, [count, *_DUE_PARAMS])}


def failing_by_mode() -> dict[bool, tuple[int, int]]:
    """``{livemode: (waiting, parked)}`` for the modes that have any failing subscription (caller's transaction)."""
    return {row[0]: row[1:] for row in _rows(FAILING_SUBSCRIPTIONS, [list(BILLABLE_STATUSES)])}


def paused_by_mode() -> dict[bool, int]:
    """``{livemode: paused count}`` for the modes that have any paused subscription (caller's transaction)."""
    return {row[0]: row[1] for row in _rows(PAUSED_SUBSCRIPTIONS, [list(BILLABLE_STATUSES)])}


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


def _rows(sql: str, params: list[object] | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


class BillingMetrics:
    """The billing families of a scrape: due, oldest due, failing, paused, cycle durations, attempt outcomes."""

    def describe(self) -> list[Metric]:
        """The families, empty (names, help, labels): touches no database."""
        return list(self._families().values())

    def collect(self) -> list[Metric]:
        """The families filled from the database (six statements on the caller's connection and transaction)."""
        families = self._families()
        due = due_by_mode()
        shards = configured_count()
        due_in_shards = due_by_shard(shards)
        failing = failing_by_mode()
        paused = paused_by_mode()
        cycle = _rows(CYCLE_DURATIONS)[0]
        outcomes = _rows(BILLING_OUTCOMES)

        for livemode, mode in MODES.items():
            count, oldest_age_s = due.get(livemode, (0, 0.0))
            families["due"].add_metric([mode], count)
            families["oldest_due"].add_metric([mode], oldest_age_s)
            waiting, parked = failing.get(livemode, (0, 0))
            families["failing"].add_metric([mode, "waiting"], waiting)
            families["failing"].add_metric([mode, "parked"], parked)
            families["paused"].add_metric([mode], paused.get(livemode, 0))
            for index in range(shards):
                count, oldest_age_s = due_in_shards.get((livemode, index), (0, 0.0))
                families["shard_due"].add_metric([mode, lease_role(index, shards)], count)
                families["shard_oldest_due"].add_metric([mode, lease_role(index, shards)], oldest_age_s)

        cumulative = cycle[: len(CYCLE_BUCKETS_S)]
        total, total_s = cycle[len(CYCLE_BUCKETS_S)], cycle[len(CYCLE_BUCKETS_S) + 1]
        buckets = [(repr(b), n) for b, n in zip(CYCLE_BUCKETS_S, cumulative, strict=True)] + [("+Inf", total)]
        families["cycle"].add_metric([], buckets, total_s)

        for livemode, outcome, count in outcomes:
            families["outcomes"].add_metric([MODES[livemode], outcome], count)
        return list(families.values())

    def readiness(self) -> dict:
        """billing's part of ``/health/ready``: ``{"billing": {"paused_subscriptions": {"live": n, "test": n},
        "shards": {"count": n, "due_subscriptions": {<shard's lease role>: {"live": n, "test": n}}}}}``
        (two statements on the caller's connection and transaction)."""
        paused = paused_by_mode()
        shards = configured_count()
        due = due_by_shard(shards)
        due_subscriptions = {
            lease_role(index, shards): {mode: due.get((lm, index), (0, 0.0))[0] for lm, mode in MODES.items()}
            for index in range(shards)
        }
        return {
            "billing": {
                "paused_subscriptions": {mode: paused.get(lm, 0) for lm, mode in MODES.items()},
                "shards": {"count": shards, "due_subscriptions": due_subscriptions},
            }
        }

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {
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
            "shard_due": GaugeMetricFamily(
                "hardcount_billing_shard_due_subscriptions",
                "Wall-clock subscriptions due for billing now in each billing shard (its lease role).",
                labels=["mode", "shard"],
            ),
            "shard_oldest_due": GaugeMetricFamily(
                "hardcount_billing_shard_oldest_due_age_seconds",
                "How long the oldest due subscription of each billing shard has been due (0 when none is).",
                labels=["mode", "shard"],
            ),
            "failing": GaugeMetricFamily(
                "hardcount_billing_failing_subscriptions",
                "Subscriptions with a saved billing failure: waiting on the retry ladder, or parked.",
                labels=["mode", "state"],
            ),
            "paused": GaugeMetricFamily(
                "hardcount_billing_paused_subscriptions",
                "Subscriptions whose payment collection is paused: nothing is charged for them until it resumes.",
                labels=["mode"],
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
        }
