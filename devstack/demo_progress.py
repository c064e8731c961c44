"""``make run``'s demo book: seeded on first start, then watched until a drain has billed it.

``manage.py serve`` calls :meth:`DemoWatch.start` from its ``after_ready`` hook and
:meth:`DemoWatch.line` from its ``progress_line`` hook (every 5 s). The book's size is
``HARDCOUNT_DEMO_SUBSCRIPTIONS`` (default :data:`DEFAULT_DEMO_SUBSCRIPTIONS`; 0: no book),
written only when the demo tenant has no test-mode subscription yet (docs/decisions/0101-make-run-demo-book.md).

Every count is read from the database's rows each time, so a restarted ``serve`` prints the
same numbers, and the seed line, the progress line and the drain summary use one set of words
(docs/decisions/0131-dev-stack-resilience-and-first-run.md):

- **due**: subscriptions due now (:func:`billing.queries.due_condition`: the drain's own rule);
- **billed**: invoices that were closed, i.e. **paid** plus **declined** (open or uncollectible
  after a declined charge: in dunning) plus **tax pending** (drafts waiting on the tax provider);
  the drain counts the same outcomes as billed (:data:`billing.models.BillingAttempt.COUNTED_AS_BILLED`);
- **failed**: subscriptions on the retry ladder after a gateway failure (the close failed, the
  period did not advance), **parked** the ones it gave up on;
- deliveries to the demo's always-down endpoint (:data:`devstack.seed.FAILING_WEBHOOK_URL`) are
  counted apart from the others: they stay pending on purpose (retries, the circuit breaker).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Exists, OuterRef, Q

from billing.models import BillingAttempt, BillingRun, Invoice, PaymentAttempt, Subscription
from billing.queries import due_condition
from devstack.seed import FAILING_WEBHOOK_URL, seed_demo_book
from hardcount.times import database_now
from outbox.models import Delivery, WebhookEndpoint

DEFAULT_DEMO_SUBSCRIPTIONS = 2_000


def demo_subscriptions(environ=os.environ) -> int:
    """The demo book's size from ``HARDCOUNT_DEMO_SUBSCRIPTIONS`` (default 2,000; 0 or less: no book)."""
    try:
        return max(0, int(environ.get("HARDCOUNT_DEMO_SUBSCRIPTIONS", DEFAULT_DEMO_SUBSCRIPTIONS)))
    except ValueError:
        return DEFAULT_DEMO_SUBSCRIPTIONS


@dataclass(frozen=True)
class Progress:
    """The demo tenant's test-mode book now (the words of the module docstring); counts of rows."""

    due: int
    paid: int
    declined: int
    tax_pending: int
    failed: int
    parked: int
    delivered: int
    deliveries_pending: int
    deliveries_failed: int
    down_pending: int = 0
    down_failed: int = 0
    down_circuit_open: bool | None = None  # None: the tenant has no always-down endpoint

    @property
    def billed(self) -> int:
        """Invoices closed: paid + declined + tax pending."""
        return self.paid + self.declined + self.tax_pending

    def text(self) -> str:
        """``due … · billed … (paid …, declined …) · failed … · parked …``, then the deliveries on a second line."""
        tax = f", tax pending {self.tax_pending}" if self.tax_pending else ""
        billing = (
            f"due {self.due} · billed {self.billed} (paid {self.paid}, declined {self.declined}{tax}) · "
            f"failed {self.failed} (retry ladder) · parked {self.parked}"
        )
        webhooks = f"{self.delivered} delivered, {self.deliveries_pending} pending, {self.deliveries_failed} failed"
        if self.down_circuit_open is not None:
            circuit = "open" if self.down_circuit_open else "closed"
            webhooks += (
                f" · always-down demo endpoint {self.down_pending} pending, {self.down_failed} failed, "
                f"circuit {circuit}"
            )
        return f"{billing}\nwebhooks {webhooks}"


