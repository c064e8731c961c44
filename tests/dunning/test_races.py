"""Dunning loops racing: a due run is confirmed once, whoever claims it (threads with their own connections).

In production one replica holds the ``dunning`` lease, but a deposed leader, a second replica
mid-takeover and a test clock's advance can all run a pass at once; the claim
(``FOR UPDATE SKIP LOCKED``, recording the retry and pushing ``next_attempt_at`` past the claim
window in the same transaction) is what keeps them from confirming the same invoice twice.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connection, transaction

from billing.models import Invoice, PaymentAttempt
from billing.services import dunning_pass
from billing.services.dunning_pass import process_due
from dunning import queries
from dunning.models import DunningRun
from dunning.services import ClaimAction
from tests.dunning.conftest import DAY, confirms


def _in_thread(name: str, fn, results: dict, errors: list) -> threading.Thread:
    def run():
        try:
            results[name] = fn()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def _declined_invoices(book, tenant, n: int):
    subs = [book.subscribed(tenant, card="4000000000000341") for _ in range(n)]
    from billing.services.drain import drain_due

    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoices = list(Invoice.objects.filter(subscription__in=subs))
    assert len(invoices) == n and DunningRun.objects.filter(status="active").count() == n
    due = max(DunningRun.objects.values_list("first_declined_at", flat=True)) + DAY
    return invoices, due


def _confirms_per_invoice(stripe_proxy) -> Counter:
    by_intent = Counter(e.request.line for e in confirms(stripe_proxy))
    intents = {f"POST /v1/payment_intents/{inv.payment_intent_id}/confirm": inv.id for inv in Invoice.objects.all()}
    return Counter({intents[line]: count for line, count in by_intent.items()})


def test_two_loops_racing_confirm_each_due_invoice_exactly_once(book, tenant, stripe_proxy):
    invoices, due = _declined_invoices(book, tenant, 8)
    stripe_proxy.fail_next("delay", match="/confirm", times=8, delay_s=0.2)  # widen every window
    start = threading.Barrier(2)
    results, errors = {}, []

    def loop():
        start.wait()
        return process_due(livemode=False, as_of=due)

    threads = [_in_thread(f"loop-{i}", loop, results, errors) for i in range(2)]
    for thread in threads:
        thread.join(60)

    assert errors == [] and not any(t.is_alive() for t in threads)
    assert sum(results.values()) == 8
    assert _confirms_per_invoice(stripe_proxy) == Counter({inv.id: 1 for inv in invoices})
    for invoice in invoices:
        assert PaymentAttempt.objects.filter(invoice=invoice).count() == 2
    for run in DunningRun.objects.all():
        assert (run.retries_done, run.next_attempt_at) == (1, run.first_declined_at + 3 * DAY)


def _stale_claim_race(book, tenant, stripe_proxy):
    """Loop B claims right after loop A's claim committed, but charges only once A has finished."""
    invoices, due = _declined_invoices(book, tenant, 3)
    a_claimed, a_done = threading.Event(), threading.Event()
    results, errors = {}, []

    def after_claim(run_ids):
        name = threading.current_thread().name
        if name == "loop-a":
            a_claimed.set()
        elif name == "loop-b" and not a_done.is_set():
            assert a_done.wait(60)

    def loop_a():
        try:
            return process_due(livemode=False, as_of=due)
        finally:
            a_done.set()

    def loop_b():
        assert a_claimed.wait(60)
        return process_due(livemode=False, as_of=due)

    dunning_pass.hooks.after_claim = after_claim
    try:
        threads = [_in_thread("loop-a", loop_a, results, errors), _in_thread("loop-b", loop_b, results, errors)]
        for thread in threads:
            thread.join(60)
    finally:
        dunning_pass.hooks.after_claim = None
    assert errors == []
    return invoices, results


