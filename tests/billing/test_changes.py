"""Changing a subscription's items: prorations to the minor unit (hand-computed), always_invoice charged once,
none, and a leap-year February. Every subscription here is on a test clock, so "now" is the clock's."""

from datetime import UTC, datetime

import pytest

from billing.models import Invoice, InvoiceItem, PaymentAttempt, SubscriptionItem, TestClock
from billing.services.changes import request_change_key
from billing.services.drain import drain_due
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events


@pytest.fixture
def acme(book):
    return make_keys("Acme")


def _clocked(book, tenant, *, anchor, currency="usd", amount=1000, quantity=1):
    """A subscription on a clock at ``anchor``, its first period billed (paid)."""
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=anchor)
    customer = book.customer(tenant, clock=clock, currency=currency)
    price = book.price(tenant, amount=amount, currency=currency)
    price.nickname = "Basic"
    price.save()
    sub = book.subscription(customer, price, anchor=anchor, quantity=quantity)
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)
    assert Invoice.objects.get(subscription=sub).status == "paid"
    return clock, sub


def _move(clock, at):
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=at)


def _bill_next_period(tenant, clock, at):
    _move(clock, at)
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)


def _item(sub):
    return SubscriptionItem.objects.get(subscription=sub)


def _pro(book, tenant, amount, currency="usd"):
    price = book.price(tenant, amount=amount, currency=currency)
    price.nickname = "Pro"
    price.save()
    return price


def test_an_upgrade_halfway_through_a_30_day_month_in_usd(book, acme, stripe_proxy):
    # April has 30 days; April 16 00:00 leaves 15 of them: exactly half.
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    pro = _pro(book, acme.tenant, 2999)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))

    status, body = Api(acme.test).post(
        f"/v1/subscriptions/{sub.id}", {"items": [{"id": _item(sub).id, "price": pro.id}]}
    )

    assert status == 200, body
    assert [(i["price"]["id"], i["quantity"]) for i in body["items"]["data"]] == [(pro.id, 1)]
    assert body["price"] == pro.id
    prorations = list(InvoiceItem.objects.filter(subscription=sub).order_by("id"))
    assert [(p.amount, p.proration, p.invoice_id) for p in prorations] == [(-500, True, None), (1500, True, None)]
    assert [p.description for p in prorations] == [
        "Unused time on 1 × Basic after Apr 16, 2027",
        "Remaining time on 1 × Pro after Apr 16, 2027",
    ]
    assert {(p.period_start, p.period_end) for p in prorations} == {
        (datetime(2027, 4, 16, tzinfo=UTC), datetime(2027, 5, 1, tzinfo=UTC))
    }
    (updated,) = [e for e in events("subscription.updated", data__id=sub.id) if "previous_attributes" in e.data]
    assert updated.data["previous_attributes"]["items"]["data"][0]["price"]["amount"] == 1000

    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))

    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [(line.amount, line.proration) for line in may.lines.all()] == [(2999, False), (-500, True), (1500, True)]
    assert (may.subtotal, may.amount_paid, may.status) == (3999, 3999, "paid")


def test_an_upgrade_in_jpy_rounds_each_line_once_half_away_from_zero(book, acme, stripe_proxy):
    # Apr 11 10:00 → May 1: 1,692,000 of 2,592,000 s. Credit −980 × that = −639.72 → −640;
    # charge 3,333 × that = 2,175.71 → 2,176 (yen have no minor unit).
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), currency="jpy", amount=980)
    pro = _pro(book, acme.tenant, 3333, currency="jpy")
    _move(clock, datetime(2027, 4, 11, 10, tzinfo=UTC))

    status, body = Api(acme.test).post(
        f"/v1/subscriptions/{sub.id}", {"items": [{"id": _item(sub).id, "price": pro.id}]}
    )

    assert status == 200, body
    assert list(InvoiceItem.objects.filter(subscription=sub).order_by("id").values_list("amount", "currency")) == [
        (-640, "jpy"),
        (2176, "jpy"),
    ]

    # May's invoice: ¥3,333 − 640 + 2,176 = ¥4,869, charged as 4869 yen (never scaled to "cents").
    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))
    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [line.amount for line in may.lines.all()] == [3333, -640, 2176]
    assert (may.currency, may.total, may.amount_paid, may.status) == ("jpy", 4869, 4869, "paid")
    charge = stripe_proxy.entries("POST /v1/payment_intents")[-1].request.params
    assert (charge["amount"], charge["currency"]) == ("4869", "jpy")


