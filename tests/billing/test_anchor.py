"""``billing_cycle_anchor: "now"`` on ``POST /v1/subscriptions/{id}`` (docs/reference/billing-changes.md, 0147).

Against the real PostgreSQL and the strict dev Stripe: the unused time of the current period is credited to the
second (hand-computed, USD and JPY), a full period from the change instant is invoiced and charged once on an
invoice of its own, the anchor and next_billing_at move, and the book fixture's doctor finds the restarted cycle
clean. Most subscriptions are on a test clock ("now" is the clock's); one is on the wall clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from dateutil.relativedelta import relativedelta
from django.db import transaction

from billing.models import Invoice, InvoiceItem, PaymentAttempt, Subscription, SubscriptionItem, TestClock
from billing.services.close import close_subscription_period, materialise_period_invoice
from billing.services.drain import drain_due
from billing.services.pausing import update_pause_collection
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events

APR_1 = datetime(2027, 4, 1, tzinfo=UTC)
APR_11_10H = datetime(2027, 4, 11, 10, tzinfo=UTC)
CHARGES = "POST /v1/payment_intents"


@pytest.fixture
def acme(book):
    return make_keys("Acme")


def _clocked(book, tenant, *, anchor=APR_1, currency="usd", amount=1000, quantity=1):
    """A subscription on a clock at ``anchor``, its first period billed (paid)."""
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=anchor)
    customer = book.customer(tenant, clock=clock, currency=currency)
    price = book.price(tenant, amount=amount, currency=currency)
    price.nickname = "Basic"
    price.save()
    sub = book.subscription(customer, price, anchor=anchor, quantity=quantity)
    _drain(tenant, clock)
    assert Invoice.objects.get(subscription=sub).status == "paid"
    sub.refresh_from_db()
    return clock, sub


def _drain(tenant, clock):
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)


def _move(clock, at):
    TestClock.objects.filter(pk=clock.pk).update(frozen_time=at)


def _restart(api, sub, **body):
    return api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now", **body})


def _cycle_invoices(sub):
    return list(Invoice.objects.filter(subscription=sub, billing_reason="subscription_cycle").order_by("period_start"))


def test_a_restart_on_apr_11_credits_the_unused_time_and_bills_a_full_period_from_now_in_usd(book, acme, stripe_proxy):
    # Apr 1 → May 1 is 2,592,000 s; Apr 11 10:00 leaves 1,692,000 of them. The credit of the 1,000 item is
    # −1000 × 1692000 / 2592000 = −652.78 → −653; the new items (one Pro at 2,999) are billed whole for
    # Apr 11 10:00 → May 11 10:00: 2,999 − 653 = 2,346, charged at once.
    clock, sub = _clocked(book, acme.tenant)
    pro = book.price(acme.tenant, amount=2999)
    _move(clock, APR_11_10H)
    item = SubscriptionItem.objects.get(subscription=sub)

    status, body = _restart(Api(acme.test), sub, items=[{"id": item.id, "price": pro.id}])

    assert status == 200, body
    sub.refresh_from_db()
    assert (sub.billing_cycle_anchor, sub.next_billing_at, sub.periods_billed) == (
        APR_11_10H,
        datetime(2027, 5, 11, 10, tzinfo=UTC),
        1,
    )
    assert (sub.current_period_start, sub.current_period_end) == (APR_11_10H, datetime(2027, 5, 11, 10, tzinfo=UTC))
    assert body["billing_cycle_anchor"].startswith("2027-04-11T10:00:00")
    (credit,) = InvoiceItem.objects.filter(subscription=sub)
    assert (credit.amount, credit.proration, credit.period_start, credit.period_end) == (
        -653,
        True,
        APR_11_10H,
        datetime(2027, 5, 1, tzinfo=UTC),
    )
    assert (credit.proration_full_amount, credit.proration_remaining_s, credit.proration_period_s) == (
        -1000,
        1_692_000,
        2_592_000,
    )
    april, restarted = _cycle_invoices(sub)
    assert (april.period_start, april.period_end, april.status) == (APR_1, datetime(2027, 5, 1, tzinfo=UTC), "paid")
    assert (restarted.period_start, restarted.period_end) == (APR_11_10H, datetime(2027, 5, 11, 10, tzinfo=UTC))
    assert restarted.previous_billing_cycle_anchor == APR_1
    assert [(line.amount, line.proration) for line in restarted.lines.order_by("id")] == [(2999, False), (-653, True)]
    assert (restarted.total, restarted.amount_paid, restarted.status) == (2346, 2346, "paid")
    assert credit.invoice_id == restarted.id
    assert [e.request.params["amount"] for e in stripe_proxy.entries(CHARGES)] == ["1000", "2346"]
    (updated,) = [e for e in events("subscription.updated", data__id=sub.id) if "previous_attributes" in e.data]
    assert updated.data["previous_attributes"]["billing_cycle_anchor"].startswith("2027-04-01T00:00:00")
    assert updated.data["previous_attributes"]["items"]["data"][0]["price"]["amount"] == 1000

    # The next period is on the new cycle: May 11 10:00 → Jun 11 10:00, billed once, 2,999.
    _move(clock, datetime(2027, 5, 11, 10, tzinfo=UTC))
    _drain(acme.tenant, clock)
    *_, june = _cycle_invoices(sub)
    assert (june.period_start, june.period_end, june.total, june.status) == (
        datetime(2027, 5, 11, 10, tzinfo=UTC),
        datetime(2027, 6, 11, 10, tzinfo=UTC),
        2999,
        "paid",
    )
    assert len(_cycle_invoices(sub)) == 3


def test_a_restart_in_jpy_rounds_the_credit_once_half_away_from_zero(book, acme, stripe_proxy):
    # 3 × ¥980 = ¥2,940; Apr 11 10:00 leaves 1,692,000 / 2,592,000: −2940 × that = −1,919.17 → −1,919.
    # The new period bills ¥2,940 whole: 2,940 − 1,919 = ¥1,021.
    clock, sub = _clocked(book, acme.tenant, currency="jpy", amount=980, quantity=3)
    _move(clock, APR_11_10H)

    status, body = _restart(Api(acme.test), sub)

    assert status == 200, body
    (credit,) = InvoiceItem.objects.filter(subscription=sub)
    assert (credit.amount, credit.currency, credit.quantity) == (-1919, "jpy", 3)
    restarted = _cycle_invoices(sub)[-1]
    assert (restarted.currency, restarted.total, restarted.amount_paid, restarted.status) == ("jpy", 1021, 1021, "paid")


def test_proration_behavior_none_bills_the_new_period_whole_without_a_credit(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)

    status, _ = _restart(Api(acme.test), sub, proration_behavior="none")

    assert status == 200
    assert not InvoiceItem.objects.filter(subscription=sub).exists()
    restarted = _cycle_invoices(sub)[-1]
    assert (restarted.period_start, restarted.total, restarted.status) == (APR_11_10H, 1000, "paid")


def test_always_invoice_is_the_same_restart_the_credit_on_the_new_periods_invoice(book, acme, stripe_proxy):
    # Apr 16 00:00 leaves exactly half of April: −500; the new period 1,000 − 500 = 500.
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, datetime(2027, 4, 16, tzinfo=UTC))

    status, _ = _restart(Api(acme.test), sub, proration_behavior="always_invoice")

    assert status == 200
    assert not Invoice.objects.filter(subscription=sub, billing_reason="subscription_update").exists()
    restarted = _cycle_invoices(sub)[-1]
    assert [line.amount for line in restarted.lines.order_by("id")] == [1000, -500]
    assert (restarted.total, restarted.status) == (500, "paid")


def test_a_retried_restart_with_its_idempotency_key_answers_the_same_and_charges_once(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    api = Api(acme.test)

    first = api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"}, headers={"Idempotency-Key": "r1"})
    again = api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"}, headers={"Idempotency-Key": "r1"})
    # Without its key, a retry is a second restart at the same instant, which is the cycle's start now: refused.
    plain = api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"})

    assert first[0] == again[0] == 200, first
    assert first == again
    assert plain[0] == 422 and plain[1]["error"]["code"] == "billing_cycle_anchor_unavailable", plain
    (restarted,) = Invoice.objects.filter(subscription=sub, period_start=APR_11_10H)
    assert restarted.status == "paid"
    assert [e.request.params["amount"] for e in stripe_proxy.entries(CHARGES)] == ["1000", "347"]
    assert PaymentAttempt.objects.filter(invoice=restarted).count() == 1


def test_the_new_period_is_invoiced_once_whatever_closes_it_again(book, acme, stripe_proxy):
    # The restart's own close has billed period 0 of the new cycle; a drain and a stale close of that period
    # find nothing due, and the one-per-period index would refuse a second invoice anyway.
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    assert _restart(Api(acme.test), sub)[0] == 200

    _drain(acme.tenant, clock)
    outcome = close_subscription_period(sub.id, periods_billed=0, run=None, as_of=APR_11_10H, test_clock_id=clock.id)

    assert outcome.kind.value == "skipped"
    # The restart's invoice is a period invoice: the one-per-period index refuses a second one for its period.
    with transaction.atomic():
        locked = Subscription.objects.select_related("price").select_for_update().get(pk=sub.id)
        end = datetime(2027, 5, 11, 10, tzinfo=UTC)
        assert materialise_period_invoice(locked, APR_11_10H, end, APR_11_10H) is None
    assert Invoice.objects.filter(subscription=sub, period_start=APR_11_10H).count() == 1
    assert len(stripe_proxy.entries(CHARGES)) == 2


def test_a_restart_on_the_wall_clock_credits_to_the_second_from_the_database_now(book, acme, stripe_proxy):
    customer = book.customer(acme.tenant)
    price = book.price(acme.tenant, amount=1000)
    sub = book.subscription(customer, price, anchor=datetime.now(UTC) - timedelta(days=10, hours=3))
    drain_due(livemode=False, trigger="manual", tenant_id=acme.tenant.id)
    (first,) = _cycle_invoices(sub)
    assert first.status == "paid"

    status, body = _restart(Api(acme.test), sub)

    assert status == 200, body
    restarted = _cycle_invoices(sub)[-1]
    at = restarted.period_start
    assert at.microsecond == 0 and first.period_start < at < first.period_end
    assert abs((datetime.now(UTC) - at).total_seconds()) < 60
    remaining_s = int((first.period_end - at).total_seconds())
    share = Fraction(remaining_s, int((first.period_end - first.period_start).total_seconds()))
    exact = -1000 * share
    expected = -int(-exact + Fraction(1, 2))  # half away from zero, for a negative amount
    (credit,) = InvoiceItem.objects.filter(subscription=sub)
    assert credit.amount == expected
    assert (restarted.total, restarted.status) == (1000 + expected, "paid")
    sub.refresh_from_db()
    assert sub.billing_cycle_anchor == at
    assert sub.next_billing_at == at + relativedelta(months=1)


@pytest.mark.parametrize(
    "extra,code,param",
    [
        ({"effective_at": "period_end"}, "billing_cycle_anchor_conflict", "effective_at"),
        ({"proration_date": 1807000000}, "billing_cycle_anchor_conflict", "proration_date"),
        ({"pause_collection": {"behavior": "void"}}, "billing_cycle_anchor_conflict", "billing_cycle_anchor"),
        ({"coupon": "co_01m8s7dwa7e2mxeet01kee635q"}, "billing_cycle_anchor_conflict", "billing_cycle_anchor"),
        ({"billing_cycle_anchor": "tomorrow"}, "parameter_invalid", "billing_cycle_anchor"),
    ],
)
def test_a_restart_with_a_contradicting_parameter_is_a_422_and_changes_nothing(
    book, acme, stripe_proxy, extra, code, param
):
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)

    status, body = _restart(Api(acme.test), sub, **extra)

    assert status == 422, body
    assert (body["error"]["code"], body["error"]["param"]) == (code, param)
    _assert_unchanged(sub)


def _assert_unchanged(sub):
    fresh = Subscription.objects.get(pk=sub.id)
    assert (fresh.billing_cycle_anchor, fresh.next_billing_at, fresh.periods_billed) == (
        sub.billing_cycle_anchor,
        sub.next_billing_at,
        sub.periods_billed,
    )
    assert not InvoiceItem.objects.filter(subscription=sub).exists()
    assert Invoice.objects.filter(subscription=sub).count() == 1


def test_a_restart_while_collection_is_paused_is_a_422_and_changes_nothing(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    update_pause_collection(
        tenant_id=sub.tenant_id, livemode=False, subscription_id=sub.id, pause_collection={"behavior": "void"}
    )
    sub.refresh_from_db()

    status, body = _restart(Api(acme.test), sub)

    assert status == 422
    assert body["error"]["code"] == "billing_cycle_anchor_unavailable"
    _assert_unchanged(sub)


def test_a_restart_set_to_cancel_at_period_end_or_trialing_is_a_422(book, acme, stripe_proxy):
    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    Subscription.objects.filter(pk=sub.id).update(cancel_at_period_end=True)
    status, body = _restart(Api(acme.test), sub)
    assert (status, body["error"]["code"]) == (422, "billing_cycle_anchor_conflict")
    Subscription.objects.filter(pk=sub.id).update(cancel_at_period_end=False)

    trial_clock = TestClock.objects.create(tenant=acme.tenant, livemode=False, frozen_time=APR_1)
    customer = book.customer(acme.tenant, clock=trial_clock)
    trialing = book.subscription(
        customer, book.price(acme.tenant), anchor=APR_1 + timedelta(days=14), status="trialing"
    )
    status, body = _restart(Api(acme.test), trialing)
    assert (status, body["error"]["code"]) == (422, "billing_cycle_anchor_unavailable")
    assert not Invoice.objects.filter(subscription=trialing).exists()


class Killed(BaseException):
    """The request's process dying (not an Exception: nothing catches it)."""


