"""Everything written for an object on a test clock carries the clock's time (docs/decisions/0082): payment attempts,
ledger entries and events, whoever writes them (the advance's walk, the pay API, the reconciler); whether such a
charge is in flight is its charge lock's to say, since its times are the clock's; and the doctor's
``test_clock_times_on_its_timeline`` finds a wall-clock stamp among them."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from dateutil.relativedelta import relativedelta
from django.db import transaction

from billing.models import BillingRun, Invoice, LedgerEntry, PaymentAttempt, Subscription, TestClock
from billing.services.drain import reconcile
from billing.services.invoices import pay_invoice
from billing.services.ledger import grant_credit
from billing.services.payments import PaymentInFlight, charges_in_flight
from dunning.models import DunningRun
from ops.doctor import run_checks
from outbox.models import Event
from tests.billing.conftest import DECLINING_CARD
from tests.claim_holder import TTL_S, OtherHolder
from tests.clocks.helpers import advance, make_clock, subscribe

# A month after the wall clock of the machines this runs on: a wall-clock stamp lies before the clock began.
T0 = datetime(2027, 1, 1, tzinfo=UTC)
DAY = timedelta(days=1)
WEEK = timedelta(weeks=1)
CHECK = "test_clock_times_on_its_timeline"


def _objects_of(clock: TestClock) -> set[str]:
    """Ids of everything on the clock that events are about: the clock, its customers, subscriptions, invoices,
    ledger entries, dunning runs and billing runs."""
    subs = Subscription.objects.filter(test_clock=clock)
    ids = {clock.id, *subs.values_list("id", flat=True), *subs.values_list("customer_id", flat=True)}
    ids |= set(Invoice.objects.filter(customer__test_clock=clock).values_list("id", flat=True))
    ids |= set(LedgerEntry.objects.filter(customer__test_clock=clock).values_list("id", flat=True))
    ids |= set(DunningRun.objects.filter(test_clock=clock).values_list("id", flat=True))
    ids |= set(BillingRun.objects.filter(test_clock=clock).values_list("id", flat=True))
    return ids


def _about(event: Event) -> str | None:
    """The id of the object an event is about (its data is the object, or wraps it under ``object``)."""
    wrapped = event.data.get("object")
    return wrapped.get("id") if isinstance(wrapped, dict) else event.data.get("id")


def _stamps(clock: TestClock) -> list[tuple[str, datetime]]:
    """Every payment-attempt, ledger-entry and event time of the clock's objects, with what it is."""
    stamps = []
    for a in PaymentAttempt.objects.filter(invoice__customer__test_clock=clock):
        stamps += [(f"{a.id} started_at", a.started_at), (f"{a.id} completed_at", a.completed_at)]
    stamps += [(f"{e.id} created_at", e.created_at) for e in LedgerEntry.objects.filter(customer__test_clock=clock)]
    objects = _objects_of(clock)
    stamps += [(f"{e.id} {e.type}", e.created_at) for e in Event.objects.all() if _about(e) in objects]
    return stamps


def _check(name: str = CHECK):
    (result,) = run_checks(names=[name])
    return result


def test_an_advance_over_months_dates_every_attempt_ledger_entry_and_event_by_the_clock(book, tenant, stripe_proxy):
    clock = make_clock(tenant, T0)
    paying = subscribe(book, clock)
    declining = subscribe(book, clock, card=DECLINING_CARD)
    weekly = subscribe(book, clock, interval="week")  # its renewals are instants of the walk between the months
    grant_credit(paying.customer_id, tenant_id=tenant.id, livemode=False, amount=300, currency="usd")
    clock = advance(clock, T0 + 20 * DAY)  # January: paid, and declined through the whole dunning schedule
    # February's charge of the paying card times out after it reached the gateway: left unknown at Feb 1, re-sent
    # under its own key at the next instant of the walk (its charge lock was freed with the record).
    pm = paying.customer.default_payment_method
    stripe_proxy.fail_next(
        "timeout_after_forward", match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )
    clock = advance(clock, T0 + relativedelta(months=4))

    stamps = _stamps(clock)
    assert len(stamps) > 100
    off = [(what, at) for what, at in stamps if not T0 <= at <= clock.frozen_time]
    assert off == []

    declined = Invoice.objects.get(subscription=declining)
    attempts = declined.payment_attempts.order_by("attempt_number")
    # The first charge and the four dunning retries (1, 3, 5 and 7 days after the decline), each at its instant.
    assert [(a.started_at, a.completed_at) for a in attempts] == [(T0 + d * DAY,) * 2 for d in (0, 1, 3, 5, 7)]
    assert declined.status == Invoice.UNCOLLECTIBLE

    paid = Invoice.objects.filter(subscription=paying).order_by("period_start")
    assert [i.status for i in paid] == [Invoice.PAID] * 5
    february = paid[1].payment_attempts.get()
    # Sent at Feb 1, its answer lost; the same-key re-send at the next instant (the weekly renewal of Feb 5)
    # recorded the payment.
    assert (february.started_at, february.completed_at, february.outcome) == (
        T0 + 5 * WEEK,
        T0 + 5 * WEEK,
        PaymentAttempt.SUCCEEDED,
    )
    assert paid[1].paid_at == T0 + 5 * WEEK
    renewals = Invoice.objects.filter(subscription=weekly, status=Invoice.PAID)
    assert renewals.count() == 18  # Jan 1 … Apr 30, every seventh day
    assert set(LedgerEntry.objects.filter(customer_id=paying.customer_id).values_list("created_at", flat=True)) == {T0}
    completed = [e.created_at for e in Event.objects.filter(type="billing_run.completed").order_by("sequence")]
    assert completed == list(
        BillingRun.objects.filter(test_clock=clock).order_by("started_at").values_list("as_of", flat=True)
    )
    assert _check().status == "ok"


