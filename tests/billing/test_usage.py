"""Usage-based billing: meters, meter events (idempotent, set-wise), metered prices billed in arrears by both
close paths, the grace window, and the charge models, each against hand-computed amounts."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections, transaction

from billing import queries
from billing.models import Invoice, MeterEvent, Price, Subscription, SubscriptionItem
from billing.queries import aggregate_usage
from billing.services import usage
from billing.services.catalog import cancel_subscription, create_price, create_subscription
from billing.services.close import close_subscription_period
from billing.services.drain import drain_due
from hardcount import tenancy
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events
from tests.clocks.helpers import advance, make_clock

DAY = timedelta(days=1)


@pytest.fixture
def acme(book):
    return make_keys("Acme")


@pytest.fixture(params=["page", "per_close"])
def page_close(request, settings):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = request.param == "page"
    return request.param


def _meter(tenant, formula="sum", event_name="api_calls", **kw):
    return usage.create_meter(
        tenant_id=tenant.id, livemode=False, display_name=event_name, event_name=event_name, formula=formula, **kw
    )


def _metered_price(tenant, meter, *, amount=0, **kw):
    return create_price(
        tenant_id=tenant.id,
        livemode=False,
        amount=amount,
        currency="usd",
        interval="month",
        nickname="API calls",
        recurring={"usage_type": "metered", "meter": meter.id},
        **kw,
    )


def _ingest(tenant, events):
    return usage.record_meter_events(tenant_id=tenant.id, livemode=False, events=events)


def _licensed_and_metered(tenant, customer, metered, *, amount):
    """A subscription of ``customer`` to a new licensed monthly price of ``amount`` cents and to ``metered``, one
    of each: returns ``(licensed price, subscription)``."""
    licensed = create_price(tenant_id=tenant.id, livemode=False, amount=amount, currency="usd", interval="month")
    sub = create_subscription(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=customer.id,
        items=[{"price": licensed.id, "quantity": 1}, {"price": metered.id, "quantity": 1}],
    )
    return licensed, sub


def _event(customer, value, at, identifier=None, name="api_calls", **payload):
    event = {"event_name": name, "payload": {"stripe_customer_id": customer.id, "value": str(value), **payload}}
    if at is not None:
        event["timestamp"] = int(at.timestamp())
    if identifier:
        event["identifier"] = identifier
    return event


GRADUATED = [
    {"up_to": 100, "unit_amount": 10, "flat_amount": 0},
    {"up_to": 1000, "unit_amount": 5, "flat_amount": 200},
    {"up_to": "inf", "unit_amount": 1, "flat_amount": 0},
]


# -- charge models (no database) ------------------------------------------------------------------------------


def _unsaved(**kw):
    return Price(amount=kw.pop("amount", 0), currency="usd", usage_type="metered", **kw)


def test_graduated_tiers_charge_each_tier_and_the_flat_amount_of_each_tier_reached():
    tiers = [{**t, "up_to": None if t["up_to"] == "inf" else t["up_to"]} for t in GRADUATED]
    price = _unsaved(billing_scheme="tiered", tiers_mode="graduated", tiers=tiers)
    # 1,500 units cross two boundaries: 100 × 10 + 900 × 5 + 200 flat + 500 × 1.
    assert usage.usage_amount(price, 1500) == 1000 + 4500 + 200 + 500 == 6200
    assert usage.usage_amount(price, 100) == 1000  # the first tier only: no flat of the second
    assert usage.usage_amount(price, 101) == 1000 + 5 + 200
    assert usage.usage_amount(price, 0) == 0


def test_volume_tiers_price_every_unit_at_the_tier_of_the_whole_quantity_with_usage_exactly_at_up_to():
    tiers = [
        {"up_to": 100, "unit_amount": 10, "flat_amount": 0},
        {"up_to": 1000, "unit_amount": 5, "flat_amount": 300},
        {"up_to": None, "unit_amount": 2, "flat_amount": 0},
    ]
    price = _unsaved(billing_scheme="tiered", tiers_mode="volume", tiers=tiers)
    assert usage.usage_amount(price, 100) == 100 * 10  # exactly at up_to: still the first tier
    assert usage.usage_amount(price, 101) == 101 * 5 + 300
    assert usage.usage_amount(price, 1000) == 1000 * 5 + 300
    assert usage.usage_amount(price, 1001) == 1001 * 2


def test_package_pricing_rounds_a_started_package_up_and_per_unit_multiplies():
    package = _unsaved(amount=250, billing_scheme="per_unit", transform_divide_by=1000, transform_round="up")
    assert [usage.usage_amount(package, q) for q in (0, 1, 1000, 2000, 2001)] == [0, 250, 250, 500, 750]
    down = _unsaved(amount=250, billing_scheme="per_unit", transform_divide_by=1000, transform_round="down")
    assert usage.usage_amount(down, 2999) == 500
    assert usage.usage_amount(_unsaved(amount=3, billing_scheme="per_unit"), 1234) == 3702


# -- aggregation ------------------------------------------------------------------------------------------------


def test_each_formula_aggregates_only_the_events_of_the_period(book, settings):
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400
    tenant = book.tenant()
    customer, other = book.customer(tenant), book.customer(tenant)
    now = database_now().replace(microsecond=0)
    start, end = now - 10 * DAY, now - 2 * DAY
    meters = {
        f: _meter(tenant, f, event_name=f"ev_{f}", value_key="user" if f == "unique_count" else "value")
        for f in ("sum", "count", "max", "last", "unique_count")
    }
    events = []
    for f in meters:
        name = f"ev_{f}"
        for value, at, user in ((5, start, "u1"), (7, start + DAY, "u2"), (3, start + 2 * DAY, "u1")):
            event = _event(customer, value, at, name=name)
            event["payload"]["user"] = user
            events.append(event)
        outside = [
            _event(customer, 100, end, name=name),
            _event(customer, 100, start - timedelta(seconds=1), name=name),
            _event(other, 100, start + DAY, name=name),
        ]
        for event in outside:
            event["payload"]["user"] = "u9"
        events += outside
    assert {r.status for r in _ingest(tenant, events)} == {"accepted"}
    got = aggregate_usage([(f, customer.id, m.id, start, end) for f, m in meters.items()])
    assert got == {"sum": 15, "count": 3, "max": 7, "last": 3, "unique_count": 2}
    # No events at all: every formula gives 0.
    empty = aggregate_usage([(f, customer.id, m.id, end + DAY, end + 2 * DAY) for f, m in meters.items()])
    assert empty == dict.fromkeys(meters, 0)


@pytest.mark.parametrize("grouped", [False, True], ids=["per_row", "grouped"])
def test_a_customer_outside_the_meters_tenant_or_mode_aggregates_nothing_with_its_negative_control(
    book, settings, monkeypatch, grouped
):
    """The usage index holds no tenant or mode (decision 0222): the customer's own tenant and mode stand for the
    events'. A row pairing tenant B's customer with tenant A's meter, or with B's live meter, of the same event
    name, counts none of that customer's events; with B's own test meter it counts them all. Both by the per-row
    statement and by the grouped one (decision 0230)."""
    settings.HARDCOUNT_USAGE_GROUPED_MIN = 1 if grouped else 10**9
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400
    tenant_a, tenant_b = book.tenant(), book.tenant()
    customer = book.customer(tenant_b)
    now = database_now().replace(microsecond=0)
    start, end = now - 10 * DAY, now - 2 * DAY
    formulas = ("sum", "count", "max", "last")
    own = {f: _meter(tenant_b, f, event_name=f"ev_{f}") for f in formulas}
    foreign = {f: _meter(tenant_a, f, event_name=f"ev_{f}") for f in formulas}
    live = {
        f: usage.create_meter(tenant_id=tenant_b.id, livemode=True, display_name=f, event_name=f"ev_{f}", formula=f)
        for f in formulas
    }
    batch = [_event(customer, v, start + i * DAY, name=f"ev_{f}") for f in formulas for i, v in enumerate((4, 9, 2))]
    assert {r.status for r in _ingest(tenant_b, batch)} == {"accepted"}

    def quantities():
        rows = [(f"own_{f}", customer.id, own[f].id, start, end) for f in formulas]
        rows += [(f"foreign_{f}", customer.id, foreign[f].id, start, end) for f in formulas]
        rows += [(f"live_{f}", customer.id, live[f].id, start, end) for f in formulas]
        return aggregate_usage(rows)

    expected_own = {"own_sum": 15, "own_count": 3, "own_max": 9, "own_last": 2}
    assert quantities() == {**expected_own, **{f"{k}_{f}": 0 for k in ("foreign", "live") for f in formulas}}
    # Under row-level security (the console's reads): tenant B's role sees its customer's usage, tenant A's none.
    own_rows = [(f"own_{f}", customer.id, own[f].id, start, end) for f in formulas]
    for tenant, seen in ((tenant_b, expected_own), (tenant_a, {})):
        tenancy.enter(tenant.id, False)
        try:
            assert tenancy.current_role() == tenancy.TENANT_ROLE
            assert queries.usage_quantities(own_rows) == seen
        finally:
            tenancy.leave()

    # Negative control: without the customer's tenant and mode checked against the meter's, the other tenant's
    # meter and the live meter count the test-mode events of tenant B's customer.
    name, check = (
        ("AGGREGATE_USAGE_GROUPED", "c.tenant_id = %(tenant)s AND c.livemode = %(livemode)s")
        if grouped
        else ("AGGREGATE_USAGE", "c.tenant_id = m.tenant_id AND c.livemode = m.livemode")
    )
    unchecked = getattr(queries, name).replace(check, "true")
    assert unchecked != getattr(queries, name)
    monkeypatch.setattr(queries, name, unchecked)
    leaked = quantities()
    assert leaked["foreign_sum"] == 15 and leaked["live_sum"] == 15 and leaked["foreign_count"] == 3


# -- ingestion: idempotency, validation, concurrency -----------------------------------------------------------


def test_a_retried_batch_with_identifiers_seen_before_counts_nothing_twice(book):
    tenant = book.tenant()
    customer = book.customer(tenant)
    meter = _meter(tenant)
    first = _ingest(tenant, [_event(customer, v, None, f"id-{v}") for v in (1, 2, 4)])
    assert [r.status for r in first] == ["accepted"] * 3
    retry = _ingest(
        tenant,
        [
            _event(customer, 1, None, "id-1"),
            _event(customer, 2, None, "id-2"),
            _event(customer, 8, None, "id-8"),
            _event(customer, 8, None, "id-8"),  # the same identifier twice in one batch
            _event(customer, 16, None, "id-16", name="no_such_meter"),
            {"event_name": "api_calls", "payload": {"stripe_customer_id": customer.id, "value": "1.5"}},
        ],
    )
    assert [(r.status, r.error and r.error["code"]) for r in retry] == [
        ("duplicate", None),
        ("duplicate", None),
        ("accepted", None),
        ("duplicate", None),
        ("refused", "meter_not_found"),
        ("refused", "value_invalid"),
    ]
    assert MeterEvent.objects.filter(tenant=tenant).count() == 4
    now = database_now()
    assert aggregate_usage([("k", customer.id, meter.id, now - DAY, now + DAY)]) == {"k": 1 + 2 + 4 + 8}


def test_two_connections_ingesting_the_same_batch_at_once_store_each_event_once(book):
    tenant = book.tenant()
    customer = book.customer(tenant)
    meter = _meter(tenant)
    batch = [_event(customer, 1, None, f"ev-{i}") for i in range(300)]
    barrier = threading.Barrier(2)
    outcomes = []

    def ingest():
        try:
            barrier.wait()
            outcomes.append([r.status for r in _ingest(tenant, batch)])
        finally:
            connections.close_all()

    threads = [threading.Thread(target=ingest) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = outcomes[0] + outcomes[1]
    assert statuses.count("accepted") == 300 and statuses.count("duplicate") == 300
    assert MeterEvent.objects.filter(tenant=tenant).count() == 300
    now = database_now()
    assert aggregate_usage([("k", customer.id, meter.id, now - DAY, now + DAY)]) == {"k": 300}


def test_negative_control_without_the_identifier_guard_a_retry_is_stored_twice(book):
    tenant = book.tenant()
    customer = book.customer(tenant)
    _meter(tenant)
    batch = [_event(customer, 1, None, "same")]
    with pytest.raises(_Rollback), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE billing_metereventidentifier DROP CONSTRAINT billing_metereventidentifier_pkey")
        _ingest(tenant, batch)
        _ingest(tenant, batch)
        assert MeterEvent.objects.filter(tenant=tenant).count() == 2
        raise _Rollback
    _ingest(tenant, batch)
    _ingest(tenant, batch)
    assert MeterEvent.objects.filter(tenant=tenant).count() == 1


class _Rollback(Exception):
    pass


def test_events_beyond_the_future_skew_or_older_than_the_grace_are_refused(book):
    tenant = book.tenant()
    customer = book.customer(tenant)
    _meter(tenant)
    now = database_now()
    results = _ingest(
        tenant,
        [
            _event(customer, 1, now - timedelta(minutes=59)),
            _event(customer, 1, now - timedelta(minutes=61)),
            _event(customer, 1, now + timedelta(minutes=4)),
            _event(customer, 1, now + timedelta(minutes=6)),
            _event(customer, 1, None) | {"payload": {"stripe_customer_id": "cus_nobody", "value": "1"}},
        ],
    )
    assert [(r.status, r.error and r.error["code"]) for r in results] == [
        ("accepted", None),
        ("refused", "timestamp_too_old"),
        ("accepted", None),
        ("refused", "timestamp_in_future"),
        ("refused", "customer_not_found"),
    ]


# -- billing: a mixed subscription, both close paths ------------------------------------------------------------


def _mixed_subscription(book, tenant, *, anchor):
    customer = book.customer(tenant)
    licensed = book.price(tenant, amount=2000)
    meter = _meter(tenant)
    metered = _metered_price(tenant, meter, billing_scheme="tiered", tiers_mode="graduated", tiers=GRADUATED)
    sub = book.subscription(customer, licensed, anchor=anchor)
    SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=metered)
    return customer, sub, metered


def test_a_mixed_subscription_bills_licensed_ahead_and_the_last_periods_usage_behind(book, settings, page_close):
    tenant = book.tenant()
    now = database_now()
    # Period 0 ended 2 hours ago (grace 1 h passed); period 1 began then.
    anchor = _month_before(now - timedelta(hours=2))
    customer, sub, metered = _mixed_subscription(book, tenant, anchor=anchor)
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400  # to record period 0's usage after the fact
    assert {
        r.status
        for r in _ingest(tenant, [_event(customer, 700, anchor + DAY), _event(customer, 800, anchor + 2 * DAY)])
    } == {"accepted"}
    settings.HARDCOUNT_USAGE_GRACE_S = 3600

    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)  # period 0: billed in advance, no usage
    first = Invoice.objects.get(subscription=sub, period_start=anchor)
    assert [(line.price_id, line.amount) for line in first.lines.all()] == [(sub.price_id, 2000)]

    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)  # period 1, with period 0's 1,500 units
    second = Invoice.objects.exclude(pk=first.pk).get(subscription=sub)
    lines = list(second.lines.all())
    assert [(line.price_id, line.quantity, line.amount) for line in lines] == [
        (sub.price_id, 1, 2000),
        (metered.id, 1500, 100 * 10 + 900 * 5 + 200 + 500 * 1),
    ]
    assert (lines[1].period_start, lines[1].period_end) == (first.period_start, first.period_end)
    assert (second.subtotal, second.total, second.amount_paid, second.status) == (8200, 8200, 8200, "paid")

    # Closing period 1 again bills nothing more.
    outcome = close_subscription_period(sub.id, periods_billed=1, run=None)
    assert outcome.kind == "skipped"
    assert Invoice.objects.filter(subscription=sub).count() == 2


def _month_before(at: datetime) -> datetime:
    from dateutil.relativedelta import relativedelta

    return at - relativedelta(months=1)


def test_a_close_that_crashes_after_aggregating_bills_the_usage_once_when_run_again(book, settings, monkeypatch):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = False
    tenant = book.tenant()
    anchor = _month_before(database_now() - timedelta(hours=2))
    customer, sub, metered = _mixed_subscription(book, tenant, anchor=anchor)
    Subscription.objects.filter(pk=sub.pk).update(periods_billed=1, next_billing_at=_month_after(anchor))
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400
    _ingest(tenant, [_event(customer, 50, anchor + DAY)])
    settings.HARDCOUNT_USAGE_GRACE_S = 3600

    from billing.services import close

    def crash(*args, **kwargs):
        raise RuntimeError("killed after the usage was aggregated")

    monkeypatch.setattr(close, "finalize_or_pend_locked", crash)
    close_subscription_period(sub.id, periods_billed=1, run=None, manual_retry=True)
    assert not Invoice.objects.filter(subscription=sub).exists()  # the invoice and its usage line rolled back
    monkeypatch.undo()

    close_subscription_period(sub.id, periods_billed=1, run=None, manual_retry=True)
    close_subscription_period(sub.id, periods_billed=1, run=None, manual_retry=True)
    invoice = Invoice.objects.get(subscription=sub)
    assert [(line.price_id, line.quantity, line.amount) for line in invoice.lines.all()] == [
        (sub.price_id, 1, 2000),
        (metered.id, 50, 50 * 10),
    ]


def _month_after(at: datetime) -> datetime:
    from dateutil.relativedelta import relativedelta

    return at + relativedelta(months=1)


def test_a_metered_subscription_waits_for_the_grace_before_its_usage_period_is_billed(book, settings):
    tenant = book.tenant()
    now = database_now()
    _, sub, _ = _mixed_subscription(book, tenant, anchor=_month_before(now - timedelta(minutes=30)))
    Subscription.objects.filter(pk=sub.pk).update(periods_billed=1, next_billing_at=now - timedelta(minutes=30))
    licensed_only = book.subscribed(tenant, anchor=_month_before(now - timedelta(minutes=30)))
    Subscription.objects.filter(pk=licensed_only.pk).update(
        periods_billed=1, next_billing_at=now - timedelta(minutes=30)
    )
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    assert Invoice.objects.filter(subscription=licensed_only).count() == 1
    assert not Invoice.objects.filter(subscription=sub).exists()
    # The grace passed: billed.
    Subscription.objects.filter(pk=sub.pk).update(next_billing_at=now - timedelta(seconds=3601))
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    assert Invoice.objects.filter(subscription=sub).count() == 1


# -- a test clock across advances --------------------------------------------------------------------------------


def test_usage_on_a_test_clock_across_advances_with_late_events_inside_and_after_the_grace(book, page_close):
    tenant = book.tenant()
    t0 = datetime(2027, 1, 1, tzinfo=UTC)
    clock = make_clock(tenant, t0)
    customer = book.customer(tenant, clock=clock)
    meter = _meter(tenant)
    metered = _metered_price(tenant, meter, amount=3)
    licensed, sub = _licensed_and_metered(tenant, customer, metered, amount=1000)

    advance(clock, t0 + timedelta(hours=1))  # 1: January billed in advance, no usage line
    assert [r.status for r in _ingest(tenant, [_event(customer, 10, None)])] == ["accepted"]  # at the clock's time

    feb = datetime(2027, 2, 1, tzinfo=UTC)
    advance(clock, feb + timedelta(minutes=30))  # 2: inside January's grace: February not billed yet
    assert Invoice.objects.filter(subscription_id=sub.id).count() == 1
    late = _ingest(
        tenant,
        [_event(customer, 5, feb - timedelta(minutes=10)), _event(customer, 99, feb - timedelta(minutes=31))],
    )
    assert [(r.status, r.error and r.error["code"]) for r in late] == [
        ("accepted", None),
        ("refused", "timestamp_too_old"),
    ]

    advance(clock, feb + timedelta(hours=2))  # 3: February with January's 15 units
    february = Invoice.objects.get(subscription_id=sub.id, period_start=feb)
    assert [(line.price_id, line.quantity, line.amount) for line in february.lines.all()] == [
        (licensed.id, 1, 1000),
        (metered.id, 15, 45),
    ]
    assert february.total == 1045
    assert february.created_at == feb + timedelta(hours=1)  # billed once the grace passed, at the clock's time
    after = _ingest(tenant, [_event(customer, 99, feb - timedelta(minutes=5))])  # January is closed for usage
    assert after[0].error["code"] == "timestamp_too_old"
    _ingest(tenant, [_event(customer, 7, None)])

    mar = datetime(2027, 3, 1, tzinfo=UTC)
    advance(clock, mar + timedelta(hours=2))  # 4: March with February's 7 units
    march = Invoice.objects.get(subscription_id=sub.id, period_start=mar)
    assert [(line.price_id, line.quantity, line.amount) for line in march.lines.all()] == [
        (licensed.id, 1, 1000),
        (metered.id, 7, 21),
    ]


# -- the API -----------------------------------------------------------------------------------------------------


def test_meters_events_and_summaries_through_the_api(acme, book):
    api = Api(acme.test)
    status, meter = api.post(
        "/v1/billing/meters",
        {"display_name": "API calls", "event_name": "api_calls", "default_aggregation": {"formula": "sum"}},
    )
    assert status == 201, meter
    assert (meter["object"], meter["customer_mapping"]["event_payload_key"]) == ("billing.meter", "stripe_customer_id")
    assert api.get(f"/v1/billing/meters/{meter['id']}") == (200, meter)
    assert [e.data for e in events("billing.meter.created", tenant_id=acme.tenant.id)] == [meter]
    assert api.get("/v1/billing/meters")[1]["data"] == [meter]
    status, error = api.post(
        "/v1/billing/meters",
        {"display_name": "again", "event_name": "api_calls", "default_aggregation": {"formula": "count"}},
    )
    assert (status, error["error"]["code"]) == (422, "meter_event_name_taken")
    other = make_keys("Globex")
    assert Api(other.test).get(f"/v1/billing/meters/{meter['id']}")[0] == 404
    assert Api(acme.live).get(f"/v1/billing/meters/{meter['id']}")[0] == 404

    status, price = api.post(
        "/v1/prices",
        {
            "amount": 0,
            "currency": "usd",
            "interval": "month",
            "recurring": {"usage_type": "metered", "meter": meter["id"]},
            "billing_scheme": "tiered",
            "tiers_mode": "volume",
            "tiers": [{"up_to": 10, "unit_amount": 5}, {"up_to": "inf", "unit_amount": 2}],
        },
    )
    assert status == 201, price
    assert price["recurring"]["usage_type"] == "metered"
    assert price["tiers"][-1] == {"up_to": "inf", "unit_amount": 2, "flat_amount": 0}
    status, error = api.post(
        "/v1/prices",
        {
            "amount": 0,
            "currency": "usd",
            "interval": "month",
            "billing_scheme": "tiered",
            "tiers_mode": "volume",
            "tiers": [{"up_to": 10, "unit_amount": 5}],
        },
    )
    assert (status, error["error"]["code"]) == (422, "tiers_invalid")

    customer = book.customer(acme.tenant)
    now = database_now().replace(microsecond=0)
    body = {
        "event_name": "api_calls",
        "payload": {"stripe_customer_id": customer.id, "value": "4"},
        "identifier": "req-1",
        "timestamp": int(now.timestamp()),
    }
    status, event = api.post("/v1/billing/meter_events", body)
    assert status == 201, event
    assert api.post("/v1/billing/meter_events", body) == (200, event)
    status, error = api.post("/v1/billing/meter_events", {**body, "identifier": "req-2", "event_name": "nope"})
    assert (status, error["error"]["code"]) == (422, "meter_not_found")

    status, batch = api.post(
        "/v1/billing/meter_events/batch",
        {
            "events": [
                {**body, "identifier": "req-3", "payload": {"stripe_customer_id": customer.id, "value": 6}},
                body,
                {**body, "identifier": "req-4", "colour": "blue"},
            ]
        },
    )
    assert status == 200, batch
    assert (batch["accepted"], batch["duplicate"], batch["refused"]) == (1, 1, 1)
    assert batch["data"][2]["error"] == {
        "code": "parameter_unknown",
        "message": "Unknown parameter.",
        "param": "colour",
    }
    status, error = api.post("/v1/billing/meter_events/batch", {"events": [body, "not an object"]})
    assert (status, error["error"]["param"]) == (422, "events.1")  # the envelope's shape: nothing stored
    assert api.post("/v1/billing/meter_events/batch", {"events": []})[0] == 422

    params = {
        "customer": customer.id,
        "start_time": str(int((now - DAY).timestamp())),
        "end_time": str(int((now + DAY).timestamp())),
    }
    status, summary = api.get(f"/v1/billing/meters/{meter['id']}/event_summaries", params)
    assert status == 200, summary
    assert [s["aggregated_value"] for s in summary["data"]] == [10]
    status, by_day = api.get(
        f"/v1/billing/meters/{meter['id']}/event_summaries", {**params, "value_grouping_window": "day"}
    )
    assert [s["aggregated_value"] for s in by_day["data"]] == [10]
    assert by_day["data"][0]["start_time"] == now.replace(hour=0, minute=0, second=0).isoformat().replace("+00:00", "Z")


# -- both close paths write the same usage lines --------------------------------------------------------------


def _usage_book(book, tenant, now, settings):
    """Six subscriptions of one tenant: mixed graduated, metered-only volume, package + licensed, a first period
    of metered items only, one still inside its grace, and one whose customer has a pending invoice item."""
    from billing.services.invoice_items import create_invoice_item

    meter = _meter(tenant)
    graduated = _metered_price(tenant, meter, billing_scheme="tiered", tiers_mode="graduated", tiers=GRADUATED)
    volume = _metered_price(
        tenant,
        meter,
        billing_scheme="tiered",
        tiers_mode="volume",
        tiers=[{"up_to": 100, "unit_amount": 10}, {"up_to": "inf", "unit_amount": 4, "flat_amount": 50}],
    )
    package = _metered_price(tenant, meter, amount=250, transform_quantity={"divide_by": 1000, "round": "up"})
    licensed = book.price(tenant, amount=1000)
    due = now - timedelta(hours=2)
    plans = [
        ([licensed, graduated], due, 1, 1500),
        ([volume], due, 1, 100),
        ([licensed, package], due, 1, 2001),
        ([volume], now - timedelta(hours=1), 0, 0),
        ([licensed, graduated], now - timedelta(minutes=30), 1, 7),
        ([licensed, volume], due, 1, 101),
    ]
    subs, events = [], []
    for n, (prices, next_at, periods_billed, used) in enumerate(plans):
        customer = book.customer(tenant)
        anchor = _month_before(next_at) if periods_billed else next_at
        sub = book.subscription(customer, prices[0], anchor=anchor)
        for price in prices[1:]:
            SubscriptionItem.objects.create(tenant=tenant, livemode=False, subscription=sub, price=price)
        Subscription.objects.filter(pk=sub.pk).update(periods_billed=periods_billed, next_billing_at=next_at)
        if used:
            events.append(_event(customer, used, anchor + DAY, f"book-{n}"))
        if n == 5:
            create_invoice_item(
                tenant_id=tenant.id, livemode=False, customer_id=customer.id, amount=300, currency="usd"
            )
        subs.append(sub)
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400
    assert {r.status for r in _ingest(tenant, events)} == {"accepted"}
    settings.HARDCOUNT_USAGE_GRACE_S = 3600
    return subs


def _billed(subs):
    out = []
    for n, sub in enumerate(subs):
        for invoice in Invoice.objects.filter(subscription=sub).order_by("period_start"):
            lines = [
                (line.description, line.quantity, line.amount, line.period_start, line.period_end)
                if line.invoice_item_id is None
                else ("pending item", line.quantity, line.amount)  # dated when each book created it
                for line in invoice.lines.all()
            ]
            out.append((n, invoice.period_start, invoice.status, invoice.subtotal, invoice.amount_paid, lines))
    return out


@pytest.mark.parametrize("grouped_min", [50, 1])
def test_the_page_close_and_the_per_close_path_bill_the_same_usage(book, settings, monkeypatch, grouped_min):
    """Both paths bill the same lines, also with every window's rows aggregated by the grouped statement
    (``grouped_min`` 1, decision 0230) where its formula allows."""
    from billing.services import page

    settings.HARDCOUNT_USAGE_GROUPED_MIN = grouped_min

    now = database_now().replace(microsecond=0)
    page_tenant, per_close_tenant = book.tenant("page"), book.tenant("per close")
    page_subs = _usage_book(book, page_tenant, now, settings)
    per_close_subs = _usage_book(book, per_close_tenant, now, settings)

    paged, aggregate = [], page.usage_lines_for
    monkeypatch.setattr(
        page, "usage_lines_for", lambda closes: paged.append([s.id for s, _ in closes]) or aggregate(closes)
    )
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = True
    drain_due(livemode=False, trigger="manual", tenant_id=page_tenant.id)
    # The page's plain closes (0, 1, 2, and 3, which then needs no charge) were aggregated by one statement.
    assert paged[0] == sorted(page_subs[n].id for n in (0, 1, 2, 3))
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = False
    drain_due(livemode=False, trigger="manual", tenant_id=per_close_tenant.id)

    got, expected = _billed(page_subs), _billed(per_close_subs)
    assert got == expected
    totals = {n: subtotal for n, _, _, subtotal, _, _ in got}
    assert totals == {
        0: 1000 + 6200,  # licensed + graduated 1,500
        1: 100 * 10,  # volume, exactly at up_to
        2: 1000 + 3 * 250,  # licensed + 3 packages for 2,001
        3: 0,  # a first period of metered items only: one empty line
        5: 1000 + 101 * 4 + 50 + 300,  # licensed + volume 101 + the pending item
    }
    assert 4 not in {n for n, *_ in got}  # inside its grace: not billed yet
    first_only = next(lines for n, *_, lines in got if n == 3)
    assert [(q, amount) for _, q, amount, _, _ in first_only] == [(0, 0)]


def test_the_upcoming_invoice_shows_the_usage_of_the_period_under_way_so_far(book, acme):
    now = database_now()
    anchor = _month_before(now + 10 * DAY)  # the period under way began 20-odd days ago, ends in 10 days
    customer, sub, metered = _mixed_subscription(book, acme.tenant, anchor=anchor)
    Subscription.objects.filter(pk=sub.pk).update(periods_billed=1, next_billing_at=now + 10 * DAY)
    _ingest(acme.tenant, [_event(customer, 600, None), _event(customer, 50, now - timedelta(minutes=5))])

    status, upcoming = Api(acme.test).get("/v1/invoices/upcoming", {"subscription": sub.id})
    assert status == 200, upcoming
    assert [(line["price"], line["quantity"], line["amount"]) for line in upcoming["lines"]] == [
        (sub.price_id, 1, 2000),
        (metered.id, 650, 100 * 10 + 550 * 5 + 200),
    ]
    assert upcoming["subtotal"] == 2000 + 3950
    assert not Invoice.objects.filter(subscription=sub).exists()


def test_a_cancel_at_period_end_bills_the_last_periods_usage_on_a_final_invoice(book, page_close):
    from billing.services.drain import reconcile

    tenant = book.tenant()
    t0 = datetime(2027, 1, 1, tzinfo=UTC)
    clock = make_clock(tenant, t0)
    customer = book.customer(tenant, clock=clock)
    metered = _metered_price(tenant, _meter(tenant), amount=3)
    _licensed, sub = _licensed_and_metered(tenant, customer, metered, amount=1000)
    advance(clock, t0 + timedelta(hours=1))
    _ingest(tenant, [_event(customer, 40, None, "final-1")])
    cancel_subscription(tenant_id=tenant.id, livemode=False, subscription_id=sub.id, at_period_end=True)
    feb = datetime(2027, 2, 1, tzinfo=UTC)
    advance(clock, feb + timedelta(hours=2))
    reconcile(livemode=False)  # charges the final invoice, as the billing tick does
    reconcile(livemode=False)

    sub = Subscription.objects.get(pk=sub.id)
    assert (sub.status, sub.ended_at) == ("canceled", feb)
    invoices = list(Invoice.objects.filter(subscription=sub).order_by("created_at"))
    assert [(i.billing_reason, i.period_start, i.total, i.status) for i in invoices] == [
        ("subscription_cycle", t0, 1000, "paid"),
        ("subscription_update", t0, 40 * 3, "paid"),
    ]
    assert [(line.price_id, line.quantity, line.amount) for line in invoices[1].lines.all()] == [(metered.id, 40, 120)]
    assert invoices[1].created_at == feb + timedelta(hours=1)  # after the grace, at the clock's time


@pytest.mark.parametrize("barrier", [True, False])
def test_reading_usage_waits_for_an_insert_in_flight(book, monkeypatch, barrier):
    """The close's barrier: an event accepted by an insert that has not committed yet is not missed; without
    the barrier (the negative control) the read returns at once and misses it."""
    tenant = book.tenant()
    customer = book.customer(tenant)
    meter = _meter(tenant)
    if not barrier:
        monkeypatch.setattr(queries, "usage_barrier", lambda: None)
    inserted, release, got = threading.Event(), threading.Event(), {}

    def slow_insert():
        try:
            with transaction.atomic():
                _ingest(tenant, [_event(customer, 5, None)])
                inserted.set()
                release.wait(20)  # the insert's transaction stays open, as a slow request's would
        finally:
            connections.close_all()

    def read():
        try:
            now = database_now()
            got["usage"] = aggregate_usage([("k", customer.id, meter.id, now - DAY, now + DAY)])
        finally:
            connections.close_all()

    writer = threading.Thread(target=slow_insert)
    writer.start()
    assert inserted.wait(20)
    reader = threading.Thread(target=read)
    reader.start()
    reader.join(1.0)
    waited = reader.is_alive()
    release.set()
    writer.join(20)
    reader.join(20)
    if barrier:
        assert waited and got["usage"] == {"k": 5}
    else:
        assert not waited and got["usage"] == {"k": 0}


def test_restarting_the_cycle_of_a_subscription_with_a_metered_item_is_a_422_and_changes_nothing(book, acme):
    tenant = acme.tenant
    now = database_now()
    _customer, sub, _metered = _mixed_subscription(book, tenant, anchor=now - 10 * DAY)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)  # the current period is invoiced
    sub.refresh_from_db()
    before = (sub.billing_cycle_anchor, sub.next_billing_at, Invoice.objects.filter(subscription=sub).count())

    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"})

    assert status == 422, body
    assert (body["error"]["code"], body["error"]["param"]) == (
        "billing_cycle_anchor_unavailable",
        "billing_cycle_anchor",
    )
    sub.refresh_from_db()
    assert (sub.billing_cycle_anchor, sub.next_billing_at, Invoice.objects.filter(subscription=sub).count()) == before


def test_integral_json_numbers_are_integers_in_a_timestamp_and_a_payload(book, acme):
    # JSON Schema (and so the OpenAPI document) calls 1.0 an integer: 2159.0 seconds and a value of 7.0 are accepted.
    tenant = acme.tenant
    customer = book.customer(tenant)
    _meter(tenant)
    at = int(database_now().timestamp()) - 60

    status, body = Api(acme.test).post(
        "/v1/billing/meter_events",
        {
            "event_name": "api_calls",
            "payload": {"stripe_customer_id": customer.id, "value": 7.0},
            "timestamp": at + 0.0,
        },
    )

    assert status == 201, body
    (event,) = MeterEvent.objects.filter(tenant=tenant)
    assert (event.value, int(event.timestamp.timestamp())) == (7, at)


def test_a_mixed_subscription_changed_mid_period_prorates_the_licensed_item_and_bills_the_usage_once(book, page_close):
    from billing.models import InvoiceItem
    from billing.services.changes import change_subscription

    tenant = book.tenant()
    apr = datetime(2027, 4, 1, tzinfo=UTC)  # a 30-day period: April 16 00:00 leaves exactly half
    clock = make_clock(tenant, apr)
    customer = book.customer(tenant, clock=clock)
    metered = _metered_price(tenant, _meter(tenant), amount=3)
    licensed, sub = _licensed_and_metered(tenant, customer, metered, amount=3000)
    advance(clock, apr + timedelta(hours=1))  # April billed in advance: 3,000, no usage line
    _ingest(tenant, [_event(customer, 10, None)])
    advance(clock, datetime(2027, 4, 16, tzinfo=UTC))
    (seat,) = SubscriptionItem.objects.filter(subscription_id=sub.id, price=licensed)

    change_subscription(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, items=[{"id": seat.id, "quantity": 3}]
    )
    _ingest(tenant, [_event(customer, 5, None)])

    # Half of April is left: the seat's unused half is credited (−3,000 / 2) and three seats' half charged
    # (3 × 3,000 / 2); the metered item is not prorated (its usage is billed in arrears, whatever the change).
    prorations = sorted(
        InvoiceItem.objects.filter(subscription_id=sub.id, proration=True).values_list("price_id", "quantity", "amount")
    )
    assert prorations == sorted([(licensed.id, 1, -1500), (licensed.id, 3, 4500)])
    may = datetime(2027, 5, 1, tzinfo=UTC)
    advance(clock, may + timedelta(hours=2))  # May: 3 seats ahead, April's 15 units behind, the prorations
    invoice = Invoice.objects.get(subscription_id=sub.id, period_start=may)
    assert sorted((line.price_id, line.quantity, line.amount) for line in invoice.lines.all()) == sorted(
        [(licensed.id, 3, 9000), (metered.id, 15, 45), (licensed.id, 1, -1500), (licensed.id, 3, 4500)]
    )
    assert (invoice.total, invoice.status) == (9000 + 45 - 1500 + 4500, "paid")
    advance(clock, datetime(2027, 6, 1, 2, tzinfo=UTC))  # June: May had no usage; April's is not billed again
    june = Invoice.objects.get(subscription_id=sub.id, period_start=datetime(2027, 6, 1, tzinfo=UTC))
    assert sum(line.quantity for line in june.lines.all() if line.price_id == metered.id) == 0
    assert june.total == 9000


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"payload": {"note": "a\x00b"}}, "payload"),
        ({"payload": {"\x00": "x"}}, "payload"),
        ({"payload": {"note": "\ud800"}}, "payload"),
        ({"identifier": "x\x00"}, "identifier"),
        ({"identifier": "\ud800"}, "identifier"),
        ({"event_name": "api\x00calls"}, "event_name"),
        ({"event_name": "\ud800"}, "event_name"),
        ({"timestamp": "9999-12-31T23:59:59-14:00"}, "timestamp"),  # past datetime's range once in UTC
        ({"timestamp": "0001-01-01T00:00:00+14:00"}, "timestamp"),
    ],
)
def test_what_text_jsonb_or_a_datetime_cannot_hold_is_a_4xx_for_one_event_and_refuses_only_that_event_in_a_batch(
    book, acme, change, param
):
    tenant = acme.tenant
    customer = book.customer(tenant)
    _meter(tenant)
    api = Api(acme.test)
    bad = {"event_name": "api_calls", "payload": {"stripe_customer_id": customer.id, "value": 1}}
    bad = {**bad, **change, "payload": {**bad["payload"], **change.get("payload", {})}}

    status, body = api.post("/v1/billing/meter_events", bad)
    assert status in (400, 422), body
    status, body = api.post("/v1/billing/meter_events/batch", {"events": [bad, _event(customer, 2, None)]})

    assert status == 200, body
    assert [(r["status"], r.get("error") and r["error"]["param"]) for r in body["data"]] == [
        ("refused", param),
        ("accepted", None),
    ]
    assert list(MeterEvent.objects.filter(tenant=tenant).values_list("value", flat=True)) == [2]


def test_each_formula_under_each_charge_model_on_one_invoice_against_hand_computed_lines(book, page_close):
    """Five meters, one per formula, each billed by another charge model on one subscription: the invoice after the
    period carries each line's hand-computed quantity and amount."""
    tenant = book.tenant()
    t0 = datetime(2027, 1, 1, tzinfo=UTC)
    clock = make_clock(tenant, t0)
    customer = book.customer(tenant, clock=clock)
    meters = {
        f: _meter(tenant, f, event_name=f"ev_{f}", value_key="user" if f == "unique_count" else "value")
        for f in ("sum", "count", "max", "last", "unique_count")
    }
    tiered = {"billing_scheme": "tiered", "amount": 0}
    prices = {
        "sum": _metered_price(tenant, meters["sum"], amount=3),  # per unit
        "count": _metered_price(
            tenant,
            meters["count"],
            **tiered,
            tiers_mode="graduated",
            tiers=[
                {"up_to": 2, "unit_amount": 10},
                {"up_to": 4, "unit_amount": 5, "flat_amount": 20},
                {"up_to": "inf", "unit_amount": 1},
            ],
        ),
        "max": _metered_price(
            tenant,
            meters["max"],
            **tiered,
            tiers_mode="volume",
            tiers=[
                {"up_to": 10, "unit_amount": 4},
                {"up_to": 100, "unit_amount": 2, "flat_amount": 50},
                {"up_to": "inf", "unit_amount": 1},
            ],
        ),
        "last": _metered_price(tenant, meters["last"], amount=250, transform_quantity={"divide_by": 10, "round": "up"}),
        "unique_count": _metered_price(tenant, meters["unique_count"], amount=100),
    }
    licensed = create_price(tenant_id=tenant.id, livemode=False, amount=1000, currency="usd", interval="month")
    sub = create_subscription(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=customer.id,
        items=[{"price": licensed.id, "quantity": 1}, *({"price": p.id, "quantity": 1} for p in prices.values())],
    )
    advance(clock, t0 + timedelta(hours=1))
    jan25 = datetime(2027, 1, 25, tzinfo=UTC)
    advance(clock, jan25)
    at = jan25 - timedelta(minutes=30)
    sent = [_event(customer, v, at, name="ev_sum") for v in (5, 7, 3)]
    sent += [_event(customer, 1, at, name="ev_count") for _ in range(6)]
    sent += [_event(customer, v, at, name="ev_max") for v in (3, 10, 7)]
    # The later event first: ``last`` is the latest by timestamp, not the last received.
    sent += [_event(customer, 12, jan25 - timedelta(minutes=10), name="ev_last")]
    sent += [_event(customer, 31, jan25 - timedelta(minutes=20), name="ev_last")]
    sent += [_event(customer, 0, at, name="ev_unique_count", user=u) for u in ("u1", "u2", "u1", "u3")]
    assert {r.status for r in _ingest(tenant, sent)} == {"accepted"}

    feb = datetime(2027, 2, 1, tzinfo=UTC)
    advance(clock, feb + timedelta(hours=2))
    february = Invoice.objects.get(subscription_id=sub.id, period_start=feb)
    lines = {line.price_id: (line.quantity, line.amount) for line in february.lines.all()}
    assert lines == {
        licensed.id: (1, 1000),
        prices["sum"].id: (15, 15 * 3),
        # 6 events cross both boundaries: 2 × 10, then 2 × 5 + the second tier's flat 20, then 2 × 1.
        prices["count"].id: (6, 2 * 10 + 2 * 5 + 20 + 2 * 1),
        # The maximum 10 is exactly the first tier's up_to: every unit at 4, no flat amount.
        prices["max"].id: (10, 10 * 4),
        # The latest value 12 makes 2 started packages of 10 (31 would have made 4).
        prices["last"].id: (12, 2 * 250),
        prices["unique_count"].id: (3, 3 * 100),
    }
    assert february.total == 1000 + 45 + 52 + 40 + 500 + 300


