"""The page close (billing.services.page) writes what the per-close path writes, in a few statements a page.

The reference is the per-close path (``HARDCOUNT_BILLING_PAGE_CLOSE`` off): the same demo book is
seeded for two tenants, one drained each way, and everything the drains wrote is compared once
ids, gateway ids and wall-clock times are set aside. The demo book has trials, credit balances,
declining cards (dunning), cards that fail at the gateway (the retry ladder), cards in JPY and EUR,
anchors on the 29th to 31st with two periods due: closes of every kind, in the same pages. Both books
get the same discounts (:func:`_discount`): percent and amount coupons on subscriptions and customers,
repeating, forever and once (which the page close hands to the per-close path).
"""

import re
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext

from billing.models import (
    BillingAttempt,
    BillingRun,
    Coupon,
    Customer,
    Discount,
    Invoice,
    InvoiceLineItem,
    LedgerEntry,
    PaymentAttempt,
    Price,
    Subscription,
    SubscriptionItem,
)
from billing.services import page as page_module
from billing.services.drain import drain_due
from devstack.seed import seed_demo_book
from dunning.models import DunningRun
from hardcount.times import database_now, iso
from outbox.models import Delivery, Event, WebhookEndpoint

BOOK = 160
SEED = 7
# Event fields whose value is the time of the drain (the billing time, or the wall clock), or an invoice number
# (given in commit order, which parallel closes do not fix; the numbers are compared as a gapless set): compared as
# set or not.
VARYING_KEYS = {
    "number",
    "created",
    "finalized_at",
    "paid_at",
    "voided_at",
    "marked_uncollectible_at",
    "next_billing_attempt_at",
    "billing_parked_at",
    "next_payment_attempt",
    "canceled_at",
    "as_of",
    "started_at",
    "finished_at",
    "final_action_at",
    "next_attempt_at",
    "first_declined_at",
    "ended_at",
    "last_attempt_at",
    "schedule_anchor_at",
    # Signed over the invoice's id (billing/hosted.py): a signature no canonical name can stand for.
    "hosted_invoice_url",
    "invoice_pdf",
    "start",  # a discount's: the time it was applied, unless a period was due
    "end",
}
GATEWAY_ID = re.compile(r"\b(pi|cus|ch|pm)_[A-Za-z0-9]{8,}\b")


def _seed_two_books(settings):
    from hardcount.models import Tenant

    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    when = database_now() - timedelta(days=3, seconds=17)
    tenants = [Tenant.objects.create(name=name) for name in ("per close", "page close")]
    for tenant in tenants:
        seed_demo_book(tenant_id=tenant.id, subscriptions=BOOK, seed=SEED, now=when, webhook_url="http://127.0.0.1:9/")
        _discount(tenant)
    return tenants


def _discount(tenant):
    """The same discounts on a book: every fifth subscription 25 % for 3 months, the next one an amount off in its
    currency (more than the invoice in usd), every seventh customer 12.5 % forever, every eleventh subscription a
    once coupon."""
    from decimal import Decimal

    from billing.services import discounts

    def coupon(**terms):
        return discounts.create_coupon(tenant_id=tenant.id, livemode=False, **terms).id

    repeating = coupon(percent_off=Decimal("25"), duration="repeating", duration_in_months=3)
    forever = coupon(percent_off=Decimal("12.5"), duration="forever")
    amount_off = {
        currency: coupon(amount_off=amount, currency=currency, duration="forever")
        for currency, amount in (("usd", 5000), ("jpy", 150), ("eur", 250))
    }
    once = {currency: coupon(amount_off=99, currency=currency, duration="once") for currency in ("usd", "jpy", "eur")}
    for n, sub in enumerate(Subscription.objects.filter(tenant_id=tenant.id).select_related("price").order_by("id")):
        chosen = None
        if n % 5 == 0:
            chosen = repeating
        elif n % 5 == 1:
            chosen = amount_off[sub.price.currency]
        elif n % 11 == 4:
            chosen = once[sub.price.currency]
        if chosen:
            discounts.set_subscription_discount(
                tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=chosen
            )
        if n % 7 == 3:
            discounts.set_customer_discount(
                tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, coupon_id=forever
            )


