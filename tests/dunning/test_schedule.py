"""The schedule of a dunning run, its retries through localstripe, and its end states (docs/reference/dunning.md)."""

from __future__ import annotations

import pytest

from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services.dunning_pass import process_due
from dunning.models import DunningRun
from dunning.services import update_settings
from tests.dunning.conftest import DAY, MINUTE, STOLEN_CARD, charges_sent, confirms, decline, doctor_failures, events


def _retry_times(declined, stripe_proxy, days=(1, 3, 5, 7)) -> list:
    """Run the dunning pass a minute before and at each retry time; the times at which it confirmed."""
    confirmed_at = []
    for day in days:
        due = declined.at + day * DAY
        before = len(confirms(stripe_proxy))
        assert process_due(livemode=False, as_of=due - MINUTE) == 0
        assert len(confirms(stripe_proxy)) == before, f"retried before day {day}"
        process_due(livemode=False, as_of=due)
        if len(confirms(stripe_proxy)) == before + 1:
            confirmed_at.append(due)
    return confirmed_at


def test_an_always_declining_invoice_is_retried_1_3_5_and_7_days_after_the_decline_to_the_minute(
    book, tenant, declined, stripe_proxy
):
    confirmed_at = _retry_times(declined, stripe_proxy)

    assert confirmed_at == [declined.at + d * DAY for d in (1, 3, 5, 7)]
    attempts = list(PaymentAttempt.objects.filter(invoice=declined.invoice).order_by("attempt_number"))
    assert [(a.attempt_number, a.outcome, a.decline_code) for a in attempts] == [
        (n, "declined", "generic_decline") for n in range(1, 6)
    ]
    # Each retry's decline is recorded at its billing time, and says when the next one is due.
    failed = events("invoice.payment_failed", data__id=declined.invoice.id)
    assert [e.created_at for e in failed] == [declined.at + d * DAY for d in (0, 1, 3, 5, 7)]
    assert [e.data["next_payment_attempt"] for e in failed] == [
        *(_iso(declined.at + d * DAY) for d in (1, 3, 5, 7)),
        None,
    ]


def test_the_last_declined_retry_marks_the_invoice_uncollectible_and_the_subscription_unpaid(
    book, tenant, declined, stripe_proxy
):
    _retry_times(declined, stripe_proxy)

    invoice = Invoice.objects.get(pk=declined.invoice.pk)
    sub = Subscription.objects.get(pk=declined.subscription.pk)
    run = DunningRun.objects.get(pk=declined.run.pk)
    end = declined.at + 7 * DAY
    assert (invoice.status, invoice.marked_uncollectible_at) == ("uncollectible", end)
    assert sub.status == "unpaid"
    assert (run.status, run.end_reason, run.retries_done, run.ended_at) == ("exhausted", "retries_exhausted", 4, end)
    assert [e.data["id"] for e in events("invoice.marked_uncollectible")] == [invoice.id]
    assert [e.data["status"] for e in events("subscription.updated", data__id=sub.id)][-1] == "unpaid"
    assert [(e.data["id"], e.created_at) for e in events("dunning.exhausted")] == [(run.id, end)]
    # Nothing more happens to it.
    assert process_due(livemode=False, as_of=end + 30 * DAY) == 0
    assert doctor_failures() == []


def _iso(value) -> str:
    from hardcount.times import iso

    return iso(value)


@pytest.mark.parametrize(
    ("final_action", "status", "event"),
    [("unpaid", "unpaid", "subscription.updated"), ("canceled", "canceled", "subscription.canceled")],
)
def test_exhaustion_applies_the_tenants_final_action(book, tenant, stripe_proxy, final_action, status, event):
    update_settings(tenant_id=tenant.id, livemode=False, retry_days=[2], final_action=final_action)
    declined = decline(book, tenant)

    assert process_due(livemode=False, as_of=declined.at + 2 * DAY) == 1

    sub = Subscription.objects.get(pk=declined.subscription.pk)
    invoice = Invoice.objects.get(pk=declined.invoice.pk)
    run = DunningRun.objects.get(pk=declined.run.pk)
    assert len(confirms(stripe_proxy)) == 1
    assert (invoice.status, run.status, run.end_reason) == ("uncollectible", "exhausted", "retries_exhausted")
    assert sub.status == status
    assert events(event, data__id=sub.id)[-1].data["status"] == status
    if final_action == "canceled":
        assert (sub.canceled_at, sub.ended_at, sub.next_billing_at) == (declined.at + 2 * DAY,) * 2 + (None,)
    else:
        assert sub.next_billing_at is not None and sub.canceled_at is None
    assert doctor_failures() == []