def test_a_jan_31_anchor_changed_on_feb_15_of_a_leap_year(book, acme, stripe_proxy):
    # The period is Jan 31 → Feb 29 2028 (29 days); Feb 15 leaves 14: credit −1000 × 14/29 = −482.76 → −483,
    # charge 2000 × 14/29 = 965.52 → 966.
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2028, 1, 31, tzinfo=UTC))
    pro = _pro(book, acme.tenant, 2000)
    _move(clock, datetime(2028, 2, 15, tzinfo=UTC))

    status, _ = Api(acme.test).post(f"/v1/subscriptions/{sub.id}", {"items": [{"id": _item(sub).id, "price": pro.id}]})

    assert status == 200
    prorations = list(InvoiceItem.objects.filter(subscription=sub).order_by("id"))
    assert [p.amount for p in prorations] == [-483, 966]
    assert prorations[0].period_end == datetime(2028, 2, 29, tzinfo=UTC)


def test_always_invoice_charges_a_quantity_change_once_even_when_retried(book, acme, stripe_proxy):
    # 3 → 5 seats of 1000 with half the period left: credit −1500, charge 2500, invoiced now: 1000.
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)
    body = {"items": [{"id": _item(sub).id, "quantity": 5}], "proration_behavior": "always_invoice"}

    first = api.post(f"/v1/subscriptions/{sub.id}", body, headers={"Idempotency-Key": "seats-5"})
    again = api.post(f"/v1/subscriptions/{sub.id}", body, headers={"Idempotency-Key": "seats-5"})
    plain_retry = api.post(f"/v1/subscriptions/{sub.id}", body)

    assert first[0] == again[0] == plain_retry[0] == 200, first
    assert first == again
    (invoice,) = Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")
    assert [line.amount for line in invoice.lines.all()] == [-1500, 2500]
    assert (invoice.total, invoice.amount_paid, invoice.status) == (1000, 1000, "paid")
    # Made under a key, the invoice records the request (a retry after a death mid-way finds it: decision 0196).
    assert invoice.change_key == request_change_key(sub.id, "seats-5")
    charges = [e for e in stripe_proxy.entries("POST /v1/payment_intents") if e.request.params["amount"] == "1000"]
    assert len(charges) == 1
    assert PaymentAttempt.objects.filter(invoice=invoice, outcome="succeeded").count() == 1
    assert _item(sub).quantity == 5
    assert not InvoiceItem.objects.filter(invoice__isnull=True).exists()
    # The immediate proration invoice is announced once, with its lines, as Stripe's invoice.created.
    (created,) = events("invoice.created", data__id=invoice.id)
    assert created.data["billing_reason"] == "subscription_update"
    assert [(line["amount"], line["proration"]) for line in created.data["lines"]] == [(-1500, True), (2500, True)]
    updated = [e for e in events("subscription.updated", data__id=sub.id) if "previous_attributes" in e.data]
    assert [e.data["previous_attributes"]["items"]["data"][0]["quantity"] for e in updated] == [3]


def test_none_applies_the_new_items_from_the_next_invoice_without_prorations(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    pro = _pro(book, acme.tenant, 2999)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))

    status, _ = Api(acme.test).post(
        f"/v1/subscriptions/{sub.id}",
        {
            "items": [{"id": _item(sub).id, "deleted": True}, {"price": pro.id, "quantity": 2}],
            "proration_behavior": "none",
        },
    )

    assert status == 200
    assert not InvoiceItem.objects.exists()
    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))
    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [(line.price_id, line.quantity, line.amount) for line in may.lines.all()] == [(pro.id, 2, 5998)]


