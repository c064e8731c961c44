"""The drain (docs/reference/billing.md): pages, exactly-once, the exclude list, no circuit breaker, the ladder."""

from datetime import timedelta

import pytest

from billing.models import BillingAttempt, BillingRun, Invoice, PaymentAttempt, Subscription, TestClock
from billing.queries import LADDER
from billing.services.drain import BillingRetryNotAllowed, drain_due, retry_billing
from hardcount.times import database_now
from tests.billing.conftest import events


def _drain(tenant, **kw):
    return drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, **kw)


def _fail_card_of(stripe_proxy, sub, kind="500"):
    """Make every PaymentIntent request for ``sub``'s card fail with ``kind``."""
    pm = sub.customer.default_payment_method
    stripe_proxy.fail_next(
        kind, times=10_000, match=lambda r: r.line.startswith("POST /v1/payment_intents") and pm in r.body.decode()
    )


def _make_due_again(sub):
    """Move the ladder's wait into the past instead of sleeping."""
    Subscription.objects.filter(pk=sub.pk).update(next_billing_attempt_at=database_now() - timedelta(seconds=1))


def test_drain_of_several_pages_bills_each_subscription_exactly_once(book, tenant, stripe_proxy):
    subs = [book.subscribed(tenant) for _ in range(23)]

    run = _drain(tenant, page_size=5, concurrency=4)

    assert (run.status, run.pages, run.attempted, run.billed, run.failed) == ("completed", 5, 23, 23, 0)
    for sub in subs:
        invoices = list(Invoice.objects.filter(subscription=sub))
        assert [i.status for i in invoices] == ["paid"]
        assert invoices[0].period_start == sub.billing_cycle_anchor
        sub.refresh_from_db()
        assert sub.periods_billed == 1
        assert sub.next_billing_at == invoices[0].period_end
    intents = {a.payment_intent_id for a in PaymentAttempt.objects.all()}
    assert len(intents) == 23 and "" not in intents
    assert len(stripe_proxy.entries("POST /v1/payment_intents", "forwarded")) == 23
    again = _drain(tenant, page_size=5)
    assert (again.pages, again.attempted) == (0, 0)
    assert BillingRun.objects.get(pk=run.pk).status == "completed"


def test_invoice_numbers_are_gapless_under_parallel_closes(book, tenant):
    for _ in range(12):
        book.subscribed(tenant)

    _drain(tenant, page_size=100, concurrency=8)

    numbers = sorted(int(n) for n in Invoice.objects.values_list("number", flat=True))
    assert numbers == list(range(1, 13))


def test_a_failing_subscription_is_attempted_once_and_does_not_stop_the_rest(book, tenant, stripe_proxy):
    # The failing one is the oldest due, so without the exclude list it would lead every page.
    failing = book.subscribed(tenant, anchor=database_now() - timedelta(days=2))
    good = [book.subscribed(tenant) for _ in range(6)]
    _fail_card_of(stripe_proxy, failing)

    run = _drain(tenant, page_size=2, concurrency=1)

    assert (run.attempted, run.billed, run.failed) == (7, 6, 1)
    assert BillingAttempt.objects.filter(run=run, subscription=failing).count() == 1
    assert all(Invoice.objects.get(subscription=s).status == "paid" for s in good)
    failing.refresh_from_db()
    assert (failing.billing_failure_count, failing.periods_billed, failing.billing_state) == (1, 0, "waiting")
    assert "500" in failing.last_billing_error


def test_no_circuit_breaker_many_failures_in_a_row_do_not_stop_the_run(book, tenant, stripe_proxy):
    old = database_now() - timedelta(days=3)
    failing = [book.subscribed(tenant, anchor=old + timedelta(minutes=i)) for i in range(10)]
    late_good = [book.subscribed(tenant) for _ in range(2)]
    for sub in failing:
        _fail_card_of(stripe_proxy, sub)

    run = _drain(tenant, page_size=3, concurrency=2)

    assert (run.attempted, run.failed, run.billed) == (12, 10, 2)
    assert all(Invoice.objects.get(subscription=s).status == "paid" for s in late_good)


def test_waiting_and_parked_subscriptions_are_left_out_of_due_scans(book, tenant, no_doctor):
    # no_doctor: the parked state is written straight to the row, without its event.
    waiting = book.subscribed(tenant)
    parked = book.subscribed(tenant)
    now = database_now()
    Subscription.objects.filter(pk=waiting.pk).update(
        billing_failure_count=1, next_billing_attempt_at=now + timedelta(minutes=15)
    )
    Subscription.objects.filter(pk=parked.pk).update(billing_failure_count=8, billing_parked_at=now)

    run = _drain(tenant)

    assert run.attempted == 0
    assert not Invoice.objects.exists()


