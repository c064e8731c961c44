"""A credit note's refund killed mid-way in a real process (tests/system/refund_once.py), real PostgreSQL, the strict
dev Stripe: SIGKILL after the refund row committed (before the gateway call) and after the gateway answered (before
the answer was recorded). The recovery path is the billing reconciler (docs/decisions/0157-refunds.md): a
``runscheduler`` billing replica re-sends the refund under its one key; the card is refunded exactly once.

Killed while serving ``POST /v1/credit_notes`` with an ``Idempotency-Key``, then retried by its client once the
dead request's claim on the key is stale: the retry answers the credit note the dead request issued, finishing
its refund under the refund's one key, and issues nothing new (docs/decisions/0212).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from django.db import IntegrityError

from billing.models import CreditNote, Invoice, Refund
from billing.services import credit_notes
from billing.services.drain import drain_due
from hardcount.models import IdempotencyRecord
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import VISA
from tests.system.correctness import billing_env, wait_until
from tests.system.harness import BASE_DIR, SchedulerProcess
from tests.system.test_change_processes import _env, assert_doctor_clean

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _paid_invoice(book, name: str, tenant=None) -> Invoice:
    tenant = tenant or book.tenant(name)
    sub = book.subscribed(tenant, card=VISA, amount=1000)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert invoice.status == Invoice.PAID
    return invoice


def _killed(invoice: Invoice, stripe_proxy, kill_at: str, tmp_path, *, api: tuple[str, str] | None = None) -> None:
    """Run tests/system/refund_once.py for 300 on ``invoice`` (through the API with ``api`` = (key, Idempotency-Key))
    until its SIGKILL at ``kill_at``."""
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
    if api is not None:
        command += ["--api-key", api[0], "--idempotency-key", api[1]]
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


@pytest.mark.parametrize("kill_at", ["after_refund_row", "after_refund_sent"])
def test_a_refund_killed_mid_way_is_sent_once_by_the_reconciler(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path, kill_at
):
    from tests.billing.conftest import Book

    invoice = _paid_invoice(Book(make_card), f"Refund killed {kill_at}")
    _killed(invoice, stripe_proxy, kill_at, tmp_path)

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


def _retried_after_the_kill(make_card, stripe_proxy, tmp_path):
    """A credit note served by a process SIGKILLed after the gateway ran its refund; the dead request's claim on its
    Idempotency-Key and its refund then aged past their windows (rows updated, not waited out)."""
    from tests.billing.conftest import Book

    keys = make_keys("Refund retried")
    invoice = _paid_invoice(Book(make_card), "", tenant=keys.tenant)
    _killed(invoice, stripe_proxy, "after_refund_sent", tmp_path, api=(keys.test, "refund-cn-1"))
    (record,) = IdempotencyRecord.objects.filter(key="refund-cn-1")
    assert record.completed_at is None  # the dead request never answered
    IdempotencyRecord.objects.filter(pk=record.pk).update(created_at=record.created_at - timedelta(minutes=6))
    refund = Refund.objects.get(invoice=invoice)
    Refund.objects.filter(pk=refund.pk).update(started_at=refund.started_at - timedelta(minutes=5))
    return Api(keys.test), {"invoice": invoice.id, "amount": 300, "refund_amount": 300}, invoice


def _at_the_gateway(stripe_client, invoice: Invoice) -> list[tuple[int, str, str]]:
    found = stripe_client.v1.refunds.list(params={"payment_intent": invoice.payment_intent_id}).data
    return [(r.amount, r.status, r.metadata["hardcount_refund"]) for r in found]


def test_a_credit_note_request_killed_mid_refund_and_retried_answers_the_same_credit_note(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path
):
    api, body, invoice = _retried_after_the_kill(make_card, stripe_proxy, tmp_path)
    (note,) = CreditNote.objects.filter(invoice=invoice)

    status, answer = api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"})

    assert status == 201, answer
    assert (answer["id"], answer["number"], answer["total"]) == (note.id, "CN-000001", 300)
    assert (answer["refund"]["outcome"], answer["refund"]["amount"]) == ("succeeded", 300)
    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    refund = Refund.objects.get(invoice=invoice)
    assert _at_the_gateway(stripe_client, invoice) == [(300, "succeeded", refund.id)]
    calls = stripe_proxy.entries("POST /v1/refunds")
    assert [e.action for e in calls] == ["forwarded", "replayed"]
    assert {e.request.idempotency_key for e in calls} == {f"hc:{note.id}:refund"}
    # Once more: the stored answer, nothing sent.
    assert api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"}) == (201, answer)
    assert len(stripe_proxy.entries("POST /v1/refunds")) == 2
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 300
    assert_doctor_clean()


def test_negative_control_without_the_lookup_the_retry_is_refused_by_the_request_keys_constraint(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path, monkeypatch
):
    api, body, invoice = _retried_after_the_kill(make_card, stripe_proxy, tmp_path)
    monkeypatch.setattr(credit_notes, "_issued_under", lambda *args, **kwargs: None)

    # The retry issues the credit note again: the unique (tenant, mode, request_key) refuses it, so no second
    # refund is sent, but the client gets no answer either (a 500, its claim dropped).
    with pytest.raises(IntegrityError):
        api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"})

    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    assert [amount for amount, _, _ in _at_the_gateway(stripe_client, invoice)] == [300]
    assert [e.action for e in stripe_proxy.entries("POST /v1/refunds")] == ["forwarded"]
