"""The subscription list: filters, search and failure columns; retry billing and cancel; the detail page."""

from datetime import timedelta

import pytest
from django.urls import reverse

from billing.models import BillingRun, Invoice, PaymentAttempt, Subscription
from billing.services.drain import drain_due
from hardcount.admin import MAX_ACTION_ROWS
from hardcount.models import Tenant
from hardcount.times import database_now
from outbox.models import Event
from tests.admin import rows
from tests.admin.conftest import changelist_ids, messages_of

SUBSCRIPTIONS = reverse("admin:billing_subscription_changelist")


def _change_url(sub) -> str:
    return reverse("admin:billing_subscription_change", args=[sub.pk])


@pytest.fixture
def spread(db):
    """Two tenants' subscriptions in every mode, status and billing state the filters tell apart."""
    acme, globex = Tenant.objects.create(name="Acme"), Tenant.objects.create(name="Globex")
    return {
        "acme_test_ok": rows.subscription(acme),
        "acme_live_ok": rows.subscription(acme, livemode=True),
        "acme_canceled": rows.subscription(acme, status="canceled", next_billing_at=None),
        "globex_waiting": rows.waiting(globex, status="past_due"),
        "globex_parked": rows.parked(globex),
        "globex_live_parked": rows.parked(globex, livemode=True),
        "acme": acme,
        "globex": globex,
    }


def _ids(spread, *names) -> set[str]:
    return {spread[name].pk for name in names}


@pytest.mark.django_db
def test_each_filter_narrows_the_subscription_list(spread, operator):
    everything = _ids(
        spread, "acme_test_ok", "acme_live_ok", "acme_canceled", "globex_waiting", "globex_parked", "globex_live_parked"
    )
    cases = [
        ({}, everything),
        ({"tenant__id__exact": spread["acme"].pk}, _ids(spread, "acme_test_ok", "acme_live_ok", "acme_canceled")),
        (
            {"tenant__id__exact": spread["globex"].pk},
            _ids(spread, "globex_waiting", "globex_parked", "globex_live_parked"),
        ),
        ({"mode": "live"}, _ids(spread, "acme_live_ok", "globex_live_parked")),
        ({"mode": "test"}, everything - _ids(spread, "acme_live_ok", "globex_live_parked")),
        ({"status__exact": "canceled"}, _ids(spread, "acme_canceled")),
        ({"status__exact": "past_due"}, _ids(spread, "globex_waiting")),
        ({"billing_state": "ok"}, _ids(spread, "acme_test_ok", "acme_live_ok", "acme_canceled")),
        ({"billing_state": "waiting"}, _ids(spread, "globex_waiting")),
        ({"billing_state": "parked"}, _ids(spread, "globex_parked", "globex_live_parked")),
        ({"billing_state": "parked", "mode": "test"}, _ids(spread, "globex_parked")),
        ({"tenant__id__exact": spread["acme"].pk, "billing_state": "parked"}, set()),
    ]
    for params, expected in cases:
        assert changelist_ids(operator, SUBSCRIPTIONS, params) == expected, params


@pytest.mark.django_db
def test_billing_state_filter_agrees_with_the_model(spread, operator):
    for state in ("ok", "waiting", "parked"):
        listed = Subscription.objects.filter(pk__in=changelist_ids(operator, SUBSCRIPTIONS, {"billing_state": state}))
        assert listed and {sub.billing_state for sub in listed} == {state}


@pytest.mark.django_db
def test_search_finds_by_subscription_id_customer_email_in_any_case_and_external_id(tenant, operator):
    by_email = rows.subscription(tenant, email="Jane.Doe@Example.com")
    by_external = rows.subscription(tenant, external_id="crm-4711")
    other = rows.subscription(tenant)

    assert changelist_ids(operator, SUBSCRIPTIONS, {"q": by_email.pk}) == {by_email.pk}
    assert changelist_ids(operator, SUBSCRIPTIONS, {"q": "jane.doe@example.COM"}) == {by_email.pk}
    assert changelist_ids(operator, SUBSCRIPTIONS, {"q": "crm-4711"}) == {by_external.pk}
    assert changelist_ids(operator, SUBSCRIPTIONS, {"q": other.customer_id}) == {other.pk}
    assert changelist_ids(operator, SUBSCRIPTIONS, {"q": "crm-47"}) == set()  # exact, not LIKE '%…%'


@pytest.mark.django_db
def test_list_shows_next_billing_the_failure_state_in_words_and_last_error(tenant, operator):
    sub = rows.waiting(tenant)

    response = operator.get(SUBSCRIPTIONS)

    text = response.content.decode()
    for column in ("next billing", "billing state", "last error"):
        assert f">{column}</a>" in text.lower() or f">{column}</span>" in text.lower(), column
    assert "gateway: 503 Service Unavailable" in text
    assert f"waiting until {sub.next_billing_attempt_at:%Y-%m-%d %H:%M} UTC · failure 2" in text
    row = response.context["cl"].result_list[0]
    assert (row.pk, row.billing_failure_count, row.billing_state) == (sub.pk, 2, "waiting")