def read_progress(tenant_id: str) -> Progress:
    """The counts of the progress line for ``tenant_id``'s test mode. Raises ``DatabaseError``."""
    now = database_now()
    subs = Subscription.objects.filter(tenant_id=tenant_id, livemode=False)
    due = subs.filter(due_condition(test_clock_id=None, as_of=None)).count()
    ladder = subs.aggregate(
        failed=Count("id", filter=Q(billing_parked_at__isnull=True, next_billing_attempt_at__isnull=False)),
        parked=Count("id", filter=Q(billing_parked_at__isnull=False)),
    )
    declined_charge = PaymentAttempt.objects.filter(invoice=OuterRef("pk"), outcome=PaymentAttempt.DECLINED)
    invoices = (
        Invoice.objects.filter(tenant_id=tenant_id, livemode=False)
        .exclude(status=Invoice.VOID)
        .alias(was_declined=Exists(declined_charge))
        .aggregate(
            paid=Count("id", filter=Q(status=Invoice.PAID)),
            declined=Count("id", filter=Q(status__in=(Invoice.OPEN, Invoice.UNCOLLECTIBLE), was_declined=True)),
            tax_pending=Count("id", filter=Q(status=Invoice.DRAFT, tax_status=Invoice.TAX_PENDING)),
        )
    )
    down = Q(endpoint__url=FAILING_WEBHOOK_URL)
    deliveries = Delivery.objects.filter(event__tenant_id=tenant_id, event__livemode=False).aggregate(
        delivered=Count("id", filter=~down & Q(status=Delivery.SUCCEEDED)),
        pending=Count("id", filter=~down & Q(status__in=(Delivery.PENDING, Delivery.RETRYING))),
        failed=Count("id", filter=~down & Q(status=Delivery.FAILED)),
        down_pending=Count("id", filter=down & Q(status__in=(Delivery.PENDING, Delivery.RETRYING))),
        down_failed=Count("id", filter=down & Q(status=Delivery.FAILED)),
    )
    endpoint = (
        WebhookEndpoint.objects.filter(tenant_id=tenant_id, livemode=False, url=FAILING_WEBHOOK_URL)
        .order_by("-created_at")
        .values("circuit_open_until")
        .first()
    )
    circuit_open = None
    if endpoint is not None:
        circuit_open = endpoint["circuit_open_until"] is not None and endpoint["circuit_open_until"] > now
    return Progress(
        due=due,
        paid=invoices["paid"],
        declined=invoices["declined"],
        tax_pending=invoices["tax_pending"],
        failed=ladder["failed"],
        parked=ladder["parked"],
        delivered=deliveries["delivered"],
        deliveries_pending=deliveries["pending"],
        deliveries_failed=deliveries["failed"],
        down_pending=deliveries["down_pending"],
        down_failed=deliveries["down_failed"],
        down_circuit_open=circuit_open,
    )


def first_drain_since(since: datetime) -> BillingRun | None:
    """The first test-mode scheduler drain that started at or after ``since`` and ran to its end, if any.

    An abandoned drain (its process died) is not the end: its successor goes on with the book.
    """
    return (
        BillingRun.objects.filter(
            trigger=BillingRun.SCHEDULER,
            livemode=False,
            started_at__gte=since,
            status__in=(BillingRun.COMPLETED, BillingRun.FAILED),
        )
        .order_by("started_at")
        .first()
    )


@dataclass(frozen=True)
class DrainSummary:
    """What the drains of a watch did to one tenant's book, from their ``BillingAttempt`` rows."""

    status: str
    attempted: int
    paid: int
    declined: int
    tax_pending: int
    failed: int
    duration_s: float

    @property
    def billed(self) -> int:
        """Closes counted as billed: paid + declined + tax pending (as :class:`Progress` counts invoices)."""
        return self.paid + self.declined + self.tax_pending

    def text(self) -> str:
        tax = f", tax pending {self.tax_pending}" if self.tax_pending else ""
        return (
            f"{self.attempted} attempted, {self.billed} billed (paid {self.paid}, declined {self.declined}{tax}), "
            f"{self.failed} failed (retry ladder) in {self.duration_s:.1f} s"
        )


