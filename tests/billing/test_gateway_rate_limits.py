"""A gateway account's 429s back off that account only, and never count as billing failures.

docs/decisions/0133-gateway-rate-limits.md. Real PostgreSQL, the real ``stripe`` library, localstripe
behind the strict dev Stripe, whose injected 429s carry ``Retry-After`` and can be aimed at one account.
"""

from __future__ import annotations

import time

import pytest

from billing import gateway as gw
from billing import gateway_accounts as accounts
from billing.models import Invoice, PaymentAttempt, Subscription
from billing.services.drain import drain_due
from tests.billing.conftest import events
from tests.dunning.conftest import DAY, decline

KEY_A = "sk_test_stormyAaaaaaaaaaaaaaaaaaa0001"
KEY_B = "sk_test_calmBbbbbbbbbbbbbbbbbbbbbb0002"
WEBHOOK_SECRET = "whsec_test0000000000000000000000"
RETRY_AFTER_S = 30.0


@pytest.fixture
def two_tenants(book):
    """A and B with their own accounts, three due subscriptions each."""
    a, b = book.tenant("Stormy"), book.tenant("Calm")
    accounts.set_account(tenant_id=a.id, livemode=False, secret_key=KEY_A, webhook_secret=WEBHOOK_SECRET)
    accounts.set_account(tenant_id=b.id, livemode=False, secret_key=KEY_B, webhook_secret=WEBHOOK_SECRET)
    return (a, [book.subscribed(a) for _ in range(3)]), (b, [book.subscribed(b) for _ in range(3)])


def _state(subs):
    rows = Subscription.objects.filter(pk__in=[s.pk for s in subs]).order_by("pk")
    return [(s.billing_failure_count, s.next_billing_attempt_at, s.billing_parked_at) for s in rows]


def _invoices(subs):
    return list(Invoice.objects.filter(subscription__in=subs))


def test_a_429_storm_on_one_account_leaves_it_due_off_the_ladder_and_does_not_slow_another(
    two_tenants, stripe_proxy, monkeypatch, settings
):
    # One close and one charge at a time, so exactly one 429 reaches the gateway before A's gate closes.
    settings.HARDCOUNT_BILLING_CHARGES_IN_FLIGHT = 1
    (_a, subs_a), (_b, subs_b) = two_tenants
    stripe_proxy.fail_next("429", times=1000, account=KEY_A, retry_after_s=RETRY_AFTER_S)

    started = time.monotonic()
    run = drain_due(livemode=False, trigger="manual", concurrency=1)
    elapsed = time.monotonic() - started

    # B: all paid in the same run, and nobody waited out A's Retry-After.
    assert [i.status for i in _invoices(subs_b)] == ["paid"] * 3
    assert elapsed < RETRY_AFTER_S
    # A: left due and unattempted, not failed: no ladder step, no failure event.
    invoices_a = _invoices(subs_a)
    assert [(i.status, i.attempt_count) for i in invoices_a] == [("open", 0)] * 3
    assert _state(subs_a) == [(0, None, None)] * 3
    assert events("subscription.billing_failed") == [] and events("subscription.billing_parked") == []
    attempts = PaymentAttempt.objects.filter(invoice__in=invoices_a)
    assert {(p.outcome, p.http_status, p.attempt_number) for p in attempts} == {("error", 429, 1)}
    assert (run.billed, run.failed) == (3, 0)
    # The gate: one 429 reached A's account; its other charges were never sent.
    assert len(stripe_proxy.entries(action="429")) == 1
    assert gw.backoff_remaining(gw.account_identity(KEY_A)) > RETRY_AFTER_S - 10
    assert gw.backoff_remaining(gw.account_identity(KEY_B)) == 0

    # Still backing off: the next run sends nothing for A.
    stripe_proxy.clear()
    drain_due(livemode=False, trigger="manual")
    assert [e for e in stripe_proxy.log if e.request.account == KEY_A] == []
    assert _state(subs_a) == [(0, None, None)] * 3

    # Once Retry-After has passed (the gate's clock moved on), A is billed, each under its first attempt's key.
    now = gw._clock()
    monkeypatch.setattr(gw, "_clock", lambda: now + RETRY_AFTER_S + 1)
    drain_due(livemode=False, trigger="manual")
    invoices_a = _invoices(subs_a)
    assert [i.status for i in invoices_a] == ["paid"] * 3
    attempts = PaymentAttempt.objects.filter(invoice__in=invoices_a)
    assert {(p.outcome, p.attempt_number) for p in attempts} == {("succeeded", 1)}
    assert _state(subs_a) == [(0, None, None)] * 3