def _park_after_a_real_failure(book, stripe_proxy):
    """A subscription whose first close failed at the gateway (an open invoice, failure 1), then parked."""
    tenant = book.tenant()
    sub = book.subscribed(tenant)
    pm = sub.customer.default_payment_method
    stripe_proxy.fail_next(
        "500", times=10_000, match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    Subscription.objects.filter(pk=sub.pk).update(
        billing_failure_count=8, next_billing_attempt_at=None, billing_parked_at=database_now()
    )
    stripe_proxy.clear()  # the gateway recovers
    sub.refresh_from_db()
    assert sub.billing_state == "parked"
    return sub


def test_retry_billing_action_on_a_parked_subscription_bills_it_through_the_gateway(
    book, stripe_proxy, stripe_client, operator
):
    sub = _park_after_a_real_failure(book, stripe_proxy)

    response = operator.post(SUBSCRIPTIONS, {"action": "retry_billing", "_selected_action": [sub.pk]}, follow=True)

    sub.refresh_from_db()
    invoice = Invoice.objects.get(subscription=sub)
    assert messages_of(response) == [f"{sub.pk}: billed (invoice {invoice.pk}); failure state cleared."]
    assert (sub.status, sub.billing_state, sub.billing_failure_count) == ("active", "ok", 0)
    assert invoice.status == "paid" and sub.next_billing_at == invoice.period_end
    assert stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id).status == "succeeded"
    run = BillingRun.objects.get(trigger="manual", attempted=1, billed=1)
    assert run.attempts.get().subscription_id == sub.pk


def test_retry_billing_reports_a_second_failure_per_row(book, stripe_proxy, operator):
    sub = _park_after_a_real_failure(book, stripe_proxy)
    pm = sub.customer.default_payment_method
    stripe_proxy.fail_next(
        "500", times=10_000, match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )
    healthy = book.subscribed(sub.tenant)

    response = operator.post(
        SUBSCRIPTIONS, {"action": "retry_billing", "_selected_action": [sub.pk, healthy.pk]}, follow=True
    )

    text = messages_of(response)
    assert len(text) == 2
    assert text[0].startswith(f"{sub.pk}: failed again (failure 1, next attempt at ")
    assert text[1].startswith(f"{healthy.pk}: not retried. Subscription {healthy.pk} is neither waiting")
    sub.refresh_from_db()
    assert (sub.billing_state, sub.billing_failure_count) == ("waiting", 1)


def test_retry_from_the_detail_page_returns_to_it_and_the_page_shows_invoices_and_attempts(
    book, stripe_proxy, operator
):
    sub = _park_after_a_real_failure(book, stripe_proxy)

    response = operator.post(
        SUBSCRIPTIONS, {"action": "retry_billing", "_selected_action": [sub.pk], "_return_to": "change"}
    )

    assert response.status_code == 302 and response["Location"] == _change_url(sub)
    page = operator.get(_change_url(sub)).content.decode()
    invoice = Invoice.objects.get(subscription=sub)
    # The first (failed, transient) attempt was re-sent under its own key: one row, now succeeded.
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert attempt.outcome == "succeeded"
    assert invoice.number in page  # the invoices inline
    assert attempt.payment_intent_id in page  # the payment attempts table
    runs = BillingRun.objects.filter(attempts__subscription=sub)
    assert {run.trigger for run in runs} == {"manual"} and runs.count() == 2
    for run in runs:
        assert run.pk in page  # the billing attempts inline: the failed first run and the retry


@pytest.mark.django_db
def test_cancel_asks_for_confirmation_then_cancels_through_the_service(tenant, operator):
    sub = rows.subscription(tenant)

    confirm = operator.post(SUBSCRIPTIONS, {"action": "cancel_now", "_selected_action": [sub.pk]})

    assert confirm.status_code == 200 and b"Yes, I\xe2\x80\x99m sure" in confirm.content
    sub.refresh_from_db()
    assert sub.status == "active"

    response = operator.post(
        SUBSCRIPTIONS, {"action": "cancel_now", "_selected_action": [sub.pk], "confirmed": "yes"}, follow=True
    )

    assert messages_of(response) == [f"{sub.pk}: canceled now."]
    sub.refresh_from_db()
    assert (sub.status, sub.next_billing_at) == ("canceled", None)
    assert Event.objects.filter(type="subscription.canceled", data__id=sub.pk).count() == 1


@pytest.mark.django_db
def test_cancel_at_period_end_keeps_billing_until_then(tenant, operator):
    sub = rows.subscription(tenant)

    operator.post(SUBSCRIPTIONS, {"action": "cancel_at_period_end", "_selected_action": [sub.pk], "confirmed": "yes"})

    sub.refresh_from_db()
    assert (sub.status, sub.cancel_at_period_end) == ("active", True)


@pytest.mark.django_db
def test_an_action_refuses_more_rows_than_its_limit_and_does_nothing(tenant, operator):
    subs = [rows.subscription(tenant) for _ in range(MAX_ACTION_ROWS + 1)]

    response = operator.post(
        SUBSCRIPTIONS,
        {"action": "cancel_now", "_selected_action": [s.pk for s in subs], "confirmed": "yes"},
        follow=True,
    )

    assert messages_of(response) == [f"Select at most {MAX_ACTION_ROWS} subscriptions per action; nothing was done."]
    assert not Subscription.objects.filter(status="canceled").exists()


@pytest.mark.django_db
def test_detail_page_of_a_waiting_subscription_shows_its_failure_state(tenant, operator):
    sub = rows.waiting(tenant, next_billing_at=database_now() - timedelta(hours=1))

    page = operator.get(_change_url(sub)).content.decode()

    assert "waiting" in page and "gateway: 503 Service Unavailable" in page
    assert 'value="retry_billing"' in page and 'value="cancel_now"' in page  # the page's own action buttons
    healthy = operator.get(_change_url(rows.subscription(tenant))).content.decode()
    assert 'value="retry_billing"' not in healthy and 'value="cancel_now"' in healthy  # nothing to retry