def drain_summary(tenant_id: str, run: BillingRun, *, since: datetime) -> DrainSummary:
    """The attempts on ``tenant_id``'s book by ``run`` and by the drains that ended after ``since`` before it.

    A drain that had started before the seed committed may have billed part of the book, and
    an abandoned one (its process killed) part of it before its successor: they count too.
    Raises ``DatabaseError``.
    """
    runs = BillingRun.objects.filter(
        trigger=BillingRun.SCHEDULER, livemode=False, finished_at__gte=since, started_at__lte=run.started_at
    ).exclude(status=BillingRun.RUNNING)
    first = runs.order_by("started_at").values_list("started_at", flat=True).first() or run.started_at
    counts = BillingAttempt.objects.filter(run__in=runs, subscription__tenant_id=tenant_id).aggregate(
        attempted=Count("id"),
        paid=Count("id", filter=Q(outcome=BillingAttempt.BILLED)),
        declined=Count("id", filter=Q(outcome=BillingAttempt.DECLINED)),
        tax_pending=Count("id", filter=Q(outcome=BillingAttempt.TAX_PENDING)),
        failed=Count("id", filter=Q(outcome=BillingAttempt.FAILED)),
    )
    finished = run.finished_at or run.started_at
    return DrainSummary(status=run.status, duration_s=(finished - first).total_seconds(), **counts)


class DemoWatch:
    """Seeds the demo book on first start and reports on it until (and after) a drain has billed it.

    ``write`` prints a line; ``done_lines()`` gives the lines printed once the watched drain has
    ended (the admin URL and login). Every method that reads the database raises
    ``DatabaseError`` when it fails; ``serve`` retries them.
    """

    def __init__(self, tenant_id: str, *, write: Callable[[str], None], done_lines: Callable[[], list[str]]):
        self.tenant_id = tenant_id
        self.write = write
        self.done_lines = done_lines
        self.since: datetime | None = None
        self.started_monotonic = time.monotonic()
        self.seeded = False
        self.drained = False
        self._last = ""

    def start(self, *, webhook_url: str | None, subscriptions: int | None = None) -> bool:
        """Seed the book unless the tenant has one (or the size is 0); True when a book was seeded now.

        Without a new book the watch waits for a drain only while something is due (a stack
        stopped mid-drain); otherwise it reports only changes.
        """
        subscriptions = demo_subscriptions() if subscriptions is None else subscriptions
        self.since = database_now()
        self.started_monotonic = time.monotonic()
        has_book = Subscription.objects.filter(tenant_id=self.tenant_id, livemode=False).exists()
        if not subscriptions or has_book:
            self.drained = not (
                has_book
                and Subscription.objects.filter(
                    due_condition(test_clock_id=None, as_of=None), tenant_id=self.tenant_id, livemode=False
                ).exists()
            )
            return False
        self.write(f"Seeding the demo book: {subscriptions} subscriptions (HARDCOUNT_DEMO_SUBSCRIPTIONS)…")
        started = time.perf_counter()
        summary = seed_demo_book(tenant_id=self.tenant_id, subscriptions=subscriptions, webhook_url=webhook_url)
        self.since = database_now()
        self.started_monotonic = time.monotonic()
        self.seeded = True
        self.write(
            f"  seeded in {time.perf_counter() - started:.1f} s: {summary.due} due now ({summary.due_declining} with a "
            f"card that declines, {summary.due_failing} with one that fails at the gateway), {summary.trialing} "
            f"trialing, {summary.credit_balances} credit balances; the billing loop picks them up on its next tick."
        )
        return True

    def line(self) -> str | None:
        """The progress line, or None when nothing changed since the last one once the drain has ended."""
        if self.since is None:
            return None
        # The run before the counts: once it has ended, the counts include all it did.
        run = None if self.drained else first_drain_since(self.since)
        text = read_progress(self.tenant_id).text()
        if not self.drained:
            if run is None:
                self._last = text
                return f"billing  {text}"
            summary = drain_summary(self.tenant_id, run, since=self.since)
            self.drained = True
            elapsed = time.monotonic() - self.started_monotonic
            label = "First drain" if self.seeded else "Drain"
            lines = [
                f"billing  {text}",
                f"{label} {summary.status}: {summary.text()} ({elapsed:.0f} s after start).",
                *self.done_lines(),
            ]
            self._last = text
            return "\n".join(lines)
        if text == self._last:
            return None
        self._last = text
        return f"billing  {text}"