def _shapes() -> list:
    """Events of every shape the batch endpoint can be sent: well-formed ones (with and without an identifier or a
    timestamp, non-ASCII text, integral floats) and each fault, alone."""
    good = {"event_name": "api_calls", "payload": {"stripe_customer_id": "cus_1", "value": 3}}
    variants = [
        {},
        {"identifier": "req-1"},
        {"identifier": "ré-1"},
        {"timestamp": 1_800_000_000},
        {"timestamp": 1_800_000_000.0},
        {"timestamp": "2027-01-01T00:00:00Z"},
        {"timestamp": "2027-01-01T00:00:00"},
        {"timestamp": None},
        {"timestamp": True},
        {"timestamp": -1},
        {"identifier": None},
        {"identifier": ""},
        {"identifier": "x" * 100},
        {"identifier": "x" * 101},
        {"identifier": 7},
        {"identifier": "x\x00"},
        {"identifier": "\ud800"},
        {"event_name": ""},
        {"event_name": "é" * 100},
        {"event_name": "e" * 101},
        {"event_name": None},
        {"event_name": "api\x00calls"},
        {"payload": {}},
        {"payload": {"v": 2.0}},
        {"payload": {"v": 2.5}},
        {"payload": {"v": True}},
        {"payload": {"v": None}},
        {"payload": {"v": [1]}},
        {"payload": {"v": "é"}},
        {"payload": {"v": "x" * 501}},
        {"payload": {"k" * 101: 1}},
        {"payload": {f"k{n}": n for n in range(51)}},
        {"payload": {"v": 10**500}},
        {"payload": {"v": 1e300}},
        {"payload": "not an object"},
        {"colour": "blue"},
    ]
    return [{**good, **variant} for variant in variants] + ["not an object", None, [good]]