def test_bad_changes_are_refused_and_change_nothing(book, acme):
    _clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    euro = book.price(acme.tenant, currency="eur")
    yearly = book.price(acme.tenant, interval="year")
    item = _item(sub)
    api = Api(acme.test)

    cases = [
        ({"items": [{"price": euro.id}]}, 422, "items[0]"),
        ({"items": [{"id": item.id, "price": yearly.id}]}, 422, "items[0]"),
        ({"items": [{"id": item.id, "deleted": True}]}, 422, "items"),
        ({"items": [{"id": "si_00000000000000000000000000"}]}, 404, "items[0][id]"),
        ({"items": [{"price": item.price_id}]}, 422, "items[0]"),
        ({"items": [{"id": item.id, "quantity": 2}], "proration_date": 0}, 422, "proration_date"),
    ]
    for body, status, param in cases:
        got, error = api.post(f"/v1/subscriptions/{sub.id}", body)
        assert (got, error["error"]["param"]) == (status, param), (body, error)
    assert (_item(sub).price_id, _item(sub).quantity) == (item.price_id, 1)
    assert not InvoiceItem.objects.exists()
    assert all("previous_attributes" not in e.data for e in events("subscription.updated", data__id=sub.id))


def _row_counts():
    from billing.models import InvoiceLineItem, LedgerEntry, Subscription
    from outbox.models import Event

    return {
        model.__name__: model.objects.count()
        for model in (Invoice, InvoiceLineItem, InvoiceItem, SubscriptionItem, Subscription, LedgerEntry, Event)
    }


def test_a_preview_then_the_change_with_its_proration_date_agree_exactly_and_the_preview_writes_nothing(
    book, acme, stripe_proxy
):
    import json

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    pro = _pro(book, acme.tenant, 2999)
    InvoiceItem.objects.create(
        tenant=acme.tenant,
        livemode=False,
        customer_id=sub.customer_id,
        amount=-200,
        currency="usd",
        period_start=datetime(2027, 4, 2, tzinfo=UTC),
        period_end=datetime(2027, 4, 2, tzinfo=UTC),
    )
    previewed_at = datetime(2027, 4, 11, 10, tzinfo=UTC)
    _move(clock, previewed_at)
    proposed = [{"id": _item(sub).id, "quantity": 1}, {"price": pro.id}]
    api = Api(acme.test)

    before = _row_counts()
    status, preview = api.get(
        "/v1/invoices/upcoming",
        {"subscription": sub.id, "items": json.dumps(proposed), "proration_date": str(int(previewed_at.timestamp()))},
    )
    assert status == 200, preview
    assert _row_counts() == before

    # Quantity 3 → 1 of 1000 and a new 2999, 1,692,000 of 2,592,000 s left: −3000 × … = −1958.33 → −1958,
    # +1000 × … = 652.78 → 653, +2999 × … = 1957.68 → 1958.
    assert [(line["amount"], line["proration"]) for line in preview["lines"]] == [
        (1000, False),
        (2999, False),
        (-200, False),
        (-1958, True),
        (653, True),
        (1958, True),
    ]
    assert (preview["id"], preview["subtotal"], preview["amount_due"]) == (None, 4452, 4452)
    assert preview["period_start"] == "2027-05-01T00:00:00Z"

    _move(clock, datetime(2027, 4, 12, tzinfo=UTC))  # the change comes a little later, with the preview's date
    status, _ = api.post(
        f"/v1/subscriptions/{sub.id}", {"items": proposed, "proration_date": int(previewed_at.timestamp())}
    )
    assert status == 200
    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))
    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [(line.amount, line.description) for line in may.lines.all()] == [
        (line["amount"], line["description"]) for line in preview["lines"]
    ]
    assert (may.subtotal, may.amount_due) == (preview["subtotal"], preview["amount_due"])


def test_a_downgrade_at_period_end_bills_the_new_items_from_the_next_period_without_prorations(
    book, acme, stripe_proxy
):
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), amount=2999)
    cheap = _pro(book, acme.tenant, 1000)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)

    status, body = api.post(
        f"/v1/subscriptions/{sub.id}",
        {"items": [{"id": _item(sub).id, "price": cheap.id}], "effective_at": "period_end"},
    )

    assert status == 200, body
    assert body["scheduled_change"] == {
        "effective_at": "2027-05-01T00:00:00Z",
        "items": [{"id": _item(sub).id, "price": cheap.id, "quantity": 1}],
    }
    assert body["items"]["data"][0]["price"]["amount"] == 2999  # unchanged until then
    assert not InvoiceItem.objects.exists()
    status, preview = api.get("/v1/invoices/upcoming", {"subscription": sub.id})
    assert [line["amount"] for line in preview["lines"]] == [1000]

    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))

    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [(line.price_id, line.amount) for line in may.lines.all()] == [(cheap.id, 1000)]
    sub.refresh_from_db()
    assert (sub.scheduled_items, sub.price_id, _item(sub).price_id) == (None, cheap.id, cheap.id)


