"""Pausing payment collection (docs/reference/billing.md#pausing-collection, docs/decisions/0144).

Against the real PostgreSQL and the strict dev Stripe: while paused nothing reaches the gateway (its
log), each period that comes due is invoiced once as the behavior says and advances, and a resume
(by hand, or at ``resumes_at`` on the wall clock or a test clock) bills the next period normally.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from billing.metrics import BillingMetrics
from billing.models import Invoice, PaymentAttempt, Subscription
from billing.queries import claim_due_page
from billing.services import drain as drain_module
from billing.services.close import close_subscription_period
from billing.services.drain import drain_due
from billing.services.page import prepare_page
from billing.services.pausing import update_pause_collection
from billing.services.payments import OutcomeKind, charging
from dunning.models import DunningRun
from hardcount.fencing import NO_FENCE
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import DECLINING_CARD, events
from tests.clocks.conftest import _advances_finish  # noqa: F401  (an advance may not outlive its test)
from tests.clocks.helpers import advance, make_clock, subscribe

DAY = timedelta(days=1)
START = datetime(2027, 1, 1, 9, tzinfo=UTC)
CHARGES = "POST /v1/payment_intents"


def _pause(sub, behavior: str, resumes_at: datetime | None = None) -> Subscription:
    return update_pause_collection(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        subscription_id=sub.id,
        pause_collection={"behavior": behavior, "resumes_at": resumes_at},
    )


def _resume(sub) -> Subscription:
    return update_pause_collection(
        tenant_id=sub.tenant_id, livemode=sub.livemode, subscription_id=sub.id, pause_collection=None
    )


def _invoices(sub) -> list[Invoice]:
    return list(Invoice.objects.filter(subscription_id=sub.id).order_by("period_start"))


# What each behavior leaves of a period invoiced while paused: (status, numbered).
EXPECTED = {
    "void": (Invoice.VOID, False),
    "mark_uncollectible": (Invoice.UNCOLLECTIBLE, True),
    "keep_as_draft": (Invoice.DRAFT, False),
}


@pytest.mark.parametrize("behavior", sorted(EXPECTED))
def test_two_periods_due_while_paused_are_invoiced_by_the_behavior_without_a_charge_then_resume_bills(
    book, tenant, stripe_proxy, behavior
):
    clock = make_clock(tenant, START)
    sub = subscribe(book, clock)
    clock = advance(clock, START + DAY)  # January: billed and charged
    assert [i.status for i in _invoices(sub)] == [Invoice.PAID]
    _pause(sub, behavior)
    stripe_proxy.clear()

    clock = advance(clock, datetime(2027, 3, 15, tzinfo=UTC))  # February and March come due while paused

    _january, february, march = _invoices(sub)
    status, numbered = EXPECTED[behavior]
    for invoice, start in (
        (february, datetime(2027, 2, 1, 9, tzinfo=UTC)),
        (march, datetime(2027, 3, 1, 9, tzinfo=UTC)),
    ):
        assert (invoice.period_start, invoice.status, invoice.number is not None) == (start, status, numbered)
        assert (invoice.amount_paid, invoice.attempt_count, invoice.created_at) == (0, 0, start)
        assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
    assert stripe_proxy.entries(CHARGES) == []  # nothing reached the gateway while paused
    sub.refresh_from_db()
    assert (sub.periods_billed, sub.next_billing_at, sub.status) == (
        3,
        datetime(2027, 4, 1, 9, tzinfo=UTC),
        Subscription.ACTIVE,
    )
    assert sub.billing_state == "paused"

    _resume(sub)
    advance(clock, datetime(2027, 4, 2, tzinfo=UTC))

    *_, april = _invoices(sub)
    assert (april.period_start, april.status, april.amount_paid) == (datetime(2027, 4, 1, 9, tzinfo=UTC), "paid", 1000)
    assert len(stripe_proxy.entries(CHARGES, "forwarded")) == 1  # April's one charge
    assert [i.status for i in _invoices(sub)[1:3]] == [status, status]  # resuming does not touch them
    assert len(_invoices(sub)) == 4  # each period once


def test_a_pause_with_resumes_at_on_a_test_clock_resumes_when_the_clock_passes_it(book, tenant, stripe_proxy):
    clock = make_clock(tenant, START)
    sub = subscribe(book, clock)
    clock = advance(clock, START + DAY)
    resumes_at = datetime(2027, 3, 10, tzinfo=UTC)
    _pause(sub, "keep_as_draft", resumes_at)
    stripe_proxy.clear()

    advance(clock, datetime(2027, 4, 2, tzinfo=UTC))

    statuses = [(i.period_start.month, i.status) for i in _invoices(sub)]
    assert statuses == [(1, "paid"), (2, "draft"), (3, "draft"), (4, "paid")]
    assert len(stripe_proxy.entries(CHARGES, "forwarded")) == 1
    sub.refresh_from_db()
    assert (sub.pause_collection_behavior, sub.pause_collection_resumes_at, sub.billing_state) == ("", None, "ok")
    (resumed,) = events("subscription.resumed", data__id=sub.id)
    assert resumed.created_at == resumes_at  # at the clock's instant, not when the next period came due
    assert resumed.data["previous_attributes"] == {
        "pause_collection": {"behavior": "keep_as_draft", "resumes_at": "2027-03-10T00:00:00Z"}
    }
    assert resumed.data["pause_collection"] is None


def test_a_period_that_began_before_resumes_at_stays_paused_when_the_drain_reaches_it_later(book, tenant, stripe_proxy):
    # Wall clock: the period began an hour ago, the pause ran out half an hour ago, the drain runs now.
    sub = book.subscribed(tenant)
    Subscription.objects.filter(pk=sub.pk).update(
        pause_collection_behavior="void", pause_collection_resumes_at=database_now() - timedelta(minutes=30)
    )

    drain_due(livemode=False, trigger="manual")

    (invoice,) = _invoices(sub)
    assert invoice.status == Invoice.VOID
    assert stripe_proxy.entries(CHARGES) == []
    sub.refresh_from_db()
    assert (sub.periods_billed, sub.pause_collection_behavior) == (1, "")
    assert [e.data["id"] for e in events("subscription.resumed")] == [sub.id]


@pytest.mark.parametrize("page_close", [True, False])
def test_the_drain_charges_no_paused_subscription_on_either_close_path(
    book, tenant, stripe_proxy, settings, page_close
):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page_close
    paused = [book.subscribed(tenant) for _ in range(3)]
    running = [book.subscribed(tenant) for _ in range(3)]
    for sub in paused:
        _pause(sub, "mark_uncollectible")

    run = drain_due(livemode=False, trigger="manual")

    assert (run.status, run.attempted, run.billed) == ("completed", 3, 3)  # the paused ones are no close's
    assert sorted(i.subscription_id for i in Invoice.objects.filter(status=Invoice.PAID)) == sorted(
        s.id for s in running
    )
    charged = {e.request.params["metadata[hardcount_invoice]"] for e in stripe_proxy.entries(CHARGES, "forwarded")}
    assert charged == {i.id for i in Invoice.objects.filter(status=Invoice.PAID)}
    for sub in paused:
        (invoice,) = _invoices(sub)
        assert invoice.status == Invoice.UNCOLLECTIBLE
        assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
        sub.refresh_from_db()
        assert sub.periods_billed == 1  # advanced once

    drain_due(livemode=False, trigger="manual")  # nothing is due any more: nothing changes
    assert Invoice.objects.count() == 6


def test_a_pause_between_the_claim_and_the_close_stops_the_charge_on_both_close_paths(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant)
    ((*claimed, _next_billing_at),) = claim_due_page(
        livemode=False, tenant_id=None, test_clock_id=None, as_of=None, page_size=10
    )
    claimed = tuple(claimed)
    _pause(sub, "void")

    with charging():
        prepared, _settled, others = prepare_page([claimed], as_of=None, test_clock_id=None, fence=NO_FENCE)
    assert (prepared, others) == ([], [claimed])  # the page close's lock asks the one due predicate
    outcome = close_subscription_period(sub.id, periods_billed=claimed[1], run=None)
    assert outcome.kind == OutcomeKind.SKIPPED  # and so does the per-close re-lock

    assert stripe_proxy.entries(CHARGES) == []
    assert not Invoice.objects.filter(subscription_id=sub.id).exists()


@pytest.mark.parametrize("page_close", [True, False])
def test_the_claim_itself_leaves_paused_periods_out(book, tenant, stripe_proxy, settings, monkeypatch, page_close):
    # Without the drain's pause step, the claim and both close paths alone must still charge nothing paused.
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page_close
    monkeypatch.setattr(drain_module.pausing, "collect_paused", lambda **kw: (0, 0))
    paused = book.subscribed(tenant)
    _pause(paused, "void")
    running = book.subscribed(tenant)

    run = drain_due(livemode=False, trigger="manual")

    assert (run.attempted, run.billed) == (1, 1)
    assert [i.subscription_id for i in Invoice.objects.all()] == [running.id]
    assert len(stripe_proxy.entries(CHARGES, "forwarded")) == 1


def test_dunning_does_not_retry_an_open_invoice_of_a_paused_subscription(book, tenant, stripe_proxy):
    clock = make_clock(tenant, START)
    sub = subscribe(book, clock, card=DECLINING_CARD)
    clock = advance(clock, START + DAY / 2)  # January declined: dunning retries on days 1, 3, 5, 7
    (january,) = _invoices(sub)
    assert january.status == Invoice.OPEN
    run = DunningRun.objects.get(invoice=january)
    _pause(sub, "void")
    stripe_proxy.clear()

    clock = advance(clock, START + 20 * DAY)

    assert stripe_proxy.entries("/v1/payment_intents") == []  # no retry reached the gateway while paused
    assert PaymentAttempt.objects.filter(invoice=january).count() == 1
    run.refresh_from_db()
    assert (run.status, run.retries_done) == (DunningRun.ACTIVE, 1)  # the claimed retry waits, none used up
    january.refresh_from_db()
    assert january.status == Invoice.OPEN

    _resume(sub)
    advance(clock, START + 23 * DAY)  # the run looks again a day later, and retries

    assert PaymentAttempt.objects.filter(invoice=january).count() == 2
    assert len(stripe_proxy.entries("/v1/payment_intents", "forwarded")) >= 1  # the retry went to the gateway


def test_metrics_health_and_the_billing_state_filter_count_paused_subscriptions_apart(book):
    acme = make_keys("Acme")
    paused = book.subscribed(acme.tenant)
    book.subscribed(acme.tenant)
    _pause(paused, "keep_as_draft")

    families = {f.name: f for f in BillingMetrics().collect()}
    samples = {s.labels["mode"]: s.value for s in families["hardcount_billing_paused_subscriptions"].samples}
    assert samples == {"test": 1, "live": 0}
    due = {s.labels["mode"]: s.value for s in families["hardcount_billing_due_subscriptions"].samples}
    assert due["test"] == 1  # the paused one's period is not due for a charge

    ready = Client().get("/health/ready").json()
    assert ready["billing"]["paused_subscriptions"] == {"live": 0, "test": 1}

    status, listed = Api(acme.test).get("/v1/subscriptions", {"billing_state": "paused"})
    assert status == 200
    assert [s["id"] for s in listed["data"]] == [paused.id]
    status, ok = Api(acme.test).get("/v1/subscriptions", {"billing_state": "ok"})
    assert paused.id not in [s["id"] for s in ok["data"]] and len(ok["data"]) == 1


def test_pause_and_resume_through_the_api_with_events_and_previous_attributes(book):
    acme = make_keys("Acme")
    sub = book.subscribed(acme.tenant)
    api = Api(acme.test)
    resumes_at = int((database_now() + 10 * DAY).timestamp())

    status, body = api.post(
        f"/v1/subscriptions/{sub.id}", {"pause_collection": {"behavior": "void", "resumes_at": resumes_at}}
    )
    assert status == 200, body
    assert body["pause_collection"]["behavior"] == "void"
    assert datetime.fromisoformat(body["pause_collection"]["resumes_at"]).timestamp() == resumes_at
    assert body["billing_state"] == "paused"

    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"pause_collection": {"behavior": "keep_as_draft"}})
    assert (status, body["pause_collection"]) == (200, {"behavior": "keep_as_draft", "resumes_at": None})

    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"pause_collection": ""})
    assert (status, body["pause_collection"], body["billing_state"]) == (200, None, "ok")
    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"pause_collection": None})  # already running: no event
    assert (status, body["pause_collection"]) == (200, None)

    (paused,) = events("subscription.paused")
    assert paused.data["previous_attributes"] == {"pause_collection": None}
    (updated,) = events("subscription.updated", data__id=sub.id)
    assert updated.data["previous_attributes"]["pause_collection"]["behavior"] == "void"
    (resumed,) = events("subscription.resumed")
    assert resumed.data["previous_attributes"] == {
        "pause_collection": {"behavior": "keep_as_draft", "resumes_at": None}
    }


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"pause_collection": {"behavior": "forever"}}, "parameter_invalid", "pause_collection.behavior"),
        ({"pause_collection": {}}, "parameter_missing", "pause_collection.behavior"),
        ({"pause_collection": {"behavior": "void", "until": 1}}, "parameter_unknown", "pause_collection.until"),
        (
            {"pause_collection": {"behavior": "void", "resumes_at": 1}},
            "resumes_at_in_past",
            "pause_collection.resumes_at",
        ),
        (
            {"pause_collection": {"behavior": "void", "resumes_at": "soon"}},
            "parameter_invalid",
            "pause_collection.resumes_at",
        ),
        (
            {"pause_collection": {"behavior": "void", "resumes_at": True}},
            "parameter_invalid",
            "pause_collection.resumes_at",
        ),
        ({"pause_collection": "void"}, "parameter_invalid", "pause_collection"),
        ({"pause": {"behavior": "void"}}, "parameter_unknown", "pause"),
    ],
)
def test_bad_pause_input_is_a_422_and_changes_nothing(book, body, code, param):
    acme = make_keys("Acme")
    sub = book.subscribed(acme.tenant)
    before = Subscription.objects.get(pk=sub.pk)

    status, answer = Api(acme.test).post(f"/v1/subscriptions/{sub.id}", body)

    assert status == 422, answer
    assert (answer["error"]["code"], answer["error"]["param"]) == (code, param)
    after = Subscription.objects.get(pk=sub.pk)
    assert (after.pause_collection_behavior, after.pause_collection_resumes_at, after.updated_at) == (
        before.pause_collection_behavior,
        before.pause_collection_resumes_at,
        before.updated_at,
    )
    assert events("subscription.paused") == []


def test_pausing_a_canceled_subscription_is_a_422_and_another_tenants_a_404(book):
    acme, globex = make_keys("Acme"), make_keys("Globex")
    sub = book.subscribed(acme.tenant)
    Subscription.objects.filter(pk=sub.pk).update(status=Subscription.CANCELED, next_billing_at=None)
    body = {"pause_collection": {"behavior": "void"}}

    status, answer = Api(acme.test).post(f"/v1/subscriptions/{sub.id}", body)
    assert (status, answer["error"]["code"]) == (422, "subscription_canceled")
    status, answer = Api(globex.test).post(f"/v1/subscriptions/{sub.id}", body)
    assert (status, answer["error"]["code"]) == (404, "resource_missing")
    assert Subscription.objects.get(pk=sub.pk).pause_collection_behavior == ""
    assert events("subscription.paused") == []


def test_the_reconciler_leaves_a_tax_pending_draft_of_a_paused_subscription_until_it_resumes(
    book, tenant, stripe_proxy, settings
):
    from billing.services.drain import reconcile

    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.DownTaxProvider"
    sub = book.subscribed(tenant)
    drain_due(livemode=False, trigger="manual")  # tax down: the period's invoice waits as a pending draft
    (draft,) = _invoices(sub)
    assert (draft.status, draft.tax_status) == (Invoice.DRAFT, Invoice.TAX_PENDING)
    _pause(sub, "void")
    settings.HARDCOUNT_TAX_PROVIDER = "tests.billing.fakes.TenPercentTaxProvider"

    reconcile(livemode=False)

    draft.refresh_from_db()
    assert (draft.status, draft.tax_status) == (Invoice.DRAFT, Invoice.TAX_PENDING)
    assert stripe_proxy.entries(CHARGES) == []

    _resume(sub)
    reconcile(livemode=False)

    draft.refresh_from_db()
    assert draft.status == Invoice.PAID  # finalised and charged once collection runs again
    assert len(stripe_proxy.entries(CHARGES, "forwarded")) == 1


@pytest.mark.parametrize("behavior", sorted(EXPECTED))
def test_a_pending_invoice_item_waits_out_the_pause_for_the_first_invoice_that_is_collected(
    book, tenant, stripe_proxy, behavior
):
    from billing.models import InvoiceItem
    from billing.services.invoice_items import create_invoice_item

    clock = make_clock(tenant, START)
    sub = subscribe(book, clock)
    clock = advance(clock, START + DAY)  # January: billed and charged
    _pause(sub, behavior)
    item = create_invoice_item(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        amount=250,
        currency="usd",
        description="Setup fee",
        subscription_id=sub.id,
    )

    clock = advance(clock, datetime(2027, 2, 15, tzinfo=UTC))  # February comes due while paused
    item.refresh_from_db()
    assert item.invoice_id is None  # an invoice that is never collected does not take it

    _resume(sub)
    advance(clock, datetime(2027, 3, 2, tzinfo=UTC))
    *_, march = _invoices(sub)
    item.refresh_from_db()
    assert (item.invoice_id, march.status, march.amount_paid) == (march.id, "paid", 1000 + 250)
    assert InvoiceItem.objects.filter(pk=item.pk, invoice__isnull=False).count() == 1


def test_a_change_scheduled_for_the_period_end_applies_at_the_boundary_while_collection_is_paused(
    book, tenant, stripe_proxy
):
    # 3 × 1,000 scheduled down to 1 × 1,000 plus a 2,500 item at February's start, then paused
    # (mark_uncollectible, so February's invoice keeps its lines): February bills 1,000 + 2,500 = 3,500 uncollected,
    # and after the resume March charges the same 3,500. Without the change applied at the boundary February would
    # bill 3,000 and the schedule would wait for the first collected period.
    from billing.models import SubscriptionItem
    from billing.services.catalog import create_price, create_subscription
    from billing.services.changes import change_subscription

    clock = make_clock(tenant, START)
    customer = book.customer(tenant, clock=clock)
    seat = create_price(tenant_id=tenant.id, livemode=False, amount=1000, currency="usd", interval="month")
    addon = create_price(tenant_id=tenant.id, livemode=False, amount=2500, currency="usd", interval="month")
    sub = create_subscription(
        tenant_id=tenant.id, livemode=False, customer_id=customer.id, items=[{"price": seat.id, "quantity": 3}]
    )
    clock = advance(clock, START + DAY)  # January: 3,000 charged
    assert _invoices(sub)[0].amount_paid == 3000
    (seats,) = SubscriptionItem.objects.filter(subscription=sub)
    change_subscription(
        tenant_id=sub.tenant_id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": seats.id, "quantity": 1}, {"price": addon.id}],
        effective_at="period_end",
    )
    _pause(sub, "mark_uncollectible")
    stripe_proxy.clear()

    clock = advance(clock, datetime(2027, 2, 15, tzinfo=UTC))

    _january, february = _invoices(sub)
    assert [(line.quantity, line.amount) for line in february.lines.order_by("id")] == [(1, 1000), (1, 2500)]
    assert (february.total, february.status, february.amount_paid) == (3500, Invoice.UNCOLLECTIBLE, 0)
    sub.refresh_from_db()
    assert sub.scheduled_items is None
    assert sorted(SubscriptionItem.objects.filter(subscription=sub).values_list("quantity", "price__amount")) == [
        (1, 1000),
        (1, 2500),
    ]
    applied = [
        e for e in events("subscription.updated", data__id=sub.id) if "items" in e.data.get("previous_attributes", {})
    ]
    assert [e.data["previous_attributes"]["items"]["data"][0]["quantity"] for e in applied] == [3]
    assert stripe_proxy.entries(CHARGES) == []

    _resume(sub)
    advance(clock, datetime(2027, 3, 2, tzinfo=UTC))
    *_, march = _invoices(sub)
    assert (march.total, march.status, march.amount_paid) == (3500, "paid", 3500)


def test_a_period_marked_uncollectible_while_paused_records_the_discounted_debt(book, tenant, stripe_proxy):
    # 1,000 a month at 25 % off forever: February, invoiced while paused, is uncollectible for 750, not 1,000.
    from decimal import Decimal

    from billing.services import discounts

    clock = make_clock(tenant, START)
    sub = subscribe(book, clock, amount=1000)
    coupon = discounts.create_coupon(tenant_id=tenant.id, livemode=False, percent_off=Decimal("25"), duration="forever")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )
    clock = advance(clock, START + DAY)  # January: billed and charged, discounted
    _pause(sub, "mark_uncollectible")

    advance(clock, datetime(2027, 2, 15, tzinfo=UTC))

    january, february = _invoices(sub)
    assert (january.status, january.total) == (Invoice.PAID, 750)
    assert (february.status, february.subtotal, february.total_discount, february.total) == (
        Invoice.UNCOLLECTIBLE,
        1000,
        250,
        750,
    )
    assert [line.discount_amount for line in february.lines.all()] == [250]


@pytest.mark.parametrize("behavior", [*sorted(EXPECTED), ""])
def test_an_always_invoice_change_while_paused_is_settled_by_the_behavior_and_never_charged(
    book, tenant, stripe_proxy, behavior
):
    # Mid-January, 1,000 a month moves to 2,000 with always_invoice while collection is paused: the change's own
    # invoice (the net proration, about half of the 1,000 difference) is settled as a paused period's would be,
    # and nothing reaches the gateway. Without the pause it is charged at once (the negative control below).
    from billing.models import SubscriptionItem
    from billing.services.catalog import create_price
    from billing.services.changes import change_subscription

    clock = make_clock(tenant, START)
    sub = subscribe(book, clock)
    clock = advance(clock, START + DAY)
    clock = advance(clock, datetime(2027, 1, 16, 21, tzinfo=UTC))
    pricier = create_price(tenant_id=tenant.id, livemode=False, amount=2000, currency="usd", interval="month")
    (item,) = SubscriptionItem.objects.filter(subscription=sub)
    if behavior:
        _pause(sub, behavior)
    stripe_proxy.clear()

    _sub, invoice = change_subscription(
        tenant_id=sub.tenant_id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": item.id, "price": pricier.id}],
        proration_behavior="always_invoice",
    )

    invoice.refresh_from_db()
    assert (invoice.billing_reason, invoice.total) == ("subscription_update", 500)  # 1,000 × 15.5 / 31 days
    if behavior:
        status, numbered = EXPECTED[behavior]
        assert (invoice.status, invoice.number is not None, invoice.amount_paid) == (status, numbered, 0)
        assert not PaymentAttempt.objects.filter(invoice=invoice).exists()
        assert stripe_proxy.entries(CHARGES) == []
    else:
        assert (invoice.status, invoice.amount_paid) == ("paid", 500)
        assert len(stripe_proxy.entries(CHARGES, "forwarded")) == 1