def test_failures_follow_the_ladder_to_the_minute_and_the_eighth_parks(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant)
    _fail_card_of(stripe_proxy, sub)

    for k in range(1, 8):
        before = database_now()
        run = _drain(tenant)
        assert (run.attempted, run.failed) == (1, 1)
        sub.refresh_from_db()
        assert sub.billing_failure_count == k
        assert sub.billing_parked_at is None
        wait = sub.next_billing_attempt_at - before
        assert abs(wait - LADDER[k - 1]) < timedelta(minutes=1), (k, wait)
        assert _drain(tenant).attempted == 0  # waiting: skipped until its time
        _make_due_again(sub)

    _drain(tenant)
    sub.refresh_from_db()
    assert sub.billing_failure_count == 8
    assert sub.billing_parked_at is not None and sub.next_billing_attempt_at is None
    assert sub.billing_state == "parked"
    assert _drain(tenant).attempted == 0
    assert len(events("subscription.billing_failed")) == 7
    assert len(events("subscription.billing_parked")) == 1
    assert sub.periods_billed == 0  # failures never advance the period
    assert Invoice.objects.filter(subscription=sub).count() == 1  # one invoice, re-attempted


def test_ladder_waits_add_up_to_three_days_seventeen_hours_fifteen_minutes():
    assert sum(LADDER, timedelta()) == timedelta(days=3, hours=17, minutes=15)


def test_retry_billing_on_a_parked_subscription_that_now_succeeds_leaves_it_active(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant)
    _fail_card_of(stripe_proxy, sub)
    _drain(tenant)
    Subscription.objects.filter(pk=sub.pk).update(
        billing_failure_count=8, next_billing_attempt_at=None, billing_parked_at=database_now()
    )
    stripe_proxy.clear()  # the gateway recovers

    attempt = retry_billing(sub.id, tenant_id=tenant.id, livemode=False)

    sub.refresh_from_db()
    invoice = Invoice.objects.get(subscription=sub)
    assert attempt.outcome == "billed" and attempt.run.trigger == "manual"
    assert (sub.status, sub.billing_failure_count, sub.billing_state) == ("active", 0, "ok")
    assert sub.billing_parked_at is None and sub.last_billing_error == ""
    assert invoice.status == "paid"
    assert sub.next_billing_at == invoice.period_end > database_now()


def test_a_manual_retry_that_fails_starts_the_ladder_fresh(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant)
    _fail_card_of(stripe_proxy, sub)
    _drain(tenant)
    Subscription.objects.filter(pk=sub.pk).update(billing_failure_count=5)
    before = database_now()

    attempt = retry_billing(sub.id, tenant_id=tenant.id, livemode=False)

    sub.refresh_from_db()
    assert (attempt.outcome, attempt.failure_number) == ("failed", 1)
    assert sub.billing_failure_count == 1
    assert abs((sub.next_billing_attempt_at - before) - timedelta(minutes=15)) < timedelta(minutes=1)


def test_retry_billing_refuses_a_subscription_that_is_not_failing(book, tenant):
    sub = book.subscribed(tenant)
    with pytest.raises(BillingRetryNotAllowed):
        retry_billing(sub.id, tenant_id=tenant.id, livemode=False)
    assert not BillingRun.objects.exists()


def test_wall_clock_drains_skip_test_clock_subscriptions_and_the_clock_drain_bills_them(book, tenant):
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=database_now() - timedelta(days=400))
    customer = book.customer(tenant, clock=clock)
    sub = book.subscription(customer, book.price(tenant), anchor=clock.frozen_time - timedelta(hours=1))

    assert _drain(tenant).attempted == 0

    run = drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert (run.billed, run.as_of) == (1, clock.frozen_time)
    assert invoice.status == "paid"
    assert invoice.created_at == invoice.paid_at == clock.frozen_time  # billing time is the clock's


def test_failures_on_a_test_clock_are_not_saved_on_the_subscription(book, tenant, stripe_proxy):
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=database_now())
    customer = book.customer(tenant, clock=clock)
    sub = book.subscription(customer, book.price(tenant), anchor=clock.frozen_time - timedelta(hours=1))
    _fail_card_of(stripe_proxy, sub)

    run = drain_due(livemode=False, trigger="test_clock", tenant_id=tenant.id, test_clock_id=clock.id)

    sub.refresh_from_db()
    clock.refresh_from_db()
    assert run.failed == 1
    assert (sub.billing_failure_count, sub.next_billing_attempt_at) == (0, None)
    assert "500" in clock.last_failure