def test_cancel_with_proration_credits_the_unused_time_to_the_balance(book, acme, stripe_proxy):
    # 3 seats of 1000, canceled on Apr 11 10:00: 3000 × 1,692,000 / 2,592,000 = 1958.33 → 1958 credited.
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 11, 10, tzinfo=UTC))

    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/cancel", {"prorate": True})

    assert status == 200, body
    assert (body["status"], body["ended_at"]) == ("canceled", "2027-04-11T10:00:00Z")
    from billing.models import Customer, LedgerEntry

    entry = LedgerEntry.objects.get(customer_id=sub.customer_id)
    assert (entry.reason, entry.amount, entry.balance_after, entry.created_at) == (
        "proration_credit",
        1958,
        1958,
        datetime(2027, 4, 11, 10, tzinfo=UTC),
    )
    assert entry.description.startswith("Unused time on 3 × Basic after Apr 11, 2027")
    assert Customer.objects.get(pk=sub.customer_id).credit_balance == 1958
    assert [e.data["amount"] for e in events("customer.credit_granted")] == [1958]


def test_cancel_with_proration_of_a_discounted_period_credits_what_was_paid(book, acme, stripe_proxy):
    # 3 seats of 1000 at 25 % off: 2250 paid for April. Canceled on Apr 11 10:00:
    # 2250 × 1,692,000 / 2,592,000 = 1468.75 → 1469 credited (the undiscounted 3000 would give 1958).
    from decimal import Decimal

    from billing.models import LedgerEntry
    from billing.services import discounts

    anchor = datetime(2027, 4, 1, tzinfo=UTC)
    clock = TestClock.objects.create(tenant=acme.tenant, livemode=False, frozen_time=anchor)
    sub = book.subscription(
        book.customer(acme.tenant, clock=clock), _pro(book, acme.tenant, 1000), anchor=anchor, quantity=3
    )
    coupon = discounts.create_coupon(
        tenant_id=acme.tenant.id, livemode=False, percent_off=Decimal("25"), duration="forever"
    )
    discounts.set_subscription_discount(
        tenant_id=acme.tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )
    drain_due(livemode=False, trigger="test_clock", tenant_id=acme.tenant.id, test_clock_id=clock.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.total, invoice.status) == (2250, "paid")
    _move(clock, datetime(2027, 4, 11, 10, tzinfo=UTC))

    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/cancel", {"prorate": True})

    assert status == 200, body
    entry = LedgerEntry.objects.get(customer_id=sub.customer_id)
    assert (entry.reason, entry.amount) == ("proration_credit", 1469)


def test_cancel_at_period_end_with_prorate_is_refused(book, acme):
    _clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    status, body = Api(acme.test).post(f"/v1/subscriptions/{sub.id}/cancel", {"prorate": True, "at_period_end": True})
    assert (status, body["error"]["code"]) == (422, "prorate_conflict")
    sub.refresh_from_db()
    assert (sub.status, sub.cancel_at_period_end) == ("active", False)


