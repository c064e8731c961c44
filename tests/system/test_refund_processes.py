"""A credit note's refund killed mid-way in a real process (tests/system/refund_once.py), real PostgreSQL, the strict
dev Stripe: SIGKILL after the refund row committed (before the gateway call) and after the gateway answered (before
the answer was recorded). The recovery path is the billing reconciler (docs/decisions/0157-refunds.md): a
``runscheduler`` billing replica re-sends the refund under its one key; the card is refunded exactly once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from billing.models import CreditNote, Invoice, Refund
from billing.services.drain import drain_due
from tests.billing.conftest import VISA
from tests.system.correctness import billing_env, wait_until
from tests.system.harness import BASE_DIR, SchedulerProcess
from tests.system.test_change_processes import _env, assert_doctor_clean

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _paid_invoice(book, name: str) -> Invoice:
    tenant = book.tenant(name)
    sub = book.subscribed(tenant, card=VISA, amount=1000)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == Invoice.PAID
    return invoice


@pytest.mark.parametrize("kill_at", ["after_refund_row", "after_refund_sent"])
def test_a_refund_killed_mid_way_is_sent_once_by_the_reconciler(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path, kill_at
):
    from tests.billing.conftest import Book

    invoice = _paid_invoice(Book(make_card), f"Refund killed {kill_at}")
    command = [
        sys.executable,
        "-m",
        "tests.system.refund_once",
        "--tenant",
        invoice.tenant_id,
        "--invoice",
        invoice.id,
        "--amount",
        "300",
        "--kill-at",
        kill_at,
    ]
    with open(tmp_path / "refund.log", "w+") as log:
        process = subprocess.Popen(
            command,
            cwd=BASE_DIR,
            env=_env(stripe_proxy),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert process.stdout.readline().strip() == "ready", log.seek(0) or log.read()
        out, _ = process.communicate("go\n", timeout=60)
        assert process.returncode == -signal.SIGKILL, f"not killed:\n{out}\n{log.seek(0) or log.read()}"
    assert f"point={kill_at}" in out

    # What the kill left: the credit note and its refund row committed, the outcome unknown.
    (note,) = CreditNote.objects.filter(invoice=invoice)
    refund = Refund.objects.get(credit_note=note)
    assert (note.status, note.refund_amount, refund.outcome) == ("issued", 300, Refund.UNKNOWN)
    sent = [e.action for e in stripe_proxy.entries("POST /v1/refunds")]
    gateway = list(stripe_client.v1.refunds.list(params={"payment_intent": invoice.payment_intent_id}).data)
    assert (sent, len(gateway)) == (([], 0) if kill_at == "after_refund_row" else (["forwarded"], 1))

    # The dead sender's window passes (aged by updating the row, not waited out); a billing replica reconciles.
    Refund.objects.filter(pk=refund.pk).update(started_at=refund.started_at - timedelta(minutes=5))
    scheduler = SchedulerProcess("billing", billing_env(stripe_proxy))
    try:
        scheduler.wait_for("lease_acquired", role="billing", timeout_s=30)
        wait_until(
            lambda: Refund.objects.get(pk=refund.pk).outcome == Refund.SUCCEEDED, timeout_s=30, what="the reconciler"
        )
    finally:
        assert scheduler.stop() == 0, scheduler.log()

    gateway = list(stripe_client.v1.refunds.list(params={"payment_intent": invoice.payment_intent_id}).data)
    assert [(r.amount, r.status, r.metadata["hardcount_refund"]) for r in gateway] == [(300, "succeeded", refund.id)]
    calls = stripe_proxy.entries("POST /v1/refunds")
    assert {e.request.idempotency_key for e in calls} == {f"hc:{note.id}:refund"}
    assert [e.action for e in calls] == (["forwarded"] if kill_at == "after_refund_row" else ["forwarded", "replayed"])
    assert Refund.objects.get(pk=refund.pk).gateway_refund_id == gateway[0].id
    assert_doctor_clean()