def test_a_canceled_subscription_ends_its_other_runs_without_charging_them(book, tenant, stripe_proxy):
    from billing.services.drain import drain_due

    update_settings(tenant_id=tenant.id, livemode=False, retry_days=[1, 40], final_action="canceled")
    first = decline(book, tenant)
    # The second period is billed (and declined) a month later.
    sub = Subscription.objects.get(pk=first.subscription.pk)
    Subscription.objects.filter(pk=sub.pk).update(next_billing_at=first.at - MINUTE)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    second = DunningRun.objects.exclude(pk=first.run.pk).get(invoice__subscription=sub)
    DunningRun.objects.filter(pk=first.run.pk).update(retry_days=[1])  # the first run's last retry is tomorrow

    process_due(livemode=False, as_of=first.at + DAY)

    second.refresh_from_db()
    assert Subscription.objects.get(pk=sub.pk).status == "canceled"
    assert (second.status, second.end_reason) == ("ended", "subscription_canceled")
    assert Invoice.objects.get(pk=second.invoice_id).status == "open"  # left to the tenant to void or collect
    assert [e.request.line for e in confirms(stripe_proxy)] == [
        f"POST /v1/payment_intents/{Invoice.objects.get(pk=first.invoice.pk).payment_intent_id}/confirm"
    ]


def test_a_hard_decline_is_not_retried_and_ends_at_the_last_retry_time(book, tenant, stripe_proxy):
    declined = decline(book, tenant, card=STOLEN_CARD)
    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.last_decline_code, run.waiting_for_payment_method) == ("stolen_card", True)
    assert events("invoice.payment_failed")[-1].data["next_payment_attempt"] is None
    stripe_proxy.clear()

    for day in (1, 3, 5):
        assert process_due(livemode=False, as_of=declined.at + day * DAY) == 0
    assert process_due(livemode=False, as_of=declined.at + 7 * DAY - MINUTE) == 0
    assert charges_sent(stripe_proxy) == []
    assert process_due(livemode=False, as_of=declined.at + 7 * DAY) == 1

    run.refresh_from_db()
    assert charges_sent(stripe_proxy) == []  # no retry ever reached the gateway
    assert PaymentAttempt.objects.filter(invoice=declined.invoice).count() == 1
    assert (run.status, run.end_reason, run.retries_done) == ("exhausted", "no_new_payment_method", 0)
    assert Invoice.objects.get(pk=declined.invoice.pk).status == "uncollectible"
    assert Subscription.objects.get(pk=declined.subscription.pk).status == "unpaid"


def test_a_new_payment_method_recovers_the_invoice_at_once(book, tenant, stripe_proxy, make_card):
    from billing.services.customers import update_customer

    declined = decline(book, tenant)
    new_card = make_card()
    update_customer(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=declined.subscription.customer_id,
        default_payment_method=new_card,
    )
    run = DunningRun.objects.get(pk=declined.run.pk)
    assert run.next_attempt_at <= run.retry_requested_at  # due now, not in a day

    assert process_due(livemode=False) == 1

    run.refresh_from_db()
    invoice = Invoice.objects.get(pk=declined.invoice.pk)
    sub = Subscription.objects.get(pk=declined.subscription.pk)
    assert (invoice.status, invoice.amount_paid) == ("paid", 1000)
    assert sub.status == "active"
    assert (run.status, run.end_reason, run.retries_done) == ("recovered", "retry_succeeded", 0)
    [confirm] = confirms(stripe_proxy)
    assert confirm.request.params["payment_method"] == new_card
    assert confirm.request.idempotency_key == f"hc:{invoice.id}:attempt:2"
    assert events("subscription.updated", data__id=sub.id)[-1].data["status"] == "active"
    assert doctor_failures() == []