def test_a_change_racing_the_close_lands_wholly_after_the_period_was_invoiced(book, acme, stripe_proxy, settings):
    # The change waits on the subscription's row lock while the close of May holds it: May's invoice bills the
    # old item whole, and the change then prorates May (its period now), not April.
    import threading

    from django.db import connection

    from billing.services import close as close_module
    from billing.services.changes import change_subscription

    settings.HARDCOUNT_BILLING_PAGE_CLOSE = False  # the per-close path, whose step 1 the test holds open
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    pro = _pro(book, acme.tenant, 2000)
    _move(clock, datetime(2027, 5, 1, tzinfo=UTC))
    item_id = _item(sub).id
    prepared, release = threading.Event(), threading.Event()
    original = close_module.materialise_period_invoice

    def slow_materialise(*args, **kwargs):
        result = original(*args, **kwargs)
        prepared.set()
        release.wait(10)
        return result

    close_module.materialise_period_invoice = slow_materialise
    try:
        drainer = threading.Thread(
            target=lambda: (
                drain_due(livemode=False, trigger="test_clock", tenant_id=acme.tenant.id, test_clock_id=clock.id),
                connection.close(),
            )
        )
        drainer.start()
        assert prepared.wait(20)
        changed = {}

        def change():
            try:
                changed["sub"] = change_subscription(
                    tenant_id=acme.tenant.id,
                    livemode=False,
                    subscription_id=sub.id,
                    items=[{"id": item_id, "price": pro.id}],
                )
            finally:
                connection.close()

        changer = threading.Thread(target=change)
        changer.start()
        changer.join(1)
        assert changer.is_alive(), "the change waits for the close's lock"
        release.set()
        drainer.join(30)
        changer.join(30)
    finally:
        close_module.materialise_period_invoice = original

    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert [line.amount for line in may.lines.all()] == [1000]
    prorations = list(InvoiceItem.objects.filter(subscription=sub).order_by("id"))
    assert [(p.amount, p.period_start, p.period_end) for p in prorations] == [
        (-1000, datetime(2027, 5, 1, tzinfo=UTC), datetime(2027, 6, 1, tzinfo=UTC)),
        (2000, datetime(2027, 5, 1, tzinfo=UTC), datetime(2027, 6, 1, tzinfo=UTC)),
    ]


def _uncharged_change(monkeypatch, tenant_id, sub):
    """A 3 → 5 always_invoice change whose own charge found the invoice taken (as when the reconciler got there
    first): the change stands, its invoice is left open for the one charging it."""
    from billing.services import changes
    from billing.services.payments import PaymentInFlight

    def taken(*args, **kwargs):
        raise PaymentInFlight("A payment of this invoice is in flight.")

    monkeypatch.setattr(changes, "pay_invoice", taken)
    _sub, invoice = changes.change_subscription(
        tenant_id=tenant_id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": _item(sub).id, "quantity": 5}],
        proration_behavior="always_invoice",
    )
    monkeypatch.undo()
    assert (invoice.status, invoice.payment_attempts.count()) == ("open", 0)
    return invoice


def test_the_reconciler_charges_a_change_invoice_left_uncharged_once_the_in_flight_window_passed(
    book, acme, stripe_proxy, monkeypatch
):
    from datetime import timedelta

    from billing.services.drain import reconcile
    from billing.services.payments import in_flight_window

    customer = book.customer(acme.tenant)
    sub = book.subscription(customer, book.price(acme.tenant, amount=1000), quantity=3)
    drain_due(livemode=False, trigger="manual", tenant_id=acme.tenant.id)
    invoice = _uncharged_change(monkeypatch, acme.tenant.id, sub)

    # Negative control: younger than the window, its request may still be about to charge it.
    assert reconcile(livemode=False)["payments_resolved"] == 0
    assert Invoice.objects.get(pk=invoice.pk).status == "open"

    Invoice.objects.filter(pk=invoice.pk).update(created_at=invoice.created_at - in_flight_window() - timedelta(1))
    assert reconcile(livemode=False)["payments_resolved"] == 1
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid) == ("paid", invoice.amount_due)
    assert PaymentAttempt.objects.filter(invoice=invoice, outcome="succeeded").count() == 1
    assert reconcile(livemode=False)["payments_resolved"] == 0


def test_on_a_test_clock_the_reconciler_charges_an_uncharged_change_invoice_at_once(
    book, acme, stripe_proxy, monkeypatch
):
    from billing.services.drain import reconcile

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    invoice = _uncharged_change(monkeypatch, acme.tenant.id, sub)

    assert reconcile(livemode=False)["payments_resolved"] == 1
    invoice.refresh_from_db()
    assert (invoice.status, invoice.total, invoice.amount_paid) == ("paid", 1000, 1000)
    assert invoice.payment_attempts.get().started_at == datetime(2027, 4, 16, tzinfo=UTC)