@pytest.mark.parametrize("raw", _shapes())
def test_the_fast_shape_check_agrees_with_the_full_one_on_every_shape(raw):
    """The usual event is recognised by a short check (decision 0229); whatever it accepts or leaves to the full
    check, the outcome is the full check's own: the same fields, or the same refusal."""
    assert usage._shape(4, raw) == usage._shape_checked(4, raw)


def test_negative_control_a_fast_check_that_takes_any_identifier_disagrees(monkeypatch):
    monkeypatch.setattr(usage, "_plain_name", lambda value: True)
    raw = {"event_name": "api_calls", "payload": {"v": 2}, "identifier": 7}
    assert usage._shape(0, raw) == ("api_calls", {"v": 2}, None, 7)
    assert usage._shape_checked(0, raw).status == "refused"


def _aggregation_book(book, settings):
    """A tenant with a meter of each formula, five customers with events of each in the past 20 days (a sixth with
    none), and another tenant's customer with events of the same name; ``(meters, customers, stranger, now)``."""
    settings.HARDCOUNT_USAGE_GRACE_S = 40 * 86400  # to place the events days back
    tenant, other = book.tenant(), book.tenant()
    now = database_now()
    formulas = ("sum", "count", "max", "last", "unique_count")
    meters = {
        f: _meter(tenant, f, event_name=f"ev_{f}", value_key="user" if f == "unique_count" else "value")
        for f in formulas
    }
    customers = [book.customer(tenant) for _ in range(6)]
    batch = [
        _event(c, 10 * n + i, now - timedelta(days=1 + 3 * n, minutes=i), name=f"ev_{f}", user=f"u{n % 2}")
        for i, c in enumerate(customers[:5])
        for n in range(3 + i)
        for f in formulas
    ]
    assert {r.status for r in _ingest(tenant, batch)} == {"accepted"}
    stranger = book.customer(other)
    _meter(other, "sum", event_name="ev_sum")
    assert {r.status for r in _ingest(other, [_event(stranger, 7, now - DAY, name="ev_sum")])} == {"accepted"}
    return meters, customers, stranger, now