def test_a_loop_that_claims_after_another_loops_claim_finds_nothing_to_confirm(book, tenant, stripe_proxy):
    invoices, results = _stale_claim_race(book, tenant, stripe_proxy)

    assert results == {"loop-a": 3, "loop-b": 0}
    assert _confirms_per_invoice(stripe_proxy) == Counter({inv.id: 1 for inv in invoices})


def test_negative_control_without_the_claim_both_loops_confirm_every_invoice(book, tenant, stripe_proxy, monkeypatch):
    """Proof that the test above can fail: a claim that neither locks nor records lets B confirm again."""

    def decide_without_recording(run, now):
        return ClaimAction.RETRY if run.retries_done < len(run.retry_days) else ClaimAction.SETTLE

    monkeypatch.setattr(dunning_pass, "_decide_locked", decide_without_recording)
    monkeypatch.setattr(queries, "CLAIM_DUE_RUNS", queries.CLAIM_DUE_RUNS.replace("FOR UPDATE SKIP LOCKED", ""))

    invoices, results = _stale_claim_race(book, tenant, stripe_proxy)

    assert results == {"loop-a": 3, "loop-b": 3}
    assert _confirms_per_invoice(stripe_proxy) == Counter({inv.id: 2 for inv in invoices})


def test_a_run_locked_by_another_loop_is_skipped_not_waited_for(book, tenant, stripe_proxy):
    invoices, due = _declined_invoices(book, tenant, 2)
    results, errors = {}, []
    with transaction.atomic():
        locked = list(DunningRun.objects.select_for_update().filter(invoice=invoices[0]))
        thread = _in_thread("other-loop", lambda: process_due(livemode=False, as_of=due), results, errors)
        thread.join(30)
        assert not thread.is_alive(), "the pass waited for the locked run"
    assert errors == [] and results == {"other-loop": 1} and len(locked) == 1
    assert list(_confirms_per_invoice(stripe_proxy)) == [invoices[1].id]

    assert process_due(livemode=False, as_of=due) == 1  # its turn comes once the lock is gone
    assert _confirms_per_invoice(stripe_proxy) == Counter({invoices[0].id: 1, invoices[1].id: 1})


@pytest.mark.parametrize("alive", [False, True])
def test_a_pass_under_a_lost_lease_writes_nothing(book, tenant, stripe_proxy, alive):
    from hardcount.fencing import LeaseLost

    _invoices, due = _declined_invoices(book, tenant, 1)

    class Deposed:
        """A fence whose lease is gone: either noticed at the safe point, or refused by the database."""

        token = 7

        def alive(self):
            return alive

        def check(self):
            raise LeaseLost("deposed")

    before = list(DunningRun.objects.values())
    with pytest.raises(LeaseLost):
        process_due(livemode=False, as_of=due, fence=Deposed())

    assert list(DunningRun.objects.values()) == before
    assert confirms(stripe_proxy) == []


def test_a_run_whose_retry_raises_does_not_stop_the_others_and_is_resumed_later(
    book, tenant, stripe_proxy, monkeypatch
):
    from billing.services import collection

    invoices, due = _declined_invoices(book, tenant, 2)
    real = collection.retry_invoice_payment

    def flaky(invoice_id, **kwargs):
        if invoice_id == invoices[0].id:
            raise RuntimeError("a bug in one run")
        return real(invoice_id, **kwargs)

    monkeypatch.setattr(collection, "retry_invoice_payment", flaky)
    assert process_due(livemode=False, as_of=due) == 2
    assert list(_confirms_per_invoice(stripe_proxy)) == [invoices[1].id]

    monkeypatch.setattr(collection, "retry_invoice_payment", real)
    assert process_due(livemode=False, as_of=due + dunning_pass.claim_window()) == 1
    assert _confirms_per_invoice(stripe_proxy) == Counter({inv.id: 1 for inv in invoices})
    assert DunningRun.objects.get(invoice=invoices[0]).retries_done == 1  # the same retry, resumed