def test_the_reconciler_leaves_an_uncharged_change_invoice_of_a_paused_subscription_until_it_resumes(
    book, acme, stripe_proxy, monkeypatch
):
    from billing.services.drain import reconcile
    from billing.services.pausing import update_pause_collection

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    invoice = _uncharged_change(monkeypatch, acme.tenant.id, sub)
    pause = {"tenant_id": acme.tenant.id, "livemode": False, "subscription_id": sub.id}
    update_pause_collection(**pause, pause_collection={"behavior": "keep_as_draft", "resumes_at": None})

    assert reconcile(livemode=False)["payments_resolved"] == 0
    assert Invoice.objects.get(pk=invoice.pk).status == "open"
    # The first period's charge was 3000; nothing of the change's 1000 reached the gateway.
    assert [e.request.params["amount"] for e in stripe_proxy.entries("POST /v1/payment_intents")] == ["3000"]

    update_pause_collection(**pause, pause_collection=None)
    assert reconcile(livemode=False)["payments_resolved"] == 1
    assert Invoice.objects.get(pk=invoice.pk).status == "paid"


def test_the_migration_gives_earlier_prorations_back_the_inputs_the_change_records(book, acme, stripe_proxy):
    # Migration 0015 backfills proration items written before it: the same inputs the change writes today
    # (−1000 and +2999 over 1,692,000 of April's 2,592,000 s), so the doctor's recomputation holds for them too.
    import importlib

    from django.apps import apps

    migration = importlib.import_module("billing.migrations.0016_proration_inputs_and_cycle_restart")
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    pro = _pro(book, acme.tenant, 2999)
    _move(clock, datetime(2027, 4, 11, 10, tzinfo=UTC))
    assert (
        Api(acme.test).post(f"/v1/subscriptions/{sub.id}", {"items": [{"id": _item(sub).id, "price": pro.id}]})[0]
        == 200
    )
    fields = ("amount", "proration_full_amount", "proration_remaining_s", "proration_period_s")
    recorded = list(InvoiceItem.objects.filter(subscription=sub).order_by("id").values_list(*fields))
    assert recorded == [(-653, -1000, 1_692_000, 2_592_000), (1958, 2999, 1_692_000, 2_592_000)]

    InvoiceItem.objects.update(proration_full_amount=None, proration_remaining_s=None, proration_period_s=None)
    migration.backfill(apps, None)

    assert list(InvoiceItem.objects.filter(subscription=sub).order_by("id").values_list(*fields)) == recorded


@pytest.mark.parametrize(
    ("items", "param", "message"),
    [
        ("not json", "items", "items must be a JSON array."),
        ('[{"id": "ITEM", "bogus": 1}]', "items.0.bogus", "items.0.bogus: Unknown parameter."),
        ('[{"id": "ITEM", "quantity": -1}]', "items.0.quantity", None),
    ],
)
def test_a_preview_with_bad_proposed_items_names_the_offending_field_as_a_body_would(book, acme, items, param, message):
    sub = book.subscribed(acme.tenant)
    status, body = Api(acme.test).get(
        "/v1/invoices/upcoming", {"subscription": sub.id, "items": items.replace("ITEM", _item(sub).id)}
    )
    assert status == 422, body
    assert (body["error"]["code"], body["error"]["param"]) == ("items_invalid", param)
    assert "ErrorDetail" not in body["error"]["message"] and body["error"]["message"].startswith(param)
    if message:
        assert body["error"]["message"] == message


class _Killed(BaseException):
    """A request's process dying mid-way: no ``except Exception`` catches it, so the idempotency layer neither
    stores an answer nor drops the key's claim, and nothing after the kill point runs."""


def _die(*args, **kwargs):
    raise _Killed


def subscription_data_of(sub):
    from billing.models import Subscription
    from billing.representations import subscription_data

    return subscription_data(Subscription.objects.get(pk=sub.pk))


def _age_claim(tenant, key):
    """Make the dead request's claim of ``key`` older than the stale threshold, as waiting it out would."""
    from datetime import timedelta

    from hardcount.idempotency import IN_FLIGHT_STALE
    from hardcount.models import IdempotencyRecord

    record = IdempotencyRecord.objects.get(tenant=tenant, key=key, completed_at__isnull=True)
    IdempotencyRecord.objects.filter(pk=record.pk).update(created_at=record.created_at - IN_FLIGHT_STALE - timedelta(1))