def test_the_pay_api_and_the_reconciler_charge_a_clock_invoice_at_the_clock_time(book, tenant, stripe_proxy, make_card):
    from billing.services.customers import update_customer

    clock = make_clock(tenant, T0)
    sub = subscribe(book, clock, card=DECLINING_CARD)
    clock = advance(clock, T0 + DAY / 2)  # declined at T0
    invoice = Invoice.objects.get(subscription=sub)
    update_customer(
        tenant_id=tenant.id, livemode=False, customer_id=sub.customer_id, default_payment_method=make_card()
    )

    # The new card's charge times out (the gateway took it): the attempt stays unknown, dated by the clock.
    stripe_proxy.fail_next("timeout_after_forward", match="POST /v1/payment_intents")
    _, attempt, outcome = pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    assert (outcome.kind, attempt.outcome, attempt.started_at, attempt.completed_at) == (
        "failed",
        PaymentAttempt.UNKNOWN,
        clock.frozen_time,
        clock.frozen_time,
    )
    # Nobody holds its charge lock: not in flight, whatever its time says; the reconciler re-sends it at once.
    assert charges_in_flight([invoice.id]) == []
    assert reconcile(livemode=False)["payments_resolved"] == 1
    attempt.refresh_from_db()
    invoice.refresh_from_db()
    assert (attempt.outcome, attempt.started_at, attempt.completed_at) == (
        PaymentAttempt.SUCCEEDED,
        clock.frozen_time,
        clock.frozen_time,
    )
    assert (invoice.status, invoice.paid_at) == (Invoice.PAID, clock.frozen_time)
    assert [at for _, at in _stamps(clock) if not T0 <= at <= clock.frozen_time] == []


def test_a_clock_charge_is_in_flight_exactly_while_a_live_holder_has_its_charge_lock(book, tenant, stripe_proxy):
    clock = make_clock(tenant, T0)
    sub = subscribe(book, clock)
    stripe_proxy.fail_next("timeout", match="POST /v1/payment_intents")
    clock = advance(clock, T0 + DAY)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.payment_attempts.get().outcome == PaymentAttempt.UNKNOWN

    sender = OtherHolder(f"charge:{invoice.id}")  # another process sending it
    assert charges_in_flight([invoice.id]) == [invoice.id]
    with pytest.raises(PaymentInFlight):
        pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    assert reconcile(livemode=False)["payments_resolved"] == 0
    assert invoice.payment_attempts.get().outcome == PaymentAttempt.UNKNOWN

    time.sleep(2 * TTL_S)  # a live sender's claim does not lapse: it beats
    assert charges_in_flight([invoice.id]) == [invoice.id]
    sender.die()  # the sender's process died: its claim is no longer renewed and lapses
    deadline = time.monotonic() + 10
    while charges_in_flight([invoice.id]) and time.monotonic() < deadline:
        time.sleep(0.02)
    _, attempt, outcome = pay_invoice(invoice.id, tenant_id=tenant.id, livemode=False)
    assert (outcome.kind, attempt.attempt_number, attempt.started_at) == ("billed", 1, clock.frozen_time)


def test_negative_control_a_wall_clock_stamped_attempt_fails_the_doctor_check(book, tenant, no_doctor):
    clock = make_clock(tenant, T0)
    subscribe(book, clock)
    clock = advance(clock, T0 + relativedelta(months=2))
    assert _check().status == "ok"

    # One more attempt row written the way the payments used to be: dated by the database's now(), the wall clock.
    invoice = Invoice.objects.filter(customer__test_clock=clock).order_by("period_start").last()
    with transaction.atomic():
        wall = PaymentAttempt.objects.create(
            tenant_id=tenant.id,
            livemode=False,
            invoice=invoice,
            attempt_number=2,
            amount=invoice.amount_due,
            currency=invoice.currency,
            outcome=PaymentAttempt.DECLINED,
            decline_code="card_declined",
        )

    result = _check()
    assert (result.status, result.violations) == ("fail", 2)  # its started_at and its completed_at
    assert all(e.startswith(f"{wall.id}: payment attempt ") for e in result.examples)
    assert result.examples[0].endswith(
        ", the wall-clock time it was written at, is before the first time 2027-01-01 00:00:00+00 "
        f"of test clock {clock.id}"
    )