def test_a_new_payment_method_after_a_hard_decline_restarts_the_schedule_from_that_retry(book, tenant, make_card):
    from billing.services.customers import update_customer
    from hardcount.times import database_now
    from tests.dunning.conftest import DECLINING_CARD

    declined = decline(book, tenant, card=STOLEN_CARD)
    # The stolen card was declined four days ago: retries 1 (day 1) and 2 (day 3) have passed unused.
    four_days_ago = declined.at - 4 * DAY
    DunningRun.objects.filter(pk=declined.run.pk).update(
        first_declined_at=four_days_ago, schedule_anchor_at=four_days_ago, next_attempt_at=four_days_ago + 7 * DAY
    )
    update_customer(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=declined.subscription.customer_id,
        default_payment_method=make_card(DECLINING_CARD),
    )

    assert process_due(livemode=False) == 1

    run = DunningRun.objects.get(pk=declined.run.pk)
    changed_at = run.schedule_anchor_at + 1 * DAY  # that retry is retry 1 of a schedule anchored a day before it
    assert changed_at <= database_now()
    assert (run.retries_done, run.waiting_for_payment_method, run.last_decline_code) == (1, False, "generic_decline")
    assert run.next_attempt_at == changed_at + 2 * DAY  # retry 2 keeps its spacing after retry 1
    assert run.first_declined_at == four_days_ago


def test_a_new_payment_method_before_the_next_retry_adds_a_retry_without_moving_the_schedule(
    book, tenant, make_card, stripe_proxy
):
    from billing.services.customers import update_customer
    from tests.dunning.conftest import DECLINING_CARD

    declined = decline(book, tenant)
    update_customer(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=declined.subscription.customer_id,
        default_payment_method=make_card(DECLINING_CARD),
    )

    assert process_due(livemode=False) == 1

    run = DunningRun.objects.get(pk=declined.run.pk)
    assert len(confirms(stripe_proxy)) == 1
    assert (run.retries_done, run.schedule_anchor_at, run.next_attempt_at) == (0, declined.at, declined.at + DAY)


def test_an_invoice_paid_by_other_means_ends_its_run_and_is_never_retried(book, tenant, declined, make_card):
    from billing.services.invoices import pay_invoice

    customer = declined.subscription.customer
    customer.default_payment_method = make_card()
    customer.save(update_fields=["default_payment_method"])
    pay_invoice(declined.invoice.id, tenant_id=tenant.id, livemode=False)

    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.status, run.end_reason, run.next_attempt_at) == ("recovered", "paid", None)
    assert process_due(livemode=False, as_of=declined.at + 30 * DAY) == 0
    assert PaymentAttempt.objects.filter(invoice=declined.invoice).count() == 2


def test_a_voided_invoice_ends_its_run(book, tenant, declined):
    from billing.services.invoices import void_invoice

    void_invoice(declined.invoice.id, tenant_id=tenant.id, livemode=False)

    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.status, run.end_reason) == ("ended", "voided")
    assert process_due(livemode=False, as_of=declined.at + 30 * DAY) == 0


def test_a_gateway_error_does_not_use_up_a_retry_and_is_resent_under_its_key_an_hour_later(
    book, tenant, declined, stripe_proxy
):
    stripe_proxy.fail_next("500", match="/confirm")

    assert process_due(livemode=False, as_of=declined.at + DAY) == 1

    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.retries_done, run.next_attempt_at) == (1, declined.at + DAY + 60 * MINUTE)
    assert run.attempt_started_at is not None and "500" in run.last_error
    assert process_due(livemode=False, as_of=declined.at + DAY + 59 * MINUTE) == 0
    assert process_due(livemode=False, as_of=declined.at + DAY + 60 * MINUTE) == 1

    run.refresh_from_db()
    keys = [e.request.idempotency_key for e in stripe_proxy.entries("/confirm")]
    assert keys == [f"hc:{declined.invoice.id}:attempt:2"] * 2  # the same request, re-sent
    assert (run.retries_done, run.attempt_started_at, run.next_attempt_at) == (1, None, declined.at + 3 * DAY)
    assert PaymentAttempt.objects.filter(invoice=declined.invoice).count() == 2


def test_a_retry_interrupted_after_its_claim_resumes_when_the_claim_expires_without_using_another_retry(
    book, tenant, declined, stripe_proxy
):
    from billing.services import dunning_pass

    def crash(run_ids):
        if run_ids:
            raise KeyboardInterrupt("killed after the claim")

    dunning_pass.hooks.after_claim = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            process_due(livemode=False, as_of=declined.at + DAY)
    finally:
        dunning_pass.hooks.after_claim = None
    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.retries_done, run.next_attempt_at) == (1, declined.at + DAY + dunning_pass.claim_window())
    assert process_due(livemode=False, as_of=declined.at + DAY + dunning_pass.claim_window() - MINUTE) == 0
    assert confirms(stripe_proxy) == []

    assert process_due(livemode=False, as_of=declined.at + DAY + dunning_pass.claim_window()) == 1

    run.refresh_from_db()
    assert len(confirms(stripe_proxy)) == 1
    assert (run.retries_done, run.next_attempt_at) == (1, declined.at + 3 * DAY)


