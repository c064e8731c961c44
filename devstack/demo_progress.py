"""``make run``'s demo book: seeded on first start, then watched until the first drain has billed it.

``manage.py serve`` calls :meth:`DemoWatch.start` from its ``after_ready`` hook and
:meth:`DemoWatch.line` from its ``progress_line`` hook (every 5 s). The book's size is
``HARDCOUNT_DEMO_SUBSCRIPTIONS`` (default :data:`DEFAULT_DEMO_SUBSCRIPTIONS`; 0: no book),
written only when the demo tenant has no test-mode subscription yet (docs/decisions/0101-make-run-demo-book.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import Count, Q

from billing.models import BillingAttempt, BillingRun, Invoice, Subscription
from devstack.seed import seed_demo_book
from hardcount.times import database_now
from outbox.models import Delivery

DEFAULT_DEMO_SUBSCRIPTIONS = 2_000
# How many deliveries the local receiver logs one by one once a book is seeded; the rest are counted.
RECEIVER_LOG_FIRST = 10


def demo_subscriptions(environ=os.environ) -> int:
    """The demo book's size from ``HARDCOUNT_DEMO_SUBSCRIPTIONS`` (default 2,000; 0 or less: no book)."""
    try:
        return max(0, int(environ.get("HARDCOUNT_DEMO_SUBSCRIPTIONS", DEFAULT_DEMO_SUBSCRIPTIONS)))
    except ValueError:
        return DEFAULT_DEMO_SUBSCRIPTIONS


@dataclass(frozen=True)
class Progress:
    """The demo tenant's test-mode book right now: subscriptions by billing state, invoices, deliveries."""

    due: int
    invoices: int
    paid: int
    open: int
    failed: int
    waiting: int
    parked: int
    delivered: int
    deliveries_pending: int
    deliveries_failed: int

    def text(self) -> str:
        return (
            f"due {self.due} · billed {self.invoices} (paid {self.paid}, open {self.open}) · failed {self.failed} · "
            f"waiting {self.waiting} · parked {self.parked} · deliveries {self.delivered} delivered, "
            f"{self.deliveries_pending} pending, {self.deliveries_failed} failed"
        )


def read_progress(tenant_id: str, *, since: datetime) -> Progress:
    """Counts for the progress line; ``failed``: closes that failed since ``since``."""
    subs = Subscription.objects.filter(tenant_id=tenant_id, livemode=False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0]
    states = subs.aggregate(
        due=Count(
            "id",
            filter=Q(
                status__in=Subscription.BILLABLE_STATUSES,
                test_clock__isnull=True,
                billing_parked_at__isnull=True,
                next_billing_at__lte=now,
            )
            & (Q(next_billing_attempt_at__isnull=True) | Q(next_billing_attempt_at__lte=now)),
        ),
        waiting=Count("id", filter=Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=False)),
        parked=Count("id", filter=Q(billing_parked_at__isnull=False)),
    )
    invoices = (
        Invoice.objects.filter(tenant_id=tenant_id, livemode=False)
        .exclude(status=Invoice.VOID)
        .aggregate(
            total=Count("id"),
            paid=Count("id", filter=Q(status=Invoice.PAID)),
            open=Count("id", filter=Q(status=Invoice.OPEN)),
        )
    )
    failed = BillingAttempt.objects.filter(
        subscription__tenant_id=tenant_id, outcome=BillingAttempt.FAILED, created_at__gte=since
    ).count()
    deliveries = Delivery.objects.filter(event__tenant_id=tenant_id, event__livemode=False).aggregate(
        delivered=Count("id", filter=Q(status=Delivery.SUCCEEDED)),
        pending=Count("id", filter=Q(status__in=(Delivery.PENDING, Delivery.RETRYING))),
        failed=Count("id", filter=Q(status=Delivery.FAILED)),
    )
    return Progress(
        due=states["due"],
        invoices=invoices["total"],
        paid=invoices["paid"],
        open=invoices["open"],
        failed=failed,
        waiting=states["waiting"],
        parked=states["parked"],
        delivered=deliveries["delivered"],
        deliveries_pending=deliveries["pending"],
        deliveries_failed=deliveries["failed"],
    )


def first_drain_since(since: datetime) -> BillingRun | None:
    """The first test-mode scheduler drain that started at or after ``since`` and has ended, if any."""
    return (
        BillingRun.objects.filter(trigger=BillingRun.SCHEDULER, livemode=False, started_at__gte=since)
        .exclude(status=BillingRun.RUNNING)
        .order_by("started_at")
        .first()
    )


class DemoWatch:
    """Seeds the demo book on first start and reports on it until (and after) the first drain.

    ``write`` prints a line; ``done_lines()`` gives the lines printed once the first drain has
    ended (the admin URL and login).
    """

    def __init__(self, tenant_id: str, *, write: Callable[[str], None], done_lines: Callable[[], list[str]]):
        self.tenant_id = tenant_id
        self.write = write
        self.done_lines = done_lines
        self.since: datetime | None = None
        self.started_monotonic = time.monotonic()
        self.drained = False
        self._last = ""

    def start(self, *, webhook_url: str | None, subscriptions: int | None = None) -> bool:
        """Seed the book unless the tenant has one (or the size is 0); True when a book was seeded now."""
        subscriptions = demo_subscriptions() if subscriptions is None else subscriptions
        self.since = database_now()
        self.started_monotonic = time.monotonic()
        if not subscriptions or Subscription.objects.filter(tenant_id=self.tenant_id, livemode=False).exists():
            return False
        self.write(f"Seeding the demo book: {subscriptions} subscriptions (HARDCOUNT_DEMO_SUBSCRIPTIONS)…")
        started = time.perf_counter()
        summary = seed_demo_book(tenant_id=self.tenant_id, subscriptions=subscriptions, webhook_url=webhook_url)
        self.since = database_now()
        self.started_monotonic = time.monotonic()
        self.write(
            f"  seeded in {time.perf_counter() - started:.1f} s: {summary.due} due now, {summary.trialing} trialing, "
            f"{summary.declining_cards} cards that decline, {summary.failing_cards} that fail at the gateway, "
            f"{summary.credit_balances} credit balances; the billing loop picks them up on its next tick."
        )
        return True

    def line(self) -> str | None:
        """The progress line, or None when nothing changed since the last one after the first drain."""
        if self.since is None:
            return None
        progress = read_progress(self.tenant_id, since=self.since)
        text = progress.text()
        if not self.drained:
            run = first_drain_since(self.since)
            if run is None:
                self._last = text
                return f"billing  {text}"
            self.drained = True
            elapsed = time.monotonic() - self.started_monotonic
            duration = (run.finished_at - run.started_at).total_seconds() if run.finished_at else 0.0
            lines = [
                f"billing  {text}",
                f"First drain {run.status}: {run.attempted} attempted, {run.billed} billed, {run.failed} failed in "
                f"{duration:.1f} s ({elapsed:.0f} s after start).",
                *self.done_lines(),
            ]
            self._last = text
            return "\n".join(lines)
        if text == self._last:
            return None
        self._last = text
        return f"billing  {text}"
