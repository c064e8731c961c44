"""Subscription item changes in real processes (tests/system/change_once.py), real PostgreSQL, the strict dev Stripe.

1. A quantity change 3 → 5 with ``always_invoice`` SIGKILLed after its invoice committed (before the charge),
   and after the gateway answered the charge (before the answer was recorded): the reconciler finishes it,
   the invoice is paid once by one PaymentIntent, and a retry of the change makes no second proration invoice.
   The same change as a request under an ``Idempotency-Key``, SIGKILLed after its commit: its retry under the key
   (409 while the dead claim is fresh) charges that invoice once and changes nothing again.
2. A drain process billing a due book while another process changes the same subscriptions' items
   (``create_prorations`` and ``always_invoice``, in the opposite order, so they meet): no period billed twice,
   every proration line on exactly one invoice or still pending, each period billed at the quantity the change
   left it (a period billed at 3 has its prorations, one billed at 5 none), the doctor clean.
3. A ``billing_cycle_anchor=now`` restart (3 → 5 seats) SIGKILLed after its commit (the new period's invoice a
   draft, due) and after its close's charge reached the gateway (nothing recorded): a runscheduler's billing tick
   finishes it, the new period is invoiced once and paid by one PaymentIntent, the doctor clean.

Each experiment records its row of the failure-correctness report (``make correctness``,
docs/benchmarks/failure-correctness.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta

import pytest
from dateutil.relativedelta import relativedelta
from django.db import transaction

from billing.models import (
    BillingRun,
    Invoice,
    InvoiceItem,
    InvoiceLineItem,
    PaymentAttempt,
    Subscription,
    SubscriptionItem,
)
from billing.services.drain import drain_due, reconcile
from tests.billing.conftest import STRIPE_KEY, VISA, Book
from tests.system.correctness import (
    ReportRow,
    age_unknown_attempts,
    billing_env,
    doctor_violations,
    gateway_charges,
    gateway_requests,
    record_row,
    wait_until,
)
from tests.system.harness import BASE_DIR, SchedulerProcess, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    # The stripe library hands httpx bytes as data= (tests/billing/conftest.py ignores it there too).
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _env(stripe_proxy) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url(),
        "STRIPE_API_BASE": stripe_proxy.api_base,
        "STRIPE_API_KEY": STRIPE_KEY,
        "HARDCOUNT_GATEWAY_TIMEOUT_S": "2",
        "HARDCOUNT_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }


def _start(command: list[str], stripe_proxy, log) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", *command],
        cwd=BASE_DIR,
        env=_env(stripe_proxy),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    line = process.stdout.readline().strip()
    assert line == "ready", f"{command[0]} did not start: {line!r}\n{log.seek(0) or log.read()}"
    return process


def _change_command(
    tenant_id: str, subs, behaviors: list[str], *, kill_at: str | None = None, restart: bool = False
) -> list[str]:
    command = ["tests.system.change_once", "--tenant", tenant_id, "--quantity", "5"]
    for sub in subs:
        command += ["--subscription", sub.id]
    for behavior in behaviors:
        command += ["--behavior", behavior]
    if restart:
        command += ["--billing-cycle-anchor", "now"]
    return command + (["--kill-at", kill_at] if kill_at else [])


def _billed_book(make_card, count: int, *, name: str, quantity: int = 3):
    """A tenant with ``count`` monthly subscriptions of ``quantity`` × 10.00 usd, their first period billed and paid."""
    book = Book(make_card)
    with transaction.atomic():
        tenant = book.tenant(name)
        subs = []
        for i in range(count):
            customer = book.customer(tenant, card=VISA)
            price = book.price(tenant, amount=1000)
            subs.append(book.subscription(customer, price, quantity=quantity, anchor=_hour_ago(count - i)))
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    assert Counter(Invoice.objects.filter(tenant=tenant).values_list("status", flat=True)) == {"paid": count}
    return tenant, subs


def _hour_ago(seconds: int):
    from hardcount.times import database_now

    return database_now() - timedelta(hours=1, seconds=seconds)


def assert_doctor_clean() -> None:
    """``python manage.py doctor`` (every tenant's money invariants) exits 0, in a process of its own."""
    assert doctor_violations() == {}
    done = subprocess.run(
        [sys.executable, "manage.py", "doctor"],
        check=False,
        cwd=BASE_DIR,
        env=_env_plain(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _env_plain() -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url(), "HARDCOUNT_LOG_LEVEL": "WARNING"}


def _update_invoices(sub) -> list[Invoice]:
    return list(Invoice.objects.filter(subscription=sub, billing_reason=Invoice.UPDATE).exclude(status=Invoice.VOID))


# --- 1. always_invoice killed mid-way -------------------------------------------------------------------------------


@pytest.mark.parametrize("kill_at", ["after_invoice_commit", "after_charge"])
def test_an_always_invoice_change_killed_mid_way_is_charged_once_by_the_reconciler(
    transactional_db, stripe_proxy, make_card, tmp_path, kill_at
):
    started = time.monotonic()
    tenant, (sub,) = _billed_book(make_card, 1, name=f"Killed {kill_at}")
    with open(tmp_path / "change.log", "w+") as log:
        process = _start(_change_command(tenant.id, [sub], ["always_invoice"], kill_at=kill_at), stripe_proxy, log)
        out, _ = process.communicate("go\n", timeout=60)
        assert process.returncode == -signal.SIGKILL, f"the change was not killed:\n{out}\n{log.seek(0) or log.read()}"
    assert f"point={kill_at}" in out

    # The state the kill left: the change and its invoice committed; the charge not made, or not recorded.
    assert SubscriptionItem.objects.get(subscription=sub).quantity == 5
    (invoice,) = _update_invoices(sub)
    assert invoice.status == Invoice.OPEN and invoice.amount_due > 0
    attempts = [a.outcome for a in PaymentAttempt.objects.filter(invoice=invoice)]
    sent = [e.action for e in gateway_requests(stripe_proxy, invoice.id)]
    if kill_at == "after_invoice_commit":
        assert (attempts, sent) == ([], [])
    else:
        assert (attempts, sent) == (["unknown"], ["forwarded"])
        assert len(gateway_charges(stripe_proxy)[invoice.id]) == 1

    # The dead process's window passes (its attempt, or its invoice waiting for its first charge: aged by
    # updating the rows, not waited out), then a runscheduler's billing tick reconciles.
    age_unknown_attempts(tenant.id)
    Invoice.objects.filter(pk=invoice.pk).update(created_at=invoice.created_at - timedelta(minutes=5))
    scheduler = SchedulerProcess("billing", billing_env(stripe_proxy))
    try:
        scheduler.wait_for("lease_acquired", role="billing", timeout_s=30)
        wait_until(
            lambda: Invoice.objects.get(pk=invoice.pk).status == Invoice.PAID, timeout_s=30, what="the reconciler"
        )
    finally:
        assert scheduler.stop() == 0, scheduler.log()

    invoice.refresh_from_db()
    (attempt,) = PaymentAttempt.objects.filter(invoice=invoice)
    assert attempt.outcome == PaymentAttempt.SUCCEEDED
    assert gateway_charges(stripe_proxy)[invoice.id] == {invoice.payment_intent_id}
    calls = gateway_requests(stripe_proxy, invoice.id)
    assert {e.request.idempotency_key for e in calls} == {attempt.idempotency_key}
    expected = ["forwarded"] if kill_at == "after_invoice_commit" else ["forwarded", "replayed"]
    assert [e.action for e in calls] == expected

    # The proration lines are on that invoice, once; a retry of the change finds nothing left to change.
    items = list(InvoiceItem.objects.filter(subscription=sub, proration=True))
    assert len(items) == 2 and {i.invoice_id for i in items} == {invoice.id}
    with open(tmp_path / "retry.log", "w+") as log:
        retry = _start(_change_command(tenant.id, [sub], ["always_invoice"]), stripe_proxy, log)
        out, _ = retry.communicate("go\n", timeout=60)
        assert retry.returncode == 0, log.seek(0) or log.read()
    assert json.loads(out.strip().splitlines()[-1])["invoices"] == []
    assert _update_invoices(sub) == [invoice]
    assert InvoiceItem.objects.filter(subscription=sub, proration=True).count() == 2
    assert reconcile(livemode=False)["payments_resolved"] == 0
    assert_doctor_clean()
    record_row(
        ReportRow(
            f"always_invoice change (3 → 5 seats) SIGKILLed {kill_at.replace('_', ' ')}, reconciler finishes",
            runs=1,
            kill_points=kill_at,
            invoices=Invoice.objects.filter(tenant=tenant).count(),
            duplicates=len(_update_invoices(sub)) - 1,
            lost=0,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"one PaymentIntent ({', '.join(expected)} under one key); 2 proration lines on it once; "
            "a retried change made no second invoice",
        )
    )


def test_a_keyed_always_invoice_request_killed_before_its_charge_is_finished_by_its_retry(
    transactional_db, stripe_proxy, make_card, tmp_path
):
    """The request itself (``POST /v1/subscriptions/{id}`` with an ``Idempotency-Key``, through the API stack) is
    SIGKILLed after the change committed, before the charge: its key's claim is left in flight. The retry under the
    same key is 409 while the claim is fresh; once stale it finishes the first run (docs/decisions/0196): the one
    invoice charged once, nothing changed again. A run without the lookup leaves the invoice open (its retry
    re-plans a change already made and prorates nothing)."""
    from hardcount.idempotency import IN_FLIGHT_STALE
    from hardcount.models import ApiKey, IdempotencyRecord
    from outbox.models import Event
    from tests.api.conftest import Api

    started = time.monotonic()
    tenant, (sub,) = _billed_book(make_card, 1, name="Keyed request killed")
    _row, secret = ApiKey.issue(tenant, livemode=False)
    keyed = ["--api-key", secret, "--idempotency-key", "seats-5"]
    with open(tmp_path / "change.log", "w+") as log:
        command = _change_command(tenant.id, [sub], ["always_invoice"], kill_at="after_invoice_commit") + keyed
        process = _start(command, stripe_proxy, log)
        out, _ = process.communicate("go\n", timeout=60)
        assert process.returncode == -signal.SIGKILL, f"the request was not killed:\n{out}\n{log.seek(0) or log.read()}"

    (invoice,) = _update_invoices(sub)
    # Two seats more for all but about an hour of the month: a credit of −3,000 × share and +5,000 × share.
    assert (invoice.status, invoice.payment_attempts.count()) == (Invoice.OPEN, 0) and 1990 < invoice.total < 2000
    (claim,) = IdempotencyRecord.objects.filter(tenant=tenant, key="seats-5")
    assert claim.completed_at is None  # the dead request's claim, in flight
    updated = Event.objects.filter(type="subscription.updated").count()
    api = Api(secret)
    body = {"items": [{"id": SubscriptionItem.objects.get(subscription=sub).id, "quantity": 5}]}
    body["proration_behavior"] = "always_invoice"
    status, error = api.post(f"/v1/subscriptions/{sub.id}", body, headers={"Idempotency-Key": "seats-5"})
    assert (status, error["error"]["code"]) == (409, "idempotency_key_in_use")

    IdempotencyRecord.objects.filter(pk=claim.pk).update(created_at=claim.created_at - IN_FLIGHT_STALE - timedelta(1))
    with open(tmp_path / "retry.log", "w+") as log:
        retry = _start(_change_command(tenant.id, [sub], ["always_invoice"]) + keyed, stripe_proxy, log)
        out, _ = retry.communicate("go\n", timeout=60)
        assert retry.returncode == 0, log.seek(0) or log.read()
    (answer,) = json.loads(out.strip().splitlines()[-1])["responses"]

    assert answer["status"] == 200, answer
    assert [i["quantity"] for i in answer["body"]["items"]["data"]] == [5]
    assert _update_invoices(sub) == [invoice]
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_paid) == (Invoice.PAID, invoice.total)
    (attempt,) = PaymentAttempt.objects.filter(invoice=invoice)
    assert attempt.outcome == PaymentAttempt.SUCCEEDED
    assert gateway_charges(stripe_proxy)[invoice.id] == {invoice.payment_intent_id}
    assert [e.action for e in gateway_requests(stripe_proxy, invoice.id)] == ["forwarded"]
    assert InvoiceItem.objects.filter(subscription=sub, proration=True).count() == 2
    assert Event.objects.filter(type="subscription.updated").count() == updated
    # Stored now: the key replays the answer; the reconciler finds nothing to charge.
    replay = api.post(f"/v1/subscriptions/{sub.id}", body, headers={"Idempotency-Key": "seats-5"})
    assert replay == (200, answer["body"])
    assert reconcile(livemode=False)["payments_resolved"] == 0
    assert_doctor_clean()
    record_row(
        ReportRow(
            "keyed always_invoice request (3 → 5 seats) SIGKILLed after its invoice commit, retried under its key",
            runs=1,
            kill_points="after_invoice_commit",
            invoices=Invoice.objects.filter(tenant=tenant).count(),
            duplicates=len(_update_invoices(sub)) - 1,
            lost=0,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note="409 while the dead claim was fresh; the retry charged the first run's invoice (one PaymentIntent), "
            "changed nothing again; the key then replays",
        )
    )


# --- 2. changes racing the drain ------------------------------------------------------------------------------------

RACE_SIZE = 16


def _make_second_period_due(tenant) -> None:
    """Move every subscription of ``tenant`` (its first period billed) one month back: period 2 is due now.

    The anchor, the next billing time and the first invoice's period move together, so the book is
    what it would be had it been created a month earlier.
    """
    month = relativedelta(months=1)
    for sub in Subscription.objects.filter(tenant=tenant):
        Subscription.objects.filter(pk=sub.pk).update(
            billing_cycle_anchor=sub.billing_cycle_anchor - month, next_billing_at=sub.next_billing_at - month
        )
        for invoice in Invoice.objects.filter(subscription=sub):
            Invoice.objects.filter(pk=invoice.pk).update(
                period_start=invoice.period_start - month, period_end=invoice.period_end - month
            )
        InvoiceLineItem.objects.filter(invoice__subscription=sub).update(
            period_start=sub.billing_cycle_anchor - month, period_end=sub.billing_cycle_anchor
        )


def test_item_changes_racing_a_drain_process_lose_and_double_no_proration(
    transactional_db, stripe_proxy, make_card, tmp_path
):
    started = time.monotonic()
    tenant, subs = _billed_book(make_card, RACE_SIZE, name="Changes racing the drain")
    _make_second_period_due(tenant)
    behaviors = ["create_prorations", "always_invoice"]
    # The drain takes the book in anchor order; the changes go the other way, so the two meet mid-book.
    with open(tmp_path / "drain.log", "w+") as drain_log, open(tmp_path / "change.log", "w+") as change_log:
        drain = _start(["tests.system.drain_once", "--tenant", tenant.id, "--page-size", "1"], stripe_proxy, drain_log)
        change = _start(_change_command(tenant.id, list(reversed(subs)), behaviors), stripe_proxy, change_log)
        for process in (drain, change):
            process.stdin.write("go\n")
            process.stdin.flush()
        drained, _ = drain.communicate(timeout=120)
        changed, _ = change.communicate(timeout=120)
        assert drain.returncode == 0, drain_log.seek(0) or drain_log.read()
        assert change.returncode == 0, change_log.seek(0) or change_log.read()
    drained = json.loads(drained.strip().splitlines()[-1])
    changed = json.loads(changed.strip().splitlines()[-1])
    assert changed["errors"] == [] and len(changed["changed"]) == RACE_SIZE, changed
    assert drained["billed"] + drained["skipped"] >= 1, drained
    # A close that found its subscription locked by a change skipped it (it is being changed elsewhere, and
    # the run does not come back to it): the next tick bills it, as this drain does. Nothing may be billed
    # twice or lost either way.
    catch_up = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    assert catch_up.billed <= drained["skipped"], (catch_up.billed, drained)

    behavior_of = {sub.id: behaviors[i % 2] for i, sub in enumerate(reversed(subs))}
    charges = gateway_charges(stripe_proxy)
    cycle = Counter(
        Invoice.objects.filter(tenant=tenant, billing_reason=Invoice.CYCLE)
        .exclude(status=Invoice.VOID)
        .values_list("subscription_id", "period_start")
    )
    assert max(cycle.values()) == 1, "a period was billed twice"
    orders = Counter()
    for sub in Subscription.objects.filter(tenant=tenant).select_related("price"):
        assert sub.periods_billed == 2, f"{sub.id}: period 2 not billed ({sub.periods_billed})"
        second = Invoice.objects.get(
            subscription=sub,
            billing_reason=Invoice.CYCLE,
            period_start=sub.billing_cycle_anchor + relativedelta(months=1),
        )
        assert second.status == Invoice.PAID and len(charges[second.id]) == 1
        billed_quantity = second.lines.get(invoice_item__isnull=True).quantity
        prorations = list(InvoiceItem.objects.filter(subscription=sub, proration=True))
        updates = _update_invoices(sub)
        if billed_quantity == 5:  # the change came first: period 2 billed whole at 5, nothing to prorate
            orders["change first"] += 1
            assert (prorations, updates) == ([], []), f"{sub.id}: prorated a period not yet invoiced"
            continue
        orders["drain first"] += 1
        assert billed_quantity == 3
        assert sorted(i.amount < 0 for i in prorations) == [False, True], f"{sub.id}: {prorations}"
        on_lines = Counter(
            InvoiceLineItem.objects.filter(invoice_item__in=prorations).values_list("invoice_item_id", flat=True)
        )
        if behavior_of[sub.id] == "always_invoice":
            (update,) = updates
            assert update.status == Invoice.PAID and len(charges[update.id]) == 1
            assert {i.invoice_id for i in prorations} == {update.id}
            assert on_lines == {i.id: 1 for i in prorations}
        else:  # pending for the next cycle invoice (period 3, not due yet)
            assert updates == [] and {i.invoice_id for i in prorations} == {None}
            assert on_lines == {}
    assert orders["change first"] and orders["drain first"], f"the race did not happen: {dict(orders)}"
    assert_doctor_clean()
    record_row(
        ReportRow(
            "item changes racing a drain process (create_prorations / always_invoice), page size 1",
            runs=RACE_SIZE,
            kill_points="-",
            invoices=Invoice.objects.filter(tenant=tenant).count(),
            duplicates=sum(n - 1 for n in cycle.values()),
            lost=0,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"{orders['change first']} changed before their close (billed whole at 5, no proration), "
            f"{orders['drain first']} after (billed at 3, prorated once); the drain billed {drained['billed']}, "
            f"skipped {drained['skipped']} (billed by the next drain: {catch_up.billed})",
        )
    )


# --- 3. a restarted billing cycle killed mid-way --------------------------------------------------------------------


@pytest.mark.parametrize("kill_at", ["after_restart_commit", "after_restart_charge"])
def test_a_restarted_billing_cycle_killed_mid_way_is_charged_once_by_the_next_tick(
    transactional_db, stripe_proxy, make_card, tmp_path, kill_at
):
    started = time.monotonic()
    tenant, (sub,) = _billed_book(make_card, 1, name=f"Restart killed {kill_at}")
    (first,) = Invoice.objects.filter(subscription=sub)
    with open(tmp_path / "change.log", "w+") as log:
        command = _change_command(tenant.id, [sub], ["create_prorations"], kill_at=kill_at, restart=True)
        process = _start(command, stripe_proxy, log)
        out, _ = process.communicate("go\n", timeout=60)
        assert process.returncode == -signal.SIGKILL, f"the change was not killed:\n{out}\n{log.seek(0) or log.read()}"
    assert f"point={kill_at}" in out

    # What the kill left: the restart committed (5 seats, the credit swept onto the new period's invoice, the
    # anchor at the restart, the period due); its charge not made, or made and not recorded.
    sub.refresh_from_db()
    at = sub.billing_cycle_anchor
    assert first.period_start < at < first.period_end and (sub.next_billing_at, sub.periods_billed) == (at, 0)
    assert SubscriptionItem.objects.get(subscription=sub).quantity == 5
    (restarted,) = Invoice.objects.filter(subscription=sub, period_start=at)
    (credit,) = InvoiceItem.objects.filter(subscription=sub)
    assert credit.invoice_id == restarted.id and restarted.total == 5000 + credit.amount
    attempts = [a.outcome for a in PaymentAttempt.objects.filter(invoice=restarted)]
    sent = [e.action for e in gateway_requests(stripe_proxy, restarted.id)]
    if kill_at == "after_restart_commit":
        assert (restarted.status, attempts, sent) == (Invoice.DRAFT, [], [])
    else:
        assert (restarted.status, attempts, sent) == (Invoice.OPEN, ["unknown"], ["forwarded"])

    age_unknown_attempts(tenant.id)
    scheduler = SchedulerProcess("billing", billing_env(stripe_proxy))
    try:
        scheduler.wait_for("lease_acquired", role="billing", timeout_s=30)
        # Paid, and the tick's run over (a stop in the middle of a run would leave it for the next holder to end).
        wait_until(
            lambda: (
                Invoice.objects.get(pk=restarted.pk).status == Invoice.PAID
                and not BillingRun.objects.filter(status=BillingRun.RUNNING).exists()
            ),
            timeout_s=30,
            what="the next tick",
        )
    finally:
        assert scheduler.stop() == 0, scheduler.log()

    restarted.refresh_from_db()
    (attempt,) = PaymentAttempt.objects.filter(invoice=restarted)
    assert (attempt.outcome, restarted.amount_paid) == (PaymentAttempt.SUCCEEDED, restarted.amount_due)
    assert gateway_charges(stripe_proxy)[restarted.id] == {restarted.payment_intent_id}
    calls = gateway_requests(stripe_proxy, restarted.id)
    assert {e.request.idempotency_key for e in calls} == {attempt.idempotency_key}
    expected = ["forwarded"] if kill_at == "after_restart_commit" else ["forwarded", "replayed"]
    assert [e.action for e in calls] == expected
    sub.refresh_from_db()
    assert (sub.next_billing_at, sub.periods_billed) == (at + relativedelta(months=1), 1)
    cycle = Counter(Invoice.objects.filter(subscription=sub).exclude(status=Invoice.VOID).values_list("period_start"))
    assert max(cycle.values()) == 1 and len(cycle) == 2
    assert_doctor_clean()
    point = kill_at.removeprefix("after_restart_")
    record_row(
        ReportRow(
            f"billing_cycle_anchor=now restart SIGKILLed after its {point}, next tick finishes",
            runs=1,
            kill_points=kill_at,
            invoices=Invoice.objects.filter(tenant=tenant).count(),
            duplicates=sum(n - 1 for n in cycle.values()),
            lost=0,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"new period invoiced once ({restarted.total} = 5000 − {-credit.amount} credit), one PaymentIntent "
            f"({', '.join(expected)} under one key)",
        )
    )