@pytest.mark.parametrize("change", ["quantity", "new_item"])
def test_a_keyed_always_invoice_retried_after_its_request_died_before_the_charge_charges_once_and_changes_nothing(
    book, acme, stripe_proxy, monkeypatch, change
):
    # On Apr 16 00:00 (half of April left), invoiced at once: 3 → 5 seats of 1000, −1500 + 2500 = 1000; or a new item
    # of 2,999, 1,499.5 → 1,500. The request dies after the change's transaction committed, before the charge.
    from billing.services import changes
    from billing.services.drain import reconcile

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)
    if change == "quantity":
        items, total, lines = [{"id": _item(sub).id, "quantity": 5}], 1000, 2
    else:  # asked again, the new item would be a second item of one price (422): the retry must not re-plan it
        items, total, lines = [{"price": _pro(book, acme.tenant, 2999).id}], 1500, 1
    body = {"items": items, "proration_behavior": "always_invoice"}
    key = {"Idempotency-Key": "seats-5-killed"}
    monkeypatch.setattr(changes, "pay_invoice", _die)
    with pytest.raises(_Killed):
        api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)
    monkeypatch.undo()
    (invoice,) = Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")
    assert (invoice.status, invoice.total, invoice.payment_attempts.count()) == ("open", total, 0)
    updates = len(events("subscription.updated", data__id=sub.id))
    after = [(i["id"], i["price"]["id"], i["quantity"]) for i in subscription_data_of(sub)["items"]["data"]]

    # While the dead request's claim is fresh the key is in use (it might still be running).
    status, error = api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)
    assert (status, error["error"]["code"]) == (409, "idempotency_key_in_use")

    _age_claim(acme.tenant, "seats-5-killed")
    status, answer = api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)

    # The retry finishes the first run: its invoice charged, once; the change not made again, nothing emitted.
    assert status == 200, answer
    assert [(i["id"], i["price"]["id"], i["quantity"]) for i in answer["items"]["data"]] == after
    assert list(Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")) == [invoice]
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid) == ("paid", total)
    assert invoice.change_key == request_change_key(sub.id, "seats-5-killed")
    assert [a.outcome for a in invoice.payment_attempts.all()] == ["succeeded"]
    charges = [e for e in stripe_proxy.entries("POST /v1/payment_intents") if e.request.params["amount"] == str(total)]
    assert len(charges) == 1
    assert InvoiceItem.objects.filter(subscription=sub).count() == lines
    assert len(events("subscription.updated", data__id=sub.id)) == updates
    # The answer is stored now: the same key replays it; the reconciler finds nothing left to charge.
    assert api.post(f"/v1/subscriptions/{sub.id}", body, headers=key) == (200, answer)
    assert reconcile(livemode=False)["payments_resolved"] == 0


def test_a_keyed_retry_of_a_charged_change_whose_answer_was_lost_charges_nothing_more(
    book, acme, stripe_proxy, monkeypatch
):
    # The first run charged its invoice, then died before its answer was stored: the retry answers, charges nothing.
    from billing.services import changes

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)
    body = {"items": [{"id": _item(sub).id, "quantity": 5}], "proration_behavior": "always_invoice"}
    key = {"Idempotency-Key": "seats-5-lost"}
    pay = changes.pay_invoice

    def pay_then_die(*args, **kwargs):
        pay(*args, **kwargs)
        raise _Killed

    monkeypatch.setattr(changes, "pay_invoice", pay_then_die)
    with pytest.raises(_Killed):
        api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)
    monkeypatch.undo()
    _age_claim(acme.tenant, "seats-5-lost")

    status, answer = api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)

    assert status == 200, answer
    (invoice,) = Invoice.objects.filter(subscription=sub, billing_reason="subscription_update")
    assert (invoice.status, invoice.amount_paid, invoice.payment_attempts.count()) == ("paid", 1000, 1)
    assert (
        len([e for e in stripe_proxy.entries("POST /v1/payment_intents") if e.request.params["amount"] == "1000"]) == 1
    )