def _wanted(meters, customers, stranger, now):
    windows = [(now - 20 * DAY, now), (now - 5 * DAY, now - 2 * DAY)]
    rows = [
        (f"{f}.{w}.{c.id}.{copy}", c.id, meter.id, *window)
        for f, meter in meters.items()
        for w, window in enumerate(windows)
        for c in [*customers, stranger]
        for copy in range(2 if c is customers[0] else 1)  # two rows of one customer, as two items of one meter
    ]
    return [*rows, ("unknown meter", customers[0].id, "mtr_none", *windows[0])]


def test_grouped_and_per_row_aggregation_give_every_row_the_same_quantity(book, settings, monkeypatch):
    """Rows sharing a meter and a window may be aggregated by one grouped statement (decision 0230): each row's
    quantity is the per-row statement's, for every formula, another tenant's customer (0), a customer without
    events (0), two rows of one customer, and a row of no meter (absent)."""
    meters, customers, stranger, now = _aggregation_book(book, settings)
    wanted = _wanted(meters, customers, stranger, now)
    grouped_calls = []
    grouped_quantities = queries._grouped_quantities
    monkeypatch.setattr(
        queries,
        "_grouped_quantities",
        lambda meter, *a: grouped_calls.append(meter.formula) or grouped_quantities(meter, *a),
    )

    settings.HARDCOUNT_USAGE_GROUPED_MIN = 10**9
    per_row = queries.usage_quantities(wanted)
    assert grouped_calls == []
    settings.HARDCOUNT_USAGE_GROUPED_MIN = 1
    grouped = queries.usage_quantities(wanted)

    assert sorted(grouped_calls) == ["count", "count", "max", "max", "sum", "sum"]
    assert grouped == per_row
    assert "unknown meter" not in per_row and len(per_row) == len(wanted) - 1
    first = customers[0].id
    # customers[0]'s events: values 0, 10, 20 (users u0, u1, u0) at 1, 4 and 7 days back; the second window holds the
    # one 4 days back.
    assert [per_row[f"{f}.0.{first}.0"] for f in meters] == [30, 3, 20, 0, 2]
    assert [per_row[f"{f}.1.{first}.1"] for f in meters] == [10, 1, 10, 10, 1]
    assert {per_row[f"{f}.0.{c.id}.0"] for f in meters for c in (customers[5], stranger)} == {0}


def test_negative_control_a_grouped_statement_without_the_tenant_check_counts_another_tenants_events(
    book, settings, monkeypatch
):
    meters, customers, stranger, now = _aggregation_book(book, settings)
    monkeypatch.setattr(
        queries,
        "AGGREGATE_USAGE_GROUPED",
        queries.AGGREGATE_USAGE_GROUPED.replace("c.tenant_id = %(tenant)s AND c.livemode = %(livemode)s", "true"),
    )
    settings.HARDCOUNT_USAGE_GROUPED_MIN = 1
    grouped = queries.usage_quantities(_wanted(meters, customers, stranger, now))
    assert grouped[f"sum.0.{stranger.id}.0"] == 7
