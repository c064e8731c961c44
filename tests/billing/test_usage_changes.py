"""Usage up to a change or an immediate cancel: a metered item removed or re-priced mid-period, and a subscription
canceled now, bill the usage accrued up to that instant exactly once (docs/decisions/0170), against
hand-computed amounts on a test clock, with negative controls."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from billing.models import Customer, Invoice, InvoiceItem, SubscriptionItem
from billing.services import usage
from billing.services.catalog import create_price, create_subscription
from billing.services.changes import cancel_subscription, change_subscription
from billing.services.drain import reconcile
from tests.api.conftest import Api, make_keys
from tests.clocks.helpers import advance, make_clock

T0 = datetime(2027, 1, 1, tzinfo=UTC)
JAN15 = datetime(2027, 1, 15, tzinfo=UTC)
FEB = datetime(2027, 2, 1, tzinfo=UTC)


@pytest.fixture(params=["page", "per_close"])
def page_close(request, settings):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = request.param == "page"
    return request.param


def _ingest(tenant, events):
    return usage.record_meter_events(tenant_id=tenant.id, livemode=False, events=events)


def _event(customer, value, at=None):
    event = {"event_name": "api_calls", "payload": {"stripe_customer_id": customer.id, "value": str(value)}}
    if at is not None:
        event["timestamp"] = int(at.timestamp())
    return event


def _metered(tenant, meter, amount, nickname):
    return create_price(
        tenant_id=tenant.id,
        livemode=False,
        amount=amount,
        currency="usd",
        interval="month",
        nickname=nickname,
        recurring={"usage_type": "metered", "meter": meter.id},
    )


def _setup(book, tenant=None):
    """A clock at Jan 1 2027; licensed 1,000/month + metered 3 cents a unit; January billed; 40 units by Jan 15."""
    tenant = tenant or book.tenant()
    clock = make_clock(tenant, T0)
    customer = book.customer(tenant, clock=clock)
    meter = usage.create_meter(
        tenant_id=tenant.id, livemode=False, display_name="API", event_name="api_calls", formula="sum"
    )
    cheap, dear = _metered(tenant, meter, 3, "Calls"), _metered(tenant, meter, 5, "Calls+")
    licensed = create_price(tenant_id=tenant.id, livemode=False, amount=1000, currency="usd", interval="month")
    sub = create_subscription(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=customer.id,
        items=[{"price": licensed.id, "quantity": 1}, {"price": cheap.id, "quantity": 1}],
    )
    advance(clock, T0 + timedelta(hours=1))  # January billed in advance: 1,000, no usage
    _ingest(tenant, [_event(customer, 25)])  # Jan 1 01:00
    advance(clock, JAN15)
    _ingest(tenant, [_event(customer, 15)])  # Jan 15 00:00, the change's instant: before it is billed up to it
    item = SubscriptionItem.objects.get(subscription_id=sub.id, price=cheap)
    return tenant, clock, customer, sub, item, licensed, cheap, dear


def _cycle(sub, start):
    return Invoice.objects.get(subscription_id=sub.id, billing_reason="subscription_cycle", period_start=start)


def _lines(invoice):
    return [(line.price_id, line.quantity, line.amount) for line in invoice.lines.all()]


def test_a_metered_item_removed_mid_period_bills_its_usage_so_far_on_the_next_invoice(book, page_close):
    tenant, clock, customer, sub, item, licensed, cheap, _ = _setup(book)
    advance(clock, JAN15 + timedelta(seconds=1))  # the 15 units at Jan 15 00:00 are before the change
    change_subscription(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, items=[{"id": item.id, "deleted": True}]
    )
    pending = InvoiceItem.objects.get(subscription_id=sub.id, invoice__isnull=True, price=cheap)
    assert (pending.quantity, pending.amount, pending.proration) == (40, 40 * 3, False)
    assert (pending.period_start, pending.period_end) == (T0, JAN15 + timedelta(seconds=1))
    assert Customer.objects.get(pk=customer.id).usage_billed_until == {
        cheap.meter_id: (JAN15 + timedelta(seconds=1)).isoformat()
    }

    # A late event of the billed window, inside the grace, is refused: it could be billed by nobody now.
    late = _ingest(tenant, [_event(customer, 99, JAN15 - timedelta(minutes=10))])
    assert (late[0].status, late[0].error["code"]) == ("refused", "timestamp_too_old")

    advance(clock, FEB + timedelta(hours=2))
    february = _cycle(sub, FEB)
    assert _lines(february) == [(licensed.id, 1, 1000), (cheap.id, 40, 120)]
    assert february.total == 1120
    assert not InvoiceItem.objects.filter(subscription_id=sub.id, invoice__isnull=True).exists()


def test_a_metered_item_re_priced_with_always_invoice_bills_the_old_price_at_once_and_the_new_from_the_change(
    book, page_close
):
    tenant, clock, customer, sub, item, licensed, cheap, dear = _setup(book)
    _sub, invoice = change_subscription(
        tenant_id=tenant.id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": item.id, "price": dear.id}],
        proration_behavior="always_invoice",
    )
    # Only the usage before Jan 15 00:00 (25 units): the 15 at the very instant fall in the new window.
    assert invoice is not None and (invoice.billing_reason, invoice.status) == ("subscription_update", "paid")
    assert _lines(invoice) == [(cheap.id, 25, 25 * 3)]
    assert (invoice.period_start, invoice.total) == (T0, 75)
    assert SubscriptionItem.objects.get(pk=item.id).usage_since == JAN15

    advance(clock, datetime(2027, 1, 20, tzinfo=UTC))
    _ingest(tenant, [_event(customer, 10)])
    advance(clock, FEB + timedelta(hours=2))
    february = _cycle(sub, FEB)
    # The new price bills [Jan 15, Feb 1) only: 15 + 10 units × 5; the first 25 are not billed again.
    assert _lines(february) == [(licensed.id, 1, 1000), (dear.id, 25, 125)]
    metered_line = february.lines.get(price=dear)
    assert (metered_line.period_start, metered_line.period_end) == (JAN15, FEB)
    assert february.total == 1125


def test_negative_control_without_the_items_usage_start_the_close_bills_the_changed_window_again(book, monkeypatch):
    tenant, clock, _customer, sub, item, licensed, _cheap, dear = _setup(book)
    change_subscription(
        tenant_id=tenant.id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": item.id, "price": dear.id}],
        proration_behavior="always_invoice",
    )
    monkeypatch.setattr(usage, "item_window", lambda item, start, end: (start, end))
    advance(clock, FEB + timedelta(hours=2))
    # All 40 of January at the new price: the 25 billed by the change are billed a second time.
    assert _lines(_cycle(sub, FEB)) == [(licensed.id, 1, 1000), (dear.id, 40, 200)]


def test_negative_control_without_billing_at_the_change_a_removed_items_usage_is_lost(book, monkeypatch):
    from billing.services import changes

    tenant, clock, _customer, sub, item, licensed, _cheap, _ = _setup(book)
    monkeypatch.setattr(changes, "usage_until_locked", lambda sub, items, at: [])
    change_subscription(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, items=[{"id": item.id, "deleted": True}]
    )
    advance(clock, FEB + timedelta(hours=2))
    assert _lines(_cycle(sub, FEB)) == [(licensed.id, 1, 1000)]


@pytest.mark.parametrize("prorate", [False, True])
def test_an_immediate_cancel_bills_the_partial_periods_usage_on_a_final_invoice_once(book, prorate):
    tenant, clock, customer, sub, _item, _licensed, cheap, _ = _setup(book)
    advance(clock, JAN15 + timedelta(seconds=1))
    cancel_subscription(tenant_id=tenant.id, livemode=False, subscription_id=sub.id, prorate=prorate)
    final = Invoice.objects.get(subscription_id=sub.id, billing_reason="subscription_update")
    assert (final.status, final.period_start, final.period_end) == ("open", T0, JAN15 + timedelta(seconds=1))
    assert _lines(final) == [(cheap.id, 40, 120)]
    assert final.change_key == f"final_usage:{sub.id}:{T0.isoformat()}"
    late = _ingest(tenant, [_event(customer, 7, JAN15 - timedelta(minutes=1))])
    assert late[0].error["code"] == "timestamp_too_old"

    reconcile(livemode=False)  # the billing tick's reconciler charges it
    reconcile(livemode=False)
    final.refresh_from_db()
    assert (final.status, final.amount_paid) == ("paid", 120)
    advance(clock, FEB + timedelta(hours=2))
    assert Invoice.objects.filter(subscription_id=sub.id).count() == 2  # January's cycle invoice and the final one


def test_an_immediate_cancel_through_the_api_bills_the_usage_and_without_usage_makes_no_final_invoice(book):
    acme = make_keys("Acme")
    _tenant, _clock, _customer, sub, _item, _licensed, cheap, _ = _setup(book, acme.tenant)
    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/cancel", {})
    assert status == 200, body
    assert body["status"] == "canceled"
    assert _lines(Invoice.objects.get(subscription_id=sub.id, billing_reason="subscription_update")) == [
        (cheap.id, 25, 75)
    ]

    other = book.tenant()
    clock2 = make_clock(other, T0)
    quiet = book.customer(other, clock=clock2)
    meter = usage.create_meter(
        tenant_id=other.id, livemode=False, display_name="API", event_name="api_calls", formula="sum"
    )
    price = _metered(other, meter, 3, "Calls")
    idle = create_subscription(
        tenant_id=other.id, livemode=False, customer_id=quiet.id, items=[{"price": price.id, "quantity": 1}]
    )
    advance(clock2, JAN15)
    cancel_subscription(tenant_id=other.id, livemode=False, subscription_id=idle.id)
    assert not Invoice.objects.filter(subscription_id=idle.id, billing_reason="subscription_update").exists()


@pytest.mark.parametrize("hold", [True, False])
def test_a_change_counts_an_insert_in_flight_and_holds_later_inserts_until_it_commits(book, monkeypatch, hold):
    """The change waits for an insert that has validated but not committed (its event is billed by the change), and
    an insert arriving while the change's transaction is open waits for its commit, then is refused. Without the
    hold (the negative control) that insert does not wait, reads the old cutoff, and is accepted: its event falls
    in the window the change billed, so no close would ever bill it."""
    import threading

    from django.db import connections, transaction

    from billing import queries
    from billing.services import changes

    if not hold:
        monkeypatch.setattr(queries, "usage_hold_locked", lambda: None)

    tenant, clock, customer, sub, item, _licensed, cheap, _ = _setup(book)
    advance(clock, JAN15 + timedelta(seconds=1))
    in_flight, release, changed, after = threading.Event(), threading.Event(), threading.Event(), {}

    def slow_insert():
        try:
            with transaction.atomic():
                _ingest(tenant, [_event(customer, 9, JAN15)])
                in_flight.set()
                release.wait(20)
        finally:
            connections.close_all()

    real = changes._write_usage_until

    def write_then_wait(*args, **kwargs):
        written = real(*args, **kwargs)
        changed.set()
        # A later insert started now must wait for this transaction: give it the time to try.
        late = threading.Thread(target=late_insert)
        late.start()
        late.join(1.0)
        after["waited"] = late.is_alive()
        after["thread"] = late
        return written

    def late_insert():
        try:
            after["late"] = _ingest(tenant, [_event(customer, 5, JAN15)])
        finally:
            connections.close_all()

    def change():
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(changes, "_write_usage_until", write_then_wait)
                change_subscription(
                    tenant_id=tenant.id,
                    livemode=False,
                    subscription_id=sub.id,
                    items=[{"id": item.id, "deleted": True}],
                )
        finally:
            connections.close_all()

    writer = threading.Thread(target=slow_insert)
    writer.start()
    assert in_flight.wait(20)
    changer = threading.Thread(target=change)
    changer.start()
    changer.join(1.0)
    assert changer.is_alive() and not changed.is_set()  # waiting for the insert in flight
    release.set()
    writer.join(20)
    changer.join(30)
    after["thread"].join(20)
    if hold:
        assert after["waited"]
        assert (after["late"][0].status, after["late"][0].error["code"]) == ("refused", "timestamp_too_old")
    else:
        assert not after["waited"] and after["late"][0].status == "accepted"
    pending = InvoiceItem.objects.get(subscription_id=sub.id, invoice__isnull=True, price=cheap)
    assert (pending.quantity, pending.amount) == (40 + 9, 49 * 3)


def _schedule(tenant, sub, items):
    change_subscription(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, items=items, effective_at="period_end"
    )


def test_a_metered_item_removed_at_the_periods_end_bills_that_periods_usage_once_on_the_close(book, page_close):
    tenant, clock, customer, sub, item, licensed, cheap, _ = _setup(book)
    _schedule(tenant, sub, [{"id": item.id, "deleted": True}])
    assert not InvoiceItem.objects.filter(subscription_id=sub.id).exists()  # nothing billed at the scheduling
    advance(clock, datetime(2027, 1, 31, 23, 50, tzinfo=UTC))
    _ingest(tenant, [_event(customer, 2)])
    # Sent inside the grace, after the period's end: still January's usage, of the item the change removes.
    advance(clock, FEB + timedelta(minutes=30))
    late = _ingest(tenant, [_event(customer, 3, datetime(2027, 1, 31, 23, 59, tzinfo=UTC))])
    assert late[0].status == "accepted"

    advance(clock, FEB + timedelta(hours=2))
    february = _cycle(sub, FEB)
    # February's licensed 1,000 and January's 25 + 15 + 2 + 3 = 45 units × 3 of the removed item.
    assert _lines(february) == [(licensed.id, 1, 1000), (cheap.id, 45, 135)]
    usage_line = february.lines.get(price=cheap)
    assert (usage_line.period_start, usage_line.period_end, usage_line.subscription_item) == (T0, FEB, item.id)
    assert february.total == 1135
    assert list(SubscriptionItem.objects.filter(subscription_id=sub.id).values_list("price_id", flat=True)) == [
        licensed.id
    ]

    # March bills the licensed item alone: the removed item's usage is not billed again.
    advance(clock, datetime(2027, 3, 1, 2, tzinfo=UTC))
    assert _lines(_cycle(sub, datetime(2027, 3, 1, tzinfo=UTC))) == [(licensed.id, 1, 1000)]


def test_a_metered_item_re_priced_at_the_periods_end_bills_the_old_price_then_the_new_from_the_boundary(
    book, page_close
):
    tenant, clock, customer, sub, item, licensed, cheap, dear = _setup(book)
    _schedule(tenant, sub, [{"id": item.id, "price": dear.id}])
    advance(clock, FEB + timedelta(minutes=30))
    _ingest(tenant, [_event(customer, 5, datetime(2027, 1, 31, 23, 45, tzinfo=UTC))])  # January's, late
    _ingest(tenant, [_event(customer, 7)])  # Feb 1 00:30: February's, under the new price

    advance(clock, FEB + timedelta(hours=2))
    february = _cycle(sub, FEB)
    # January's 25 + 15 + 5 = 45 units at the old 3 cents, not the new 5.
    assert _lines(february) == [(licensed.id, 1, 1000), (cheap.id, 45, 135)]
    assert SubscriptionItem.objects.get(pk=item.id).price_id == dear.id

    advance(clock, datetime(2027, 2, 10, tzinfo=UTC))
    _ingest(tenant, [_event(customer, 10)])
    advance(clock, datetime(2027, 3, 1, 2, tzinfo=UTC))
    march = _cycle(sub, datetime(2027, 3, 1, tzinfo=UTC))
    # February's 7 + 10 units at 5 cents, over the whole of February; January's are not billed again.
    assert _lines(march) == [(licensed.id, 1, 1000), (dear.id, 17, 85)]
    line = march.lines.get(price=dear)
    assert (line.period_start, line.period_end) == (FEB, datetime(2027, 3, 1, tzinfo=UTC))


def test_negative_control_usage_taken_after_the_scheduled_change_loses_the_removed_items_usage(book, monkeypatch):
    from billing.services import close

    tenant, clock, _customer, sub, item, licensed, _cheap, _ = _setup(book)
    monkeypatch.setattr(close, "usage_before_schedule_locked", lambda sub: None)
    _schedule(tenant, sub, [{"id": item.id, "deleted": True}])
    advance(clock, FEB + timedelta(hours=2))
    assert _lines(_cycle(sub, FEB)) == [(licensed.id, 1, 1000)]