def test_a_restart_killed_after_its_commit_is_charged_once_by_the_next_drain(book, acme, stripe_proxy, monkeypatch):
    # Killed between the change's commit and its close: the new period is due at the change instant, its draft
    # invoice (with the −653 credit) already written; the drain's close finalises and charges it, once.
    from billing.services import changes

    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(changes, "close_subscription_period", killed)
    with pytest.raises(Killed):
        changes.restart_cycle(tenant_id=sub.tenant_id, livemode=False, subscription_id=sub.id)
    monkeypatch.undo()
    restarted = _cycle_invoices(sub)[-1]
    assert (restarted.period_start, restarted.status, restarted.total) == (APR_11_10H, "draft", 347)
    sub.refresh_from_db()
    assert (sub.next_billing_at, sub.periods_billed) == (APR_11_10H, 0)

    _drain(acme.tenant, clock)
    _drain(acme.tenant, clock)

    restarted.refresh_from_db()
    assert (restarted.status, restarted.amount_paid) == ("paid", 347)
    assert [e.request.params["amount"] for e in stripe_proxy.entries(CHARGES)] == ["1000", "347"]
    sub.refresh_from_db()
    assert (sub.next_billing_at, sub.periods_billed) == (datetime(2027, 5, 11, 10, tzinfo=UTC), 1)