def test_with_parallel_closes_too_the_storm_stays_on_its_own_account(two_tenants, stripe_proxy):
    (_a, subs_a), (_b, subs_b) = two_tenants
    stripe_proxy.fail_next("429", times=1000, account=KEY_A, retry_after_s=RETRY_AFTER_S)

    drain_due(livemode=False, trigger="manual", concurrency=8)

    assert [i.status for i in _invoices(subs_b)] == ["paid"] * 3
    assert [i.status for i in _invoices(subs_a)] == ["open"] * 3
    assert _state(subs_a) == [(0, None, None)] * 3
    # Charges already in flight when the first 429 came back may meet one each; no more.
    assert 1 <= len(stripe_proxy.entries(action="429")) <= 3


def test_negative_control_without_the_gate_every_charge_of_the_storm_reaches_the_gateway(
    two_tenants, stripe_proxy, monkeypatch
):
    (_a, _subs_a), _b = two_tenants
    monkeypatch.setattr(gw, "note_rate_limited", lambda account, headers: 0.0)
    stripe_proxy.fail_next("429", times=1000, account=KEY_A, retry_after_s=RETRY_AFTER_S)

    drain_due(livemode=False, trigger="manual", concurrency=1)

    assert len(stripe_proxy.entries(action="429")) == 3


def test_a_429_is_never_a_ladder_failure_even_when_the_gate_was_open(book, stripe_proxy):
    tenant = book.tenant()
    sub = book.subscribed(tenant)
    stripe_proxy.fail_next("429", match="POST /v1/payment_intents", retry_after_s=None)

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)

    sub.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice__subscription=sub)
    assert (attempt.outcome, attempt.http_status) == ("error", 429)
    assert (sub.billing_failure_count, sub.next_billing_attempt_at) == (0, None)
    assert run.failed == 0
    # No Retry-After: the first backoff is the base, BACKOFF_BASE_S.
    assert 0 < gw.backoff_remaining(gw.get_gateway().account) <= gw.BACKOFF_BASE_S


def test_a_dunning_retry_that_meets_a_429_waits_for_the_gate_without_an_error_or_a_retry_used(
    book, stripe_proxy, monkeypatch
):
    from datetime import timedelta

    from billing.services.dunning_pass import process_due
    from dunning.models import DunningRun

    declined = decline(book, book.tenant())
    stripe_proxy.fail_next("429", match="/confirm", retry_after_s=RETRY_AFTER_S)

    assert process_due(livemode=False, as_of=declined.at + DAY) == 1

    run = DunningRun.objects.get(pk=declined.run.pk)
    wait = run.next_attempt_at - (declined.at + DAY)
    assert timedelta(seconds=RETRY_AFTER_S - 5) < wait <= timedelta(seconds=RETRY_AFTER_S)
    assert run.last_error == ""
    now = gw._clock()
    monkeypatch.setattr(gw, "_clock", lambda: now + RETRY_AFTER_S + 1)
    assert process_due(livemode=False, as_of=run.next_attempt_at) == 1

    run.refresh_from_db()
    keys = [e.request.idempotency_key for e in stripe_proxy.entries("/confirm")]
    assert keys == [f"hc:{declined.invoice.id}:attempt:2"] * 2  # the same request, re-sent
    assert (run.retries_done, run.next_attempt_at) == (1, declined.at + 3 * DAY)  # the decline used the one retry


@pytest.mark.parametrize(
    ("headers", "streak", "delay"),
    [
        ({"Retry-After": "7"}, 1, 7.0),
        ({"retry-after": "7"}, 5, 7.0),  # a Retry-After wins over the streak
        ({"Retry-After": "3600"}, 1, gw.BACKOFF_MAX_S),
        ({"Stripe-Should-Retry": "false"}, 1, gw.BACKOFF_MAX_S),
        ({}, 1, gw.BACKOFF_BASE_S),
        ({}, 3, 4 * gw.BACKOFF_BASE_S),
        ({}, 30, gw.BACKOFF_MAX_S),
        ({"Retry-After": "soon"}, 2, 2 * gw.BACKOFF_BASE_S),
    ],
)
def test_backoff_delay_honours_retry_after_and_should_retry(headers, streak, delay):
    assert gw.backoff_delay(headers, streak) == delay
