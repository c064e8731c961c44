"""Prometheus metrics the outbox itself updates (SPEC §8).

``hardcount_outbox_delivery_attempts_total{outcome}`` counts attempt rows as the executor
writes them, in the process that runs the executor. The backlog gauge
(``hardcount_outbox_deliveries_due_backlog``) describes the database and is computed at
scrape time from :func:`outbox.services.due_backlog`.
"""

from prometheus_client import Counter

DELIVERY_ATTEMPTS = Counter(
    "hardcount_outbox_delivery_attempts",
    "Webhook delivery attempts recorded, by outcome (succeeded, failed, retryable, lease_lost, canceled).",
    ["outcome"],
)