def test_a_restart_invoice_voided_before_its_charge_is_reissued_on_the_new_cycle(book, acme, stripe_proxy, monkeypatch):
    # Voided while still a draft (its close never ran), the restart's invoice leaves the one-per-period index and
    # the next drain re-issues the period, as for any period (decision 0013). The credit stays with the voided
    # invoice, as any item swept onto an invoice does, so the re-issue bills 1,000. The book fixture's doctor
    # accepts the re-issue's overlap with April: the voided invoice recorded the restart.
    from billing.services import changes

    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(changes, "close_subscription_period", killed)
    with pytest.raises(Killed):
        changes.restart_cycle(tenant_id=sub.tenant_id, livemode=False, subscription_id=sub.id)
    monkeypatch.undo()
    (draft,) = Invoice.objects.filter(subscription=sub, period_start=APR_11_10H)
    assert Api(acme.test).post(f"/v1/invoices/{draft.id}/void", {})[0] == 200

    _drain(acme.tenant, clock)

    reissued = Invoice.objects.exclude(status="void").get(subscription=sub, period_start=APR_11_10H)
    assert reissued.previous_billing_cycle_anchor is None
    assert (reissued.total, reissued.status) == (1000, "paid")
    sub.refresh_from_db()
    assert (sub.next_billing_at, sub.periods_billed) == (datetime(2027, 5, 11, 10, tzinfo=UTC), 1)