class _Names:
    """Canonical names for one tenant's ids, so two books' rows can be compared."""

    def __init__(self, tenant_id):
        self.names = {}
        for label, model in (
            ("customer", Customer),
            ("price", Price),
            ("sub", Subscription),
            ("coupon", Coupon),
            ("discount", Discount),
        ):
            for n, pk in enumerate(
                model.objects.filter(tenant_id=tenant_id).order_by("id").values_list("id", flat=True)
            ):
                self.names[pk] = f"{label}{n}"
        for n, pk in enumerate(
            WebhookEndpoint.objects.filter(tenant_id=tenant_id).order_by("id").values_list("id", flat=True)
        ):
            self.names[pk] = f"endpoint{n}"
        for item in SubscriptionItem.objects.filter(tenant_id=tenant_id).order_by("id"):
            self.names[item.id] = f"item[{self.names[item.subscription_id]}/{self.names[item.price_id]}]"
        for invoice in Invoice.objects.filter(tenant_id=tenant_id).only("id", "subscription_id", "period_start"):
            self.names[invoice.id] = (
                f"invoice[{self.names[invoice.subscription_id]}@{invoice.period_start.isoformat()}]"
            )
        for line in InvoiceLineItem.objects.filter(invoice__tenant_id=tenant_id):
            self.names[line.id] = f"line[{self.names[line.invoice_id]}]"
        per_customer = Counter()
        for entry in LedgerEntry.objects.filter(tenant_id=tenant_id).order_by("id"):
            per_customer[entry.customer_id] += 1
            self.names[entry.id] = f"ledger[{self.names[entry.customer_id]}#{per_customer[entry.customer_id]}]"
        for attempt in PaymentAttempt.objects.filter(tenant_id=tenant_id):
            self.names[attempt.id] = f"attempt[{self.names[attempt.invoice_id]}#{attempt.attempt_number}]"
        for run in DunningRun.objects.filter(tenant_id=tenant_id):
            self.names[run.id] = f"dunning[{self.names[run.invoice_id]}]"
        for n, pk in enumerate(
            BillingRun.objects.filter(tenant_id=tenant_id).order_by("id").values_list("id", flat=True)
        ):
            self.names[pk] = f"run{n}"
        self.pattern = re.compile("|".join(re.escape(pk) for pk in sorted(self.names, key=len, reverse=True)))

    def text(self, value: str) -> str:
        value = self.pattern.sub(lambda m: self.names[m.group(0)], value)
        return GATEWAY_ID.sub(
            lambda m: f"<{m.group(1)}>" if not m.group(0).startswith("pm_card") else m.group(0), value
        )

    def data(self, value, key=None):
        if key in VARYING_KEYS:
            return value is not None
        if isinstance(value, dict):
            return {k: self.data(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.data(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        return value


def _snapshot(tenant_id) -> dict:
    """What the drains wrote for one tenant, in canonical names; wall-clock times reduced to set / not set."""
    names = _Names(tenant_id)
    subs = Subscription.objects.filter(tenant_id=tenant_id).order_by("id")
    invoices = Invoice.objects.filter(tenant_id=tenant_id).order_by("subscription_id", "period_start")
    events = Event.objects.filter(tenant_id=tenant_id).order_by("sequence")
    per_object = defaultdict(list)
    for event in events:
        per_object[names.text(event.data.get("id", ""))].append(event.type)
    return {
        "subscriptions": [
            (
                names.names[s.id],
                s.status,
                s.periods_billed,
                s.current_period_start,
                s.current_period_end,
                s.next_billing_at,
                s.billing_failure_count,
                s.next_billing_attempt_at is not None,
                s.billing_parked_at is not None,
                names.text(s.last_billing_error),
            )
            for s in subs
        ],
        "invoices": [
            (
                names.names[i.id],
                i.status,
                i.currency,
                i.period_end,
                i.subtotal,
                names.names.get(i.discount_id),
                i.total_discount,
                i.tax,
                i.tax_rate_bps,
                i.tax_status,
                i.credit_applied,
                i.total,
                i.amount_due,
                i.amount_paid,
                i.attempt_count,
                bool(i.payment_intent_id),
                i.finalized_at is not None,
                i.paid_at is not None,
                [
                    (
                        names.text(line.description),
                        names.names[line.price_id],
                        line.quantity,
                        line.amount,
                        line.discount_amount,
                    )
                    for line in i.lines.all()
                ],
            )
            for i in invoices
        ],
        "invoice numbers": sorted(int(n) for n in invoices.exclude(number=None).values_list("number", flat=True)),
        "payment attempts": sorted(
            (
                names.names[a.invoice_id],
                a.attempt_number,
                names.text(a.idempotency_key),
                a.payment_method,
                a.amount,
                a.currency,
                a.outcome,
                a.decline_code,
                names.text(a.error_message),
                a.http_status,
                a.settled_without_charge,
                bool(a.payment_intent_id),
            )
            for a in PaymentAttempt.objects.filter(tenant_id=tenant_id)
        ),
        "customers": [
            (names.names[c.id], c.credit_balance, c.currency, bool(c.gateway_customer_id), c.gateway_payment_method)
            for c in Customer.objects.filter(tenant_id=tenant_id).order_by("id")
        ],
        "ledger": sorted(
            (
                names.names[e.customer_id],
                e.amount,
                e.balance_after,
                e.reason,
                names.names.get(e.invoice_id),
                names.text(e.description),
            )
            for e in LedgerEntry.objects.filter(tenant_id=tenant_id)
        ),
        "billing attempts": sorted(
            (
                names.names[b.subscription_id],
                b.outcome,
                names.names.get(b.invoice_id),
                names.text(b.error),
                b.failure_number,
            )
            for b in BillingAttempt.objects.filter(run__tenant_id=tenant_id)
        ),
        "dunning runs": sorted(
            (names.names[d.invoice_id], d.status, d.retries_done, d.next_attempt_at is not None)
            for d in DunningRun.objects.filter(tenant_id=tenant_id)
        ),
        "events": sorted(repr(names.data({"type": e.type, "data": e.data})) for e in events),
        "events of each object, in order": dict(per_object),
        "deliveries": Counter(
            (names.names[endpoint_id], type_)
            for endpoint_id, type_ in Delivery.objects.filter(event__tenant_id=tenant_id).values_list(
                "endpoint_id", "event__type"
            )
        ),
    }


def _drain(tenant, **kw):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=50, **kw)


@pytest.mark.slow
def test_the_page_close_writes_what_the_per_close_path_writes(book, stripe_proxy, settings):
    per_close, page_close = _seed_two_books(settings)
    before = _snapshot(per_close.id)
    assert before == _snapshot(page_close.id)  # the same book twice

    settings.HARDCOUNT_BILLING_PAGE_CLOSE = False
    reference = _drain(per_close, concurrency=1)
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    run = _drain(page_close, concurrency=4)

    expected, got = _snapshot(per_close.id), _snapshot(page_close.id)
    assert (run.attempted, run.billed, run.failed) == (reference.attempted, reference.billed, reference.failed)
    assert run.billed > 100 and run.failed > 0  # plain closes and others, in the same pages
    kinds = Counter(a[6] for a in got["payment attempts"])
    assert kinds["succeeded"] > 100 and kinds["declined"] > 0 and kinds["error"] > 0, kinds
    assert sum(1 for e in got["ledger"] if e[3] == "applied_to_invoice") > 0  # credit applied in the page close
    assert sum(1 for a in got["payment attempts"] if a[10]) > 0  # invoices of 0 settled without a charge
    discounted = [i for i in got["invoices"] if i[6]]
    assert len(discounted) > 20 and len({i[5] for i in discounted}) > 10, discounted  # discounts of every kind
    for part in expected:
        assert got[part] == expected[part], part
    assert got["invoice numbers"] == list(range(1, len(got["invoice numbers"]) + 1))  # gapless


def _plain_book(book, tenant, count):
    customer_price = book.price(tenant, amount=2500)
    return [book.subscription(book.customer(tenant), customer_price) for _ in range(count)]


@pytest.mark.parametrize("page_close", [True, False])
def test_statements_per_close(book, tenant, settings, page_close):
    """The page close's point: a page of plain closes costs a few statements, not ~24 per close."""
    subs = _plain_book(book, tenant, 30)
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page_close
    with CaptureQueriesContext(connection) as queries:
        run = _drain(tenant, concurrency=1)  # one connection: every statement is captured

    assert run.billed == len(subs)
    per_close = len(queries.captured_queries) / len(subs)
    if page_close:
        assert per_close < 2, per_close
    else:
        assert per_close > 15, per_close  # the control: the per-close path, as measured
    assert set(Invoice.objects.values_list("status", flat=True)) == {"paid"}


@pytest.mark.parametrize("step", ["prepare", "record"])
def test_a_page_step_that_fails_hands_its_closes_to_the_per_close_path(book, tenant, settings, monkeypatch, step):
    subs = _plain_book(book, tenant, 12)
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    real = page_module.insert_models if step == "prepare" else page_module.update_models

    def fail_once(model, *args, **kw):
        if model in (Invoice, PaymentAttempt):
            raise OperationalError("injected: the page step loses its connection")
        return real(model, *args, **kw)

    monkeypatch.setattr(page_module, "insert_models" if step == "prepare" else "update_models", fail_once)
    run = _drain(tenant, concurrency=3)

    assert (run.attempted, run.billed, run.failed) == (12, 12, 0)
    per_period = Counter(Invoice.objects.values_list("subscription_id", "period_start"))
    assert len(per_period) == 12 and set(per_period.values()) == {1}
    assert [a.outcome for a in PaymentAttempt.objects.all()] == ["succeeded"] * 12  # one attempt each, none lost
    assert {s.id for s in subs} == set(Subscription.objects.filter(periods_billed=1).values_list("id", flat=True))
    numbers = sorted(int(n) for n in Invoice.objects.values_list("number", flat=True))
    assert numbers == list(range(1, 13))  # the rolled-back page gave its numbers back


def test_declined_first_charges_are_recorded_in_the_page_step_with_their_dunning_runs(
    book, tenant, settings, monkeypatch
):
    """A page's declines take its one step 3 too, not a transaction each; what they write is the per-close path's
    (the differential test above compares every row and event of a book with declines in it)."""
    from billing.services import close as close_module
    from tests.billing.conftest import DECLINING_CARD

    price = book.price(tenant, amount=2500)
    paying = [book.subscription(book.customer(tenant), price) for _ in range(4)]
    declining = [book.subscription(book.customer(tenant, card=DECLINING_CARD), price) for _ in range(4)]
    per_close_records = []
    real_record = close_module.record_outcome

    def counted(plan, result, **kw):
        per_close_records.append(result.outcome)
        return real_record(plan, result, **kw)

    monkeypatch.setattr(close_module, "record_outcome", counted)
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    run = _drain(tenant, concurrency=3)

    assert per_close_records == []  # without the page's decline path: four 'declined' here
    assert Counter(BillingAttempt.objects.filter(run=run).values_list("outcome", flat=True)) == {
        "billed": 4,
        "declined": 4,
    }
    for sub in declining:
        sub.refresh_from_db()
        invoice = Invoice.objects.get(subscription=sub)
        assert (sub.status, sub.periods_billed, invoice.status, invoice.attempt_count) == ("past_due", 1, "open", 1)
        dunning = DunningRun.objects.get(invoice=invoice)
        assert (dunning.status, dunning.retries_done, dunning.last_decline_code) == ("active", 0, "generic_decline")
        failed = Event.objects.get(type="invoice.payment_failed", data__id=invoice.id)
        assert failed.data["next_payment_attempt"] == iso(dunning.next_attempt_at)
        assert [e.type for e in Event.objects.filter(data__id=sub.id).order_by("sequence")][-2:] == [
            "subscription.past_due",
            "subscription.updated",
        ]
    assert {s.id for s in paying} == set(Subscription.objects.filter(status="active").values_list("id", flat=True))


def test_a_page_settles_invoices_of_nothing_in_its_first_step(book, tenant, settings, monkeypatch):
    """An invoice the customer's credit covers is paid without a call in step 1, with the page's other closes:
    no close of its own (as the per-close path would settle it; the differential test compares what is written)."""
    from billing.services import drain as drain_module
    from billing.services.ledger import grant_credit

    price = book.price(tenant, amount=2500)
    paying = [book.subscription(book.customer(tenant), price) for _ in range(3)]
    covered = [book.subscription(book.customer(tenant), price) for _ in range(3)]
    for sub in covered:
        grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=10_000)
    per_close = []
    real_close = drain_module.close_subscription_period

    def counted(subscription_id, **kw):
        per_close.append(subscription_id)
        return real_close(subscription_id, **kw)

    monkeypatch.setattr(drain_module, "close_subscription_period", counted)
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    run = _drain(tenant, concurrency=3)

    assert per_close == []  # without the page's settling: the three covered subscriptions here
    assert (run.attempted, run.billed, run.failed) == (6, 6, 0)
    for sub in covered:
        sub.refresh_from_db()
        invoice = Invoice.objects.get(subscription=sub)
        assert (invoice.status, invoice.total, invoice.credit_applied, invoice.amount_due) == ("paid", 2500, 2500, 0)
        assert (invoice.amount_paid, invoice.attempt_count) == (0, 0)
        (attempt,) = PaymentAttempt.objects.filter(invoice=invoice)
        assert (attempt.outcome, attempt.settled_without_charge, attempt.amount) == ("succeeded", True, 0)
        assert (sub.status, sub.periods_billed) == ("active", 1)
        assert [e.type for e in Event.objects.filter(data__id=invoice.id).order_by("sequence")] == [
            "invoice.created",
            "invoice.finalized",
            "invoice.paid",
        ]
        assert Customer.objects.get(pk=sub.customer_id).credit_balance == 10_000 - 2500
    assert Counter(
        PaymentAttempt.objects.filter(invoice__subscription__in=paying).values_list("outcome", flat=True)
    ) == {"succeeded": 3}
