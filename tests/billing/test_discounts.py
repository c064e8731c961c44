"""Coupons and discounts (docs/reference/discounts.md): which invoices a discount covers, the amounts on each line,
their place before tax and credit, in the per-close path and the page close alike, and redemptions under races.

Every expected amount is computed by hand in the comment beside it.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from dateutil.relativedelta import relativedelta
from django.db import IntegrityError, connection, transaction

from billing.models import Coupon, Customer, Discount, Invoice, PaymentAttempt
from billing.services import discounts
from billing.services.changes import change_subscription, preview_upcoming
from billing.services.drain import drain_due
from billing.services.ledger import grant_credit
from hardcount.errors import InvalidRequestError
from hardcount.times import database_now
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import events
from tests.clocks.helpers import advance, make_clock, subscribe


def _utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def _coupon(tenant, **terms) -> Coupon:
    terms.setdefault("duration", "forever")
    return discounts.create_coupon(tenant_id=tenant.id, livemode=False, **terms)


def _on_subscription(sub, coupon):
    return discounts.set_subscription_discount(
        tenant_id=sub.tenant_id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )


def _on_customer(customer_id, coupon):
    return discounts.set_customer_discount(
        tenant_id=coupon.tenant_id, livemode=False, customer_id=customer_id, coupon_id=coupon.id
    )


def _drain(tenant):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)


def _invoice(sub) -> Invoice:
    return Invoice.objects.prefetch_related("lines").get(subscription=sub)


page_close = pytest.mark.parametrize("page", [True, False], ids=["page-close", "per-close"])


# ---------------------------------------------------------------------------------------
# The amounts (pure arithmetic)


def _terms(**terms) -> Coupon:
    return Coupon(duration="forever", **terms)


def test_percent_off_rounds_half_up_once_per_line_and_shrinks_a_credit_line_alike():
    # 25 % of 1999 = 499.75 → 500; of 333 = 83.25 → 83; of -1002 = -250.5 → -251 (half away from zero).
    assert discounts.line_discounts([1999, 333, -1002], _terms(percent_off=Decimal("25")), "usd") == [500, 83, -251]
    # 33.33 % of 1000 = 333.3 → 333; 100 % takes the whole line.
    assert discounts.line_discounts([1000], _terms(percent_off=Decimal("33.33")), "jpy") == [333]
    assert discounts.line_discounts([1999, 1], _terms(percent_off=Decimal("100")), "usd") == [1999, 1]


def test_amount_off_is_spread_over_the_positive_lines_by_largest_remainder_and_never_below_zero():
    # 1000 over 1999 and 333 (sum 2332): 857.20… and 142.79…: floors 857 + 142 = 999, the last unit to the
    # larger remainder (the second line): 857 and 143.
    assert discounts.line_discounts([1999, 333], _terms(amount_off=1000, currency="usd"), "usd") == [857, 143]
    # Equal remainders: the earlier line gets the unit. 1 over 1 and 1: 0.5 each → 1, 0.
    assert discounts.line_discounts([1, 1], _terms(amount_off=1, currency="usd"), "usd") == [1, 0]
    # More than the invoice: at most the sum of the lines (with a credit line: 1000 - 300 = 700, all on the charge).
    assert discounts.line_discounts([1000, -300], _terms(amount_off=5000, currency="usd"), "usd") == [700, 0]
    # Another currency takes nothing off.
    assert discounts.line_discounts([1000], _terms(amount_off=100, currency="eur"), "usd") == [0]


# ---------------------------------------------------------------------------------------
# Repeating coupons on a test clock


def test_a_25_percent_coupon_repeating_3_months_discounts_exactly_3_invoices_across_5_advances_and_a_plan_change(
    book, tenant
):
    t0 = _utc(2027, 1, 31, 9, 30)  # month ends: Feb 28, Mar 31, Apr 30 …
    clock = make_clock(tenant, t0)
    coupon = _coupon(tenant, percent_off=Decimal("25"), duration="repeating", duration_in_months=3)
    sub = subscribe(book, clock, amount=1999, coupon_id=coupon.id)
    pricier = book.price(tenant, amount=2999)

    months = [t0 + relativedelta(months=n) for n in range(6)]
    advance(clock, months[1])
    item = sub.items.get()
    change_subscription(
        tenant_id=tenant.id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": item.id, "price": pricier.id}],
        proration_behavior="none",
    )
    for month in months[2:]:
        clock = advance(clock, month)

    invoices = list(Invoice.objects.filter(subscription=sub).order_by("period_start"))
    assert [i.period_start for i in invoices] == months
    # 25 % of 1999 = 499.75 → 500 (twice); then the new price: 25 % of 2999 = 749.75 → 750; then none.
    assert [i.total_discount for i in invoices] == [500, 500, 750, 0, 0, 0]
    assert [i.total for i in invoices] == [1499, 1499, 2249, 2999, 2999, 2999]
    assert [i.amount_paid for i in invoices] == [1499, 1499, 2249, 2999, 2999, 2999]
    discount = Discount.objects.get(subscription=sub)
    assert (discount.start, discount.end) == (t0, _utc(2027, 4, 30, 9, 30))
    assert [i.discount_id for i in invoices] == [discount.id] * 3 + [None] * 3
    assert [[line.discount_amount for line in i.lines.all()] for i in invoices] == [[500], [500], [750], [0], [0], [0]]
    coupon.refresh_from_db()
    assert coupon.times_redeemed == 1


def test_a_repeating_coupon_on_a_yearly_price_covers_the_invoices_that_start_within_its_months(book, tenant):
    t0 = _utc(2027, 3, 1)
    clock = make_clock(tenant, t0)
    coupon = _coupon(tenant, percent_off=Decimal("10"), duration="repeating", duration_in_months=13)
    sub = subscribe(book, clock, interval="year", amount=12000, coupon_id=coupon.id)

    for year in (2028, 2029):
        clock = advance(clock, _utc(year, 3, 1))

    # 13 months from 2027-03-01 end 2028-04-01: the 2027 and 2028 invoices start within them, 2029's does not.
    invoices = list(Invoice.objects.filter(subscription=sub).order_by("period_start"))
    assert [i.total_discount for i in invoices] == [1200, 1200, 0]


# ---------------------------------------------------------------------------------------
# Invoices of a drain, both close paths


@page_close
def test_an_amount_off_larger_than_the_invoice_makes_it_zero_and_nothing_is_charged(book, tenant, settings, page):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page
    sub = book.subscribed(tenant, amount=1000)
    coupon = _coupon(tenant, amount_off=5000, currency="usd")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )

    _drain(tenant)

    invoice = _invoice(sub)
    assert (invoice.subtotal, invoice.total_discount, invoice.total, invoice.amount_due) == (1000, 1000, 0, 0)
    assert [line.discount_amount for line in invoice.lines.all()] == [1000]
    assert invoice.status == Invoice.PAID
    assert invoice.payment_intent_id == ""  # the gateway was never asked
    assert not PaymentAttempt.objects.filter(invoice=invoice, settled_without_charge=False).exists()
    customer = Customer.objects.get(pk=sub.customer_id)
    assert customer.gateway_customer_id == ""


@page_close
def test_tax_is_on_the_discounted_amount_and_credit_comes_after_both(book, tenant, settings, page):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page
    settings.HARDCOUNT_TAX_RATES_BPS = {"usd": 2000}
    sub = book.subscribed(tenant, amount=1000)
    grant_credit(sub.customer_id, tenant_id=tenant.id, livemode=False, amount=300)
    coupon = _coupon(tenant, percent_off=Decimal("25"))
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )

    _drain(tenant)

    # 1000 - 25 % = 750; tax 20 % of 750 = 150 (not 200); total 900; credit 300 → 600 charged.
    invoice = _invoice(sub)
    assert (invoice.subtotal, invoice.total_discount, invoice.tax, invoice.total) == (1000, 250, 150, 900)
    assert (invoice.credit_applied, invoice.amount_due, invoice.amount_paid) == (300, 600, 600)


@page_close
def test_jpy_amounts_are_whole_yen_and_taxed_after_the_discount(book, tenant, settings, page):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page
    settings.HARDCOUNT_TAX_RATES_BPS = {"jpy": 1000}
    sub = book.subscribed(tenant, amount=1980, currency="jpy")
    coupon = _coupon(tenant, percent_off=Decimal("15"))
    discounts.set_customer_discount(
        tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, coupon_id=coupon.id
    )

    _drain(tenant)

    # 15 % of ¥1,980 = ¥297; ¥1,683 taxed 10 % = ¥168.3 → ¥168; total ¥1,851.
    invoice = _invoice(sub)
    assert (invoice.currency, invoice.total_discount, invoice.tax, invoice.total) == ("jpy", 297, 168, 1851)
    assert invoice.amount_paid == 1851


@page_close
def test_the_subscription_discount_beats_the_customer_discount(book, tenant, settings, page):
    settings.HARDCOUNT_BILLING_PAGE_CLOSE = page
    sub = book.subscribed(tenant, amount=1000)
    other = book.subscription(Customer.objects.get(pk=sub.customer_id), book.price(tenant, amount=2000))
    ten = _coupon(tenant, percent_off=Decimal("10"))
    half = _coupon(tenant, percent_off=Decimal("50"))
    _on_customer(sub.customer_id, ten)
    _on_subscription(sub, half)

    _drain(tenant)

    assert _invoice(sub).total == 500  # its own 50 %
    assert _invoice(other).total == 1800  # the customer's 10 %


def test_a_once_coupon_discounts_one_invoice_only(book, tenant):
    sub = book.subscribed(tenant, amount=1000, anchor=database_now() - relativedelta(months=1, hours=1))
    coupon = _coupon(tenant, amount_off=300, currency="usd", duration="once")
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )

    _drain(tenant)  # two periods due: the first takes the coupon
    _drain(tenant)

    totals = list(Invoice.objects.filter(subscription=sub).order_by("period_start").values_list("total", flat=True))
    assert totals == [700, 1000]  # 1000 - 300 on the first; the second pays in full
    assert Discount.objects.get(subscription=sub).invoice_id is not None


def test_a_deleted_discount_covers_no_invoice_starting_after(book, tenant):
    sub = book.subscribed(tenant, amount=1000)
    coupon = _coupon(tenant, percent_off=Decimal("50"))
    discounts.set_subscription_discount(
        tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=coupon.id
    )
    deleted = discounts.delete_subscription_discount(tenant_id=tenant.id, livemode=False, subscription_id=sub.id)

    _drain(tenant)

    assert deleted.deleted_at is not None
    assert _invoice(sub).total == 1000
    assert [e.data["id"] for e in events("customer.discount.deleted")] == [deleted.id]


# ---------------------------------------------------------------------------------------
# Redemptions


def test_two_concurrent_redemptions_of_a_single_use_coupon_one_wins_the_other_is_refused(book, stripe_proxy):
    keys = make_keys("Racing")
    api = Api(keys.test)
    tenant = keys.tenant
    first, second = book.customer(tenant), book.customer(tenant)
    coupon = _coupon(tenant, percent_off=Decimal("20"), max_redemptions=1)
    holding, release, answers = threading.Event(), threading.Event(), {}

    def redeem_and_hold():
        # The first redemption, its transaction held open: the second must wait on the coupon's row.
        try:
            with transaction.atomic():
                customer = Customer.objects.select_for_update().get(pk=first.id)
                discounts.apply_to_customer_locked(customer, coupon.id, at=database_now())
                holding.set()
                release.wait(30)
            answers["first"] = "ok"
        finally:
            connection.close()

    def redeem_through_the_api():
        try:
            answers["second"] = api.post(f"/v1/customers/{second.id}", {"coupon": coupon.id})
        finally:
            connection.close()

    one = threading.Thread(target=redeem_and_hold)
    one.start()
    assert holding.wait(30)
    two = threading.Thread(target=redeem_through_the_api)
    two.start()
    _wait_until_a_session_waits_on_a_lock()
    release.set()
    one.join(30)
    two.join(30)

    status, body = answers["second"]
    assert answers["first"] == "ok"
    assert (status, body["error"]["code"]) == (422, "coupon_exhausted")
    coupon.refresh_from_db()
    assert coupon.times_redeemed == 1 and not coupon.valid_at(database_now())
    assert list(Discount.objects.filter(coupon=coupon).values_list("customer_id", flat=True)) == [first.id]
    assert Customer.objects.get(pk=second.id).discount_id is None


def _wait_until_a_session_waits_on_a_lock(timeout_s: float = 30.0) -> None:
    deadline = datetime.now(UTC) + timedelta(seconds=timeout_s)
    while datetime.now(UTC) < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            if cursor.fetchone()[0]:
                return
        threading.Event().wait(0.05)
    raise AssertionError("the second redemption never waited on the coupon's row")


def test_the_redemption_count_cannot_pass_max_redemptions_even_written_by_hand(book, tenant, no_doctor):
    # The negative control of the conditional increment: the CHECK refuses what a racing read-then-write would write
    # (the count written by hand has no discount behind it: the doctor would rightly report it).
    coupon = _coupon(tenant, percent_off=Decimal("20"), max_redemptions=1)
    Coupon.objects.filter(pk=coupon.pk).update(times_redeemed=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        Coupon.objects.filter(pk=coupon.pk).update(times_redeemed=2)


def test_a_coupon_past_redeem_by_is_refused_and_no_longer_valid(book, tenant):
    customer = book.customer(tenant)
    coupon = _coupon(tenant, percent_off=Decimal("20"), redeem_by=database_now() + timedelta(days=1))
    Coupon.objects.filter(pk=coupon.pk).update(redeem_by=database_now() - timedelta(seconds=1))

    with pytest.raises(InvalidRequestError) as refused:
        discounts.set_customer_discount(
            tenant_id=tenant.id, livemode=False, customer_id=customer.id, coupon_id=coupon.id
        )

    assert refused.value.code == "coupon_expired"
    coupon.refresh_from_db()
    assert coupon.times_redeemed == 0 and not coupon.valid_at(database_now())
    assert not Discount.objects.exists()


def test_a_change_invoiced_at_once_takes_the_subscriptions_discount_on_its_credit_and_its_charge(book, tenant):
    t0 = _utc(2027, 4, 1)  # April: 30 days
    clock = make_clock(tenant, t0)
    coupon = _coupon(tenant, percent_off=Decimal("25"))
    sub = subscribe(book, clock, amount=1000, coupon_id=coupon.id)
    pricier = book.price(tenant, amount=2000)
    advance(clock, _utc(2027, 4, 16))  # half of April left

    _, invoice = change_subscription(
        tenant_id=tenant.id,
        livemode=False,
        subscription_id=sub.id,
        items=[{"id": sub.items.get().id, "price": pricier.id}],
        proration_behavior="always_invoice",
    )

    # Unused half of 1000: -500, 25 % off → -125 (the credit is the 375 paid for it); half of 2000: 1000, 25 % off
    # → 250. Total -375 + 750 = 375 (with the credit left whole it would be 250).
    lines = sorted(invoice.lines.all(), key=lambda line: line.amount)
    assert [(line.amount, line.discount_amount) for line in lines] == [(-500, -125), (1000, 250)]
    assert (invoice.subtotal, invoice.total_discount, invoice.total, invoice.amount_paid) == (500, 125, 375, 375)
    cycle = Invoice.objects.get(subscription=sub, billing_reason=Invoice.CYCLE)
    assert cycle.total == 750


def test_the_upcoming_invoice_shows_the_discount_and_writes_nothing(book, tenant):
    sub = book.subscribed(tenant, amount=1999)
    _on_subscription(sub, _coupon(tenant, amount_off=1000, currency="usd"))

    invoice, lines = preview_upcoming(tenant_id=tenant.id, livemode=False, subscription_id=sub.id)

    assert (invoice.subtotal, invoice.total_discount, invoice.total) == (1999, 1000, 999)
    assert [line.discount_amount for line in lines] == [1000]
    assert not Invoice.objects.exists()
    assert Discount.objects.get().invoice_id is None


# ---------------------------------------------------------------------------------------
# amount_off coupons and the customer's currency (docs/decisions/0210)


def _create_subscription(price, customer_id):
    from billing.services.catalog import create_subscription

    return create_subscription(tenant_id=price.tenant_id, livemode=False, customer_id=customer_id, price_id=price.id)


def test_a_customer_discount_in_another_currency_refuses_the_subscription_it_would_never_discount(book, tenant):
    customer = book.customer(tenant)
    Customer.objects.filter(pk=customer.pk).update(currency="")  # no subscription yet: no currency to compare with
    euros = _coupon(tenant, amount_off=500, currency="eur")
    _on_customer(customer.id, euros)  # accepted: nothing says yet which currency the customer will be billed in

    with pytest.raises(InvalidRequestError) as refused:
        _create_subscription(book.price(tenant, amount=1000, currency="usd"), customer.id)

    assert (refused.value.code, refused.value.param) == ("coupon_currency_mismatch", "price")
    assert Customer.objects.get(pk=customer.pk).currency == ""
    assert not Invoice.objects.exists() and not customer.subscriptions.exists()
    # In the coupon's currency it is taken and discounts: 1000 - 500 = 500 charged.
    sub = _create_subscription(book.price(tenant, amount=1000, currency="eur"), customer.id)
    _drain(tenant)
    invoice = _invoice(sub)
    assert (invoice.currency, invoice.total_discount, invoice.total, invoice.amount_paid) == ("eur", 500, 500, 500)


def test_negative_control_without_the_refusal_the_other_currencys_invoice_silently_takes_nothing_off(
    book, tenant, monkeypatch
):
    customer = book.customer(tenant)
    Customer.objects.filter(pk=customer.pk).update(currency="")
    _on_customer(customer.id, _coupon(tenant, amount_off=500, currency="eur"))
    monkeypatch.setattr(discounts, "refuse_other_currency", lambda *args, **kwargs: None)

    sub = _create_subscription(book.price(tenant, amount=1000, currency="usd"), customer.id)
    _drain(tenant)

    invoice = _invoice(sub)
    assert (invoice.total_discount, invoice.total, invoice.amount_paid) == (0, 1000, 1000)
    assert Customer.objects.get(pk=customer.pk).discount_id is not None  # the discount is there, and took nothing