def test_a_restart_whose_close_meets_the_subscription_held_elsewhere_waits_and_answers_it_charged(
    book, acme, stripe_proxy, monkeypatch
):
    # A concurrent request for the same subscription holds its row just as the restart's close runs (which
    # skips a locked subscription): the restart waits for it, so its answer reports the new period charged.
    import threading

    from django.db import connection

    from billing.services import changes

    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    held, release, real_close = threading.Event(), threading.Event(), changes.close_subscription_period

    def hold_the_row():
        try:
            with transaction.atomic():
                Subscription.objects.select_for_update().get(pk=sub.id)
                held.set()
                release.wait(10)
        finally:
            connection.close()

    def close_while_held(*args, **kwargs):
        if not held.is_set():
            threading.Thread(target=hold_the_row, daemon=True).start()
            assert held.wait(10)
            threading.Timer(0.3, release.set).start()
        return real_close(*args, **kwargs)

    monkeypatch.setattr(changes, "close_subscription_period", close_while_held)

    status, body = _restart(Api(acme.test), sub)

    assert status == 200, body
    restarted = _cycle_invoices(sub)[-1]
    assert (restarted.period_start, restarted.status) == (APR_11_10H, "paid")
    assert body["current_period_start"] == "2027-04-11T10:00:00Z"