def test_a_decline_advances_the_period_marks_past_due_and_starts_dunning(book, tenant):
    from dunning.models import DunningRun
    from tests.billing.conftest import DECLINING_CARD

    sub = book.subscribed(tenant, card=DECLINING_CARD)

    run = _drain(tenant)

    sub.refresh_from_db()
    invoice = Invoice.objects.get(subscription=sub)
    assert run.billed == 1 and BillingAttempt.objects.get(run=run).outcome == "declined"
    assert (invoice.status, invoice.attempt_count) == ("open", 1)
    assert (sub.status, sub.periods_billed, sub.billing_failure_count) == ("past_due", 1, 0)
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    assert (attempt.outcome, attempt.decline_code) == ("declined", "generic_decline")
    assert attempt.payment_intent_id.startswith("pi_")
    dunning = DunningRun.objects.get(invoice=invoice)
    assert dunning.status == "active" and dunning.last_decline_code == "generic_decline"
    assert [e.data["id"] for e in events("invoice.payment_failed")] == [invoice.id]
    assert [e.data["status"] for e in events("subscription.past_due")] == ["past_due"]


def test_a_customer_without_a_payment_method_is_declined_without_a_call(book, tenant, stripe_proxy):
    sub = book.subscribed(tenant, card=None)

    _drain(tenant)

    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    assert (attempt.outcome, attempt.decline_code, attempt.idempotency_key) == (
        "declined",
        "payment_method_missing",
        "",
    )
    assert stripe_proxy.entries("POST /v1/payment_intents") == []


def test_cancel_at_period_end_cancels_instead_of_billing(book, tenant):
    sub = book.subscribed(tenant)
    Subscription.objects.filter(pk=sub.pk).update(cancel_at_period_end=True)

    _drain(tenant)

    sub.refresh_from_db()
    assert (sub.status, sub.ended_at) == ("canceled", sub.billing_cycle_anchor)
    assert not Invoice.objects.exists()
    assert len(events("subscription.canceled")) == 1


def test_every_state_change_of_a_paid_close_writes_its_event(book, tenant):
    sub = book.subscribed(tenant)

    _drain(tenant)

    invoice = Invoice.objects.get(subscription=sub)
    assert [e.data["status"] for e in events("invoice.created")] == ["draft"]
    assert [e.data["number"] for e in events("invoice.finalized")] == [invoice.number]
    assert [e.data["id"] for e in events("invoice.paid")] == [invoice.id]
    assert [e.data["next_billing_at"] for e in events("subscription.updated")] == [
        invoice.period_end.isoformat().replace("+00:00", "Z")
    ]


class _ScriptedFence:
    """A fence whose ``alive()`` turns False after ``alive_calls`` calls and whose ``check()``
    raises LeaseLost from call number ``fail_check_at`` on."""

    token = 42

    def __init__(self, *, alive_calls=10_000, fail_check_at=10_000):
        self.alive_calls, self.fail_check_at, self.checks = alive_calls, fail_check_at, 0

    def alive(self):
        self.alive_calls -= 1
        return self.alive_calls >= 0

    def check(self):
        from hardcount.fencing import LeaseLost

        self.checks += 1
        if self.checks >= self.fail_check_at:
            raise LeaseLost("deposed (test)")


def test_a_drain_stops_at_the_next_safe_point_once_the_fence_is_not_alive(book, tenant, settings):
    # The fence's check() still passes (a stop requested while the lease is ours): the run ends abandoned.
    from hardcount.fencing import LeaseLost

    settings.HARDCOUNT_BILLING_PAGES_IN_FLIGHT = 1  # one page at a time: the fence's calls come in this order
    for _ in range(6):
        book.subscribed(tenant)
    pages = []
    # alive() before page 1, before its 2 subscriptions, then False before page 2.
    fence = _ScriptedFence(alive_calls=3)

    with pytest.raises(LeaseLost):
        drain_due(livemode=False, trigger="scheduler", page_size=2, concurrency=1, fence=fence, on_page=pages.append)

    run = BillingRun.objects.get()
    assert (run.status, run.pages, run.billed, run.lease_token) == ("abandoned", 1, 2, 42)
    assert run.error.startswith("stopped at a safe point") and run.finished_at is not None
    assert Invoice.objects.count() == 2
    assert [p.pages for p in pages] == [1]