def test_a_key_reused_for_a_new_change_after_the_first_one_is_not_taken_for_a_retry(book, acme, stripe_proxy):
    # The same key (its record pruned after the retention) for a change that changes something: made, not skipped.
    from hardcount.models import IdempotencyRecord

    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)
    key = {"Idempotency-Key": "seats"}
    for quantity in (5, 3):
        body = {"items": [{"id": _item(sub).id, "quantity": quantity}], "proration_behavior": "always_invoice"}
        assert api.post(f"/v1/subscriptions/{sub.id}", body, headers=key)[0] == 200
        IdempotencyRecord.objects.filter(key="seats").delete()

    assert _item(sub).quantity == 3
    invoices = Invoice.objects.filter(subscription=sub, billing_reason="subscription_update").order_by("created_at")
    assert sorted(i.total for i in invoices) == [-1000, 1000]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"effective_at": "period_end", "proration_date": "APR_10"}, "proration_date"),
        ({"effective_at": "period_end", "proration_behavior": "always_invoice"}, "proration_behavior"),
        ({"effective_at": "period_end", "billing_cycle_anchor": "now"}, "effective_at"),
    ],
)
def test_a_period_end_change_with_a_parameter_it_cannot_honour_is_a_422_naming_it(
    book, acme, stripe_proxy, body, param
):
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC), quantity=3)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    if body.get("proration_date") == "APR_10":
        body = {**body, "proration_date": int(datetime(2027, 4, 10, tzinfo=UTC).timestamp())}
    body = {**body, "items": [{"id": _item(sub).id, "quantity": 5}]}

    status, error = Api(acme.test).post(f"/v1/subscriptions/{sub.id}", body)

    assert status == 422, error
    assert error["error"]["param"] == param
    assert error["error"]["code"] == (
        "billing_cycle_anchor_conflict" if param == "effective_at" else "effective_at_conflict"
    )
    sub.refresh_from_db()
    assert (sub.scheduled_items, _item(sub).quantity) == (None, 3)
    assert not InvoiceItem.objects.exists()
    assert Invoice.objects.filter(subscription=sub).count() == 1
    # Negative control: the same change at period end alone (create_prorations being the default) is scheduled.
    status, scheduled = Api(acme.test).post(
        f"/v1/subscriptions/{sub.id}",
        {"items": body["items"], "effective_at": "period_end", "proration_behavior": "none"},
    )
    assert (status, scheduled["scheduled_change"]["items"][0]["quantity"]) == (200, 5)


def test_withdrawing_a_cancellation_at_period_end_renews_the_subscription(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    api = Api(acme.test)

    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"cancel_at_period_end": True})
    assert status == 200, body
    assert (body["cancel_at_period_end"], body["canceled_at"]) == (True, "2027-04-16T00:00:00Z")
    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"cancel_at_period_end": False})
    assert status == 200, body
    assert (body["status"], body["cancel_at_period_end"], body["canceled_at"]) == ("active", False, None)
    scheduled, withdrawn = [
        e for e in events("subscription.updated", data__id=sub.id) if "previous_attributes" in e.data
    ]
    assert scheduled.data["previous_attributes"] == {"cancel_at_period_end": False, "canceled_at": None}
    assert withdrawn.data["previous_attributes"] == {
        "cancel_at_period_end": True,
        "canceled_at": "2027-04-16T00:00:00Z",
    }

    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))

    sub.refresh_from_db()
    assert (sub.status, sub.ended_at) == ("active", None)
    may = Invoice.objects.get(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC))
    assert (may.total, may.status) == (1000, "paid")


def test_a_cancellation_at_period_end_left_in_place_ends_the_subscription_at_the_boundary(book, acme, stripe_proxy):
    # The negative control of the withdrawal: scheduled and kept, May is not billed and the subscription ends.
    clock, sub = _clocked(book, acme.tenant, anchor=datetime(2027, 4, 1, tzinfo=UTC))
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))
    assert Api(acme.test).post(f"/v1/subscriptions/{sub.id}", {"cancel_at_period_end": True})[0] == 200

    _bill_next_period(acme.tenant, clock, datetime(2027, 5, 1, tzinfo=UTC))

    sub.refresh_from_db()
    assert sub.status == "canceled"
    assert not Invoice.objects.filter(subscription=sub, period_start=datetime(2027, 5, 1, tzinfo=UTC)).exists()
