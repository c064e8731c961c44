"""How the console writes money, times and rows: one helper everywhere, Babel's currency data, rows named in words."""

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from billing.admin import explain_error
from billing.models import BillingRun, Invoice, Price, Subscription, TestClock
from hardcount.admin import clock_time, money, price_label, short_time
from hardcount.money import CURRENCY_EXPONENTS
from outbox.admin import pending_reason
from outbox.models import Delivery, WebhookEndpoint
from tests.admin import rows
from tests.outbox.conftest import emit, make_endpoint

# An amount written as the database holds it ("1000 usd", "1000 USD"): what no page may show.
RAW_AMOUNT = re.compile(r"\b\d+ (?:usd|eur|jpy|gbp)\b", re.IGNORECASE)


def test_money_is_written_by_currency_from_minor_units():
    assert money(1500, "usd") == "$15.00"
    assert money(1299, "eur") == "€12.99"
    assert money(1000, "jpy") == "¥1,000"
    assert money(1500, "kwd") == "KWD1.500"
    assert money(-250, "usd") == "-$2.50"
    assert money(None, "usd") == "—"
    assert money(1500, "xyz") == "1500 (minor units, XYZ)"
    assert price_label(1299, "eur", "week") == "€12.99 / week"
    assert price_label(9000, "usd", "month", 3) == "$90.00 / 3 months"


def test_babels_exponents_are_the_ones_amounts_are_stored_in():
    from babel.numbers import get_currency_precision

    assert {code: get_currency_precision(code.upper()) for code in CURRENCY_EXPONENTS} == CURRENCY_EXPONENTS


@override_settings(HARDCOUNT_CONSOLE_LOCALE="de_DE")
def test_the_locale_is_a_setting():
    assert money(123456, "eur") == "1.234,56\xa0€"


def test_times_are_utc_and_labeled():
    at = datetime(2026, 12, 1, 14, 3, 59, tzinfo=UTC)
    assert short_time(at) == "2026-12-01 14:03 UTC"
    assert short_time(None) == "—"
    assert clock_time(at, on_clock=True) == "2026-12-01 14:03 UTC (test clock)"
    assert clock_time(at, on_clock=False) == "2026-12-01 14:03 UTC"


def test_gateway_errors_are_explained_in_words():
    unknown_pm = "error: InvalidRequestError (404): No such PaymentMethod: 'pm_1Abc'"
    assert explain_error(unknown_pm) == "the gateway does not know payment method pm_1Abc"
    assert explain_error("error: APIError (503): busy").startswith("the gateway was failing (HTTP 503)")
    assert explain_error("unknown: timed out").startswith("the gateway gave no answer")
    assert explain_error("declined: insufficient_funds") == "the card was declined (insufficient_funds)"
    assert explain_error("something new") == "something new"
    assert explain_error("") == ""


@pytest.mark.django_db
def test_pages_show_money_formatted_and_name_their_rows(tenant, operator):
    sub = rows.subscription(
        tenant, last_billing_error="error: InvalidRequestError (404): No such PaymentMethod: 'pm_9'"
    )
    Subscription.objects.filter(pk=sub.pk).update(billing_failure_count=8, billing_parked_at=timezone.now())
    invoice = rows.invoice(sub)
    Invoice.objects.filter(pk=invoice.pk).update(number="INV-0042")
    price = Price.objects.get(pk=sub.price_id)

    pages = {
        "billing_subscription": sub.pk,
        "billing_invoice": invoice.pk,
        "billing_price": price.pk,
        "billing_customer": sub.customer_id,
    }
    for name, pk in pages.items():
        for url in (reverse(f"admin:{name}_changelist"), reverse(f"admin:{name}_change", args=[pk])):
            response = operator.get(url)
            assert response.status_code == 200, url
            text = response.content.decode()
            assert not RAW_AMOUNT.search(text), (url, RAW_AMOUNT.search(text))
            if name != "billing_customer":
                assert "$10.00" in text, url

    sub_page = operator.get(reverse("admin:billing_subscription_change", args=[sub.pk])).content.decode()
    assert f"Subscription {sub.pk} · {sub.customer.email} · $10.00 / month · active" in sub_page
    assert "the gateway does not know payment method pm_9" in sub_page
    assert "parked since" in sub_page
    invoice_page = operator.get(reverse("admin:billing_invoice_change", args=[invoice.pk])).content.decode()
    assert "Invoice INV-0042 · $10.00 · open" in invoice_page
    assert " UTC" in invoice_page and "a.m." not in invoice_page and "p.m." not in invoice_page


@pytest.mark.django_db
def test_an_open_invoice_of_an_unbilled_period_is_explained_beside_periods_billed(tenant, operator):
    sub = rows.waiting(tenant)
    Subscription.objects.filter(pk=sub.pk).update(next_billing_at=sub.billing_cycle_anchor)
    sub.refresh_from_db()
    rows.invoice(sub)

    text = operator.get(reverse("admin:billing_subscription_change", args=[sub.pk])).content.decode()

    assert "whose charge failed at the gateway or got no answer yet" in text


@pytest.mark.django_db
def test_a_subscription_on_a_test_clock_shows_the_clocks_time_labeled(tenant, operator):
    frozen = datetime(2027, 3, 1, 9, 30, tzinfo=UTC)
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=frozen, name="renewals")
    sub = rows.subscription(tenant, test_clock=clock, next_billing_at=frozen + timedelta(days=3))

    text = operator.get(reverse("admin:billing_subscription_change", args=[sub.pk])).content.decode()
    listed = operator.get(reverse("admin:billing_subscription_changelist")).content.decode()

    assert "time is 2027-03-01 09:30 UTC" in text
    assert "2027-03-04 09:30 UTC (test clock)" in listed


@pytest.mark.django_db
def test_empty_billing_runs_are_folded_unless_asked_for(tenant, operator):
    now = timezone.now()
    common = {"trigger": "scheduler", "livemode": False, "as_of": now, "started_at": now, "finished_at": now}
    empty = BillingRun.objects.create(status="completed", **common)
    busy = BillingRun.objects.create(status="completed", attempted=3, billed=2, failed=1, **common)
    url = reverse("admin:billing_billingrun_changelist")

    shown = {r.pk for r in operator.get(url).context["cl"].result_list}
    everything = {r.pk for r in operator.get(url, {"runs": "all"}).context["cl"].result_list}
    only_empty = {r.pk for r in operator.get(url, {"runs": "empty"}).context["cl"].result_list}

    assert shown == {busy.pk}
    assert everything == {busy.pk, empty.pk}
    assert only_empty == {empty.pk}


@pytest.mark.django_db
def test_a_pending_delivery_says_why_it_waits(tenant):
    now = timezone.now()
    endpoint = make_endpoint(tenant, "https://example.com/hook")
    emit(tenant)
    delivery = Delivery.objects.get()
    Delivery.objects.filter(pk=delivery.pk).update(fire_after=now + timedelta(minutes=10), attempts=2)
    delivery.refresh_from_db()
    assert pending_reason(delivery).startswith(f"next attempt at {short_time(delivery.fire_after)} after 2 attempts")

    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(circuit_open_until=now + timedelta(minutes=3))
    delivery.refresh_from_db()
    assert pending_reason(delivery).startswith("the endpoint's circuit is open until")

    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(enabled=False, disabled_reason="410 Gone")
    delivery = Delivery.objects.select_related("endpoint").get(pk=delivery.pk)
    assert pending_reason(delivery).startswith("its endpoint is disabled (410 Gone)")


@pytest.mark.django_db
def test_the_view_site_link_is_gone(operator):
    assert b"View site" not in operator.get("/admin/").content