@pytest.mark.parametrize("depth", [2, 3])
def test_with_pages_in_flight_a_stop_claims_no_more_and_lets_the_next_page_finish(book, tenant, settings, depth):
    from hardcount.fencing import LeaseLost

    settings.HARDCOUNT_BILLING_PAGES_IN_FLIGHT = depth
    for _ in range(8):
        book.subscribed(tenant)
    fence, pages = _ScriptedFence(), []

    def stop_after_the_first(run):
        pages.append(run.pages)
        fence.alive_calls = 0  # from now on alive() is False

    with pytest.raises(LeaseLost):
        drain_due(
            livemode=False, trigger="scheduler", page_size=2, concurrency=1, fence=fence, on_page=stop_after_the_first
        )

    run = BillingRun.objects.get()
    # The pages after the first were claimed while page 1's charges were out; nothing was claimed after the stop.
    assert (run.status, run.pages) == ("abandoned", depth)
    assert pages[0] == depth and Invoice.objects.count() == 2 * depth
    # Those pages recorded, or (a send abandoned at the stop) left reserved for the next close: never lost.
    assert run.billed % 2 == 0 and 2 <= run.billed <= 2 * depth
    left = PaymentAttempt.objects.exclude(outcome="succeeded")
    assert {a.outcome for a in left} <= {"unknown"} and left.count() == 2 * depth - run.billed


def test_a_deposed_drain_writes_nothing_after_the_charge_and_the_successor_resolves_it(book, tenant, stripe_proxy):
    from hardcount.fencing import LeaseLost
    from tests.billing.conftest import age_payment_attempts

    sub = book.subscribed(tenant)
    # check(): 1 start run, 2 claim, 3 the close's first step, 4 its record -> refused.
    with pytest.raises(LeaseLost):
        drain_due(livemode=False, trigger="scheduler", concurrency=1, fence=_ScriptedFence(fail_check_at=4))
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, PaymentAttempt.objects.get(invoice=invoice).outcome) == ("open", "unknown")
    age_payment_attempts()

    successor = drain_due(livemode=False, trigger="scheduler", concurrency=1)

    invoice.refresh_from_db()
    assert (successor.billed, invoice.status) == (1, "paid")
    assert len(stripe_proxy.entries("POST /v1/payment_intents", "forwarded")) == 1
    assert BillingRun.objects.exclude(pk=successor.pk).get().status == "abandoned"


def test_a_superseded_run_is_ended_with_the_counts_of_its_billing_attempts(book, tenant):
    for _ in range(3):
        book.subscribed(tenant)
    first = drain_due(livemode=False, trigger="scheduler", concurrency=1)
    # As a leader killed before its page ended leaves it: still running, its counts never saved.
    BillingRun.objects.filter(pk=first.pk).update(status="running", finished_at=None, attempted=0, billed=0, failed=0)

    drain_due(livemode=False, trigger="scheduler", concurrency=1)

    dead = BillingRun.objects.get(pk=first.pk)
    assert (dead.status, dead.attempted, dead.billed, dead.failed) == ("abandoned", 3, 3, 0)


def test_a_subscription_several_periods_behind_is_billed_one_period_per_run(book, tenant):
    anchor = database_now() - timedelta(days=2, hours=1)  # periods 0, 1 and 2 have begun
    sub = book.subscribed(tenant, interval="day", anchor=anchor)

    runs = [_drain(tenant, page_size=1) for _ in range(4)]

    assert [(r.attempted, r.billed) for r in runs] == [(1, 1), (1, 1), (1, 1), (0, 0)]
    starts = sorted(Invoice.objects.filter(subscription=sub).values_list("period_start", flat=True))
    assert starts == [anchor, anchor + timedelta(days=1), anchor + timedelta(days=2)]


def test_a_claim_passes_over_the_pages_in_flight_so_a_subscription_behind_is_closed_once_per_run(
    book, tenant, settings
):
    settings.HARDCOUNT_BILLING_PAGES_IN_FLIGHT = 2
    anchor = database_now() - timedelta(days=2, hours=1)  # periods 0, 1 and 2 have begun
    # Below the minimum charge, so not a plain close: it takes the per-close path, which at concurrency 1 has
    # committed its period (the next still due, past the claim's cursor) before the next page is claimed.
    sub = book.subscribed(tenant, interval="day", anchor=anchor, amount=10)

    run = _drain(tenant, page_size=1, concurrency=1)

    assert (run.attempted, run.billed) == (1, 1)
    assert list(Invoice.objects.filter(subscription=sub).values_list("period_start", flat=True)) == [anchor]


def test_a_trial_ends_with_the_first_invoice_and_the_subscription_becomes_active(book, tenant):
    sub = book.subscribed(tenant, status="trialing")

    _drain(tenant)

    sub.refresh_from_db()
    assert sub.status == "active"
    assert Invoice.objects.get(subscription=sub).period_start == sub.billing_cycle_anchor
