"""Prometheus metrics of the outbox (docs/reference/metrics.md).

``hardcount_outbox_delivery_attempts_total{outcome}`` counts attempt rows as the executor and
the reaper write them, in the process that writes them. Under gunicorn it is kept in
prometheus_client's multiprocess mode, so every worker serves the sum over all workers of the
run; it is not counted from ``outbox_deliveryattempt`` because retention deletes those rows
(docs/decisions/0126-metrics-one-truth-per-scrape.md). The backlog gauge
(``hardcount_outbox_deliveries_due_backlog``) describes the database: :class:`OutboxMetrics`,
the provider outbox registers with the kernel's collector (:func:`hardcount.metrics.register_metrics`,
from ``OutboxConfig.ready()``), computes it at scrape time with :data:`DELIVERY_BACKLOG`
(docs/decisions/0021, 0121).
"""

from django.db import connection
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

DELIVERY_ATTEMPTS = Counter(
    "hardcount_outbox_delivery_attempts",
    "Webhook delivery attempts recorded, by outcome (succeeded, failed, retryable, lease_lost, canceled).",
    ["outcome"],
)
# Every outcome's series exists from the start, at 0, so a rate over it has a first sample.
# The outcomes of ``outbox.models.DeliveryAttempt.outcome``.
OUTCOMES = ("succeeded", "failed", "retryable", "lease_lost", "canceled")
for _outcome in OUTCOMES:
    DELIVERY_ATTEMPTS.labels(outcome=_outcome)

STREAM_IDS = Counter(
    "hardcount_outbox_stream_ids",
    "Delivery ids writers handed to the stream after commit (HARDCOUNT_DELIVERY_DISPATCH=nats), by result: "
    "published, or dropped (left to the executors' sweep).",
    ["result"],
)
for _result in ("published", "dropped"):
    STREAM_IDS.labels(result=_result)

# Deliveries the executors could claim now (the claim predicate of docs/reference/webhooks.md), not yet claimed.
DELIVERY_BACKLOG = """
SELECT count(*) FROM outbox_delivery
WHERE status IN ('pending', 'retrying') AND fire_after <= now()
  AND (claim_expires_at IS NULL OR claim_expires_at < now())
"""


def delivery_backlog() -> int:
    """Deliveries due now and not claimed (:data:`DELIVERY_BACKLOG`), on the caller's connection."""
    with connection.cursor() as cursor:
        cursor.execute(DELIVERY_BACKLOG)
        return cursor.fetchone()[0]


class OutboxMetrics:
    """The outbox family of a scrape: the delivery backlog."""

    def describe(self) -> list[Metric]:
        """The family, empty: touches no database."""
        return [self._backlog()]

    def collect(self) -> list[Metric]:
        """The family filled from the database (one statement on the caller's connection and transaction)."""
        backlog = self._backlog()
        backlog.add_metric([], delivery_backlog())
        return [backlog]

    @staticmethod
    def _backlog() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "hardcount_outbox_deliveries_due_backlog",
            "Webhook deliveries due now and not claimed by an executor.",
        )