def test_a_run_keeps_the_schedule_it_started_with(book, tenant, declined):
    update_settings(tenant_id=tenant.id, livemode=False, retry_days=[2, 4])
    later = decline(book, tenant)

    assert DunningRun.objects.get(pk=declined.run.pk).retry_days == [1, 3, 5, 7]
    assert (later.run.retry_days, later.run.next_attempt_at) == ([2, 4], later.at + 2 * DAY)


def test_wall_clock_passes_leave_test_clock_runs_to_their_clock(book, tenant, stripe_proxy):
    from datetime import UTC, datetime

    from billing.models import TestClock
    from billing.services.drain import drain_due
    from dunning.services import next_due_at
    from tests.dunning.conftest import DECLINING_CARD

    frozen = datetime(2031, 5, 31, 9, 30, tzinfo=UTC)
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=frozen)
    customer = book.customer(tenant, card=DECLINING_CARD, clock=clock)
    sub = book.subscription(customer, book.price(tenant), anchor=frozen)
    drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id, as_of=frozen)
    run = DunningRun.objects.get(invoice__subscription=sub)
    assert (run.test_clock_id, run.first_declined_at, next_due_at(test_clock_id=clock.id)) == (
        clock.id,
        frozen,
        frozen + DAY,
    )

    assert process_due(livemode=False, as_of=frozen + 400 * DAY) == 0  # the wall clock never reaches it
    assert process_due(livemode=False, test_clock_id=clock.id, as_of=frozen + DAY - MINUTE) == 0
    assert process_due(livemode=False, test_clock_id=clock.id, as_of=frozen + DAY) == 1

    run.refresh_from_db()
    assert (run.retries_done, run.next_attempt_at) == (1, frozen + 3 * DAY)
    assert events("invoice.payment_failed")[-1].created_at == frozen + DAY
    assert len(confirms(stripe_proxy)) == 1


def test_a_test_clock_advance_takes_a_declining_card_through_its_schedule_to_the_final_action(book, tenant):
    from datetime import UTC, datetime

    from tests.clocks.helpers import advance, make_clock, subscribe
    from tests.dunning.conftest import DECLINING_CARD

    start = datetime(2030, 2, 27, 12, 0, tzinfo=UTC)  # the schedule crosses the end of February
    clock = make_clock(tenant, start)
    sub = subscribe(book, clock, card=DECLINING_CARD)

    advance(clock, start + 8 * DAY)

    invoice = Invoice.objects.get(subscription_id=sub.id)
    run = DunningRun.objects.get(invoice=invoice)
    assert [e.created_at for e in events("invoice.payment_failed")] == [start + d * DAY for d in (0, 1, 3, 5, 7)]
    assert (invoice.status, invoice.marked_uncollectible_at) == ("uncollectible", start + 7 * DAY)
    assert (run.status, run.ended_at) == ("exhausted", start + 7 * DAY)
    assert Subscription.objects.get(pk=sub.id).status == "unpaid"


def test_a_subscription_canceled_by_the_tenant_ends_its_run_without_a_charge(book, tenant, declined, stripe_proxy):
    from billing.services.catalog import cancel_subscription

    cancel_subscription(tenant_id=tenant.id, livemode=False, subscription_id=declined.subscription.id)
    stripe_proxy.clear()

    assert process_due(livemode=False, as_of=declined.at + DAY) == 1

    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.status, run.end_reason) == ("ended", "subscription_canceled")
    assert charges_sent(stripe_proxy) == []
    assert Invoice.objects.get(pk=declined.invoice.pk).status == "open"


def test_a_customer_without_a_payment_method_waits_for_one_then_is_charged_with_it(
    book, tenant, stripe_proxy, make_card
):
    from billing.services.customers import update_customer

    declined = decline(book, tenant, card=None)
    run = DunningRun.objects.get(pk=declined.run.pk)
    assert (run.last_decline_code, run.waiting_for_payment_method) == ("payment_method_missing", True)
    assert process_due(livemode=False, as_of=declined.at + 3 * DAY) == 0

    update_customer(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=declined.subscription.customer_id,
        default_payment_method=make_card(),
    )
    assert process_due(livemode=False) == 1

    assert Invoice.objects.get(pk=declined.invoice.pk).status == "paid"
    assert DunningRun.objects.get(pk=declined.run.pk).end_reason == "retry_succeeded"
    assert len(charges_sent(stripe_proxy)) == 2  # attach the new card, create the PaymentIntent