@pytest.mark.parametrize("drained_first", [False, True], ids=["retried-before-the-drain", "retried-after-the-drain"])
def test_a_keyed_restart_retried_after_its_request_died_restarts_nothing_again(
    book, acme, stripe_proxy, monkeypatch, drained_first
):
    # The request dies after the restart committed (the new period's 1,000 − 653 = 347 invoice a draft, due). Its
    # retry under the same key, once the dead claim is stale, closes that period if still due and restarts nothing:
    # no second credit, no second period, one charge of 347.
    from datetime import timedelta

    from django.db.models import F

    from billing.services import changes
    from hardcount.idempotency import IN_FLIGHT_STALE
    from hardcount.models import IdempotencyRecord

    clock, sub = _clocked(book, acme.tenant)
    _move(clock, APR_11_10H)
    api = Api(acme.test)
    key = {"Idempotency-Key": "restart-killed"}

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(changes, "close_subscription_period", killed)
    with pytest.raises(Killed):
        api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"}, headers=key)
    monkeypatch.undo()
    restarted = _cycle_invoices(sub)[-1]
    assert (restarted.period_start, restarted.status, restarted.total) == (APR_11_10H, "draft", 347)
    if drained_first:
        _drain(acme.tenant, clock)
        assert Invoice.objects.get(pk=restarted.pk).status == "paid"
    _move(clock, APR_11_10H + timedelta(days=1))  # a retry a day later: a second restart would credit and bill again
    # The dead claim is stale (older than the threshold, on the database's clock): the retry may take it over.
    IdempotencyRecord.objects.filter(key="restart-killed").update(
        created_at=F("created_at") - IN_FLIGHT_STALE - timedelta(seconds=1)
    )

    status, body = api.post(f"/v1/subscriptions/{sub.id}", {"billing_cycle_anchor": "now"}, headers=key)

    assert status == 200, body
    assert body["billing_cycle_anchor"].startswith("2027-04-11T10:00:00")
    assert [(i.period_start, i.status) for i in _cycle_invoices(sub)] == [(APR_1, "paid"), (APR_11_10H, "paid")]
    assert [e.request.params["amount"] for e in stripe_proxy.entries(CHARGES)] == ["1000", "347"]
    assert InvoiceItem.objects.filter(subscription=sub).count() == 1
    sub.refresh_from_db()
    assert (sub.billing_cycle_anchor, sub.next_billing_at, sub.periods_billed) == (
        APR_11_10H,
        datetime(2027, 5, 11, 10, tzinfo=UTC),
        1,
    )
