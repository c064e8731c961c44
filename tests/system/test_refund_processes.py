"""A credit note's refund to the card, its process SIGKILLed mid-refund (tests/system/refund_once.py): real
processes, real PostgreSQL, the strict dev Stripe.

Killed after the credit note committed (the refund not sent) and after the gateway ran the refund (its answer
not recorded): the reconciler finishes it under the refund's one key, and the gateway holds exactly one refund
of the credit note's amount. Killed while serving ``POST /v1/credit_notes`` with an ``Idempotency-Key``, then
retried by the client once the dead request's claim on that key is stale: the retry answers the credit note the
dead request issued and sends nothing new (docs/decisions/0212). Checked at the gateway: its refunds of the
PaymentIntent, and every refund request that reached it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import stripe
from django.db import IntegrityError

from billing.models import CreditNote, Invoice, Refund
from billing.services import credit_notes
from billing.services.credit_notes import reconcile_refunds
from billing.services.drain import drain_due
from hardcount.models import IdempotencyRecord
from tests.api.conftest import Api, make_keys
from tests.billing.conftest import STRIPE_KEY, VISA, Book
from tests.system.harness import BASE_DIR, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    # The stripe library hands httpx bytes as data= (tests/billing/conftest.py ignores it there too).
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _paid_invoice(make_card, tenant=None) -> Invoice:
    """A tenant's one 10.00 usd period, billed by the drain and paid by card."""
    book = Book(make_card)
    tenant = tenant or book.tenant("Refunds killed")
    sub = book.subscribed(tenant, card=VISA, amount=1000)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.amount_paid) == (Invoice.PAID, 1000)
    return invoice


def _run_killed(invoice: Invoice, stripe_proxy, kill_at: str, log, *, api: tuple[str, str] | None = None) -> str:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "STRIPE_API_BASE": stripe_proxy.api_base,
        "STRIPE_API_KEY": STRIPE_KEY,
        "HARDCOUNT_GATEWAY_TIMEOUT_S": "2",
        "HARDCOUNT_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    command = ["tests.system.refund_once", "--tenant", invoice.tenant_id, "--invoice", invoice.id, "--amount", "300"]
    if api is not None:
        command += ["--api-key", api[0], "--idempotency-key", api[1]]
    process = subprocess.Popen(
        [sys.executable, "-m", *command, "--kill-at", kill_at],
        cwd=BASE_DIR,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready", log.seek(0) or log.read()
    out, _ = process.communicate("go\n", timeout=60)
    assert process.returncode == -signal.SIGKILL, f"the refund was not killed:\n{out}\n{log.seek(0) or log.read()}"
    assert f"point={kill_at}" in out
    return out


def _refunds_at_the_gateway(stripe_client, invoice: Invoice) -> list[tuple[int, str, str]]:
    found = stripe_client.v1.refunds.list(params={"payment_intent": invoice.payment_intent_id}).data
    return [(r.amount, r.status, r.metadata.to_dict().get("hardcount_refund", "")) for r in found]


@pytest.mark.parametrize("kill_at", ["after_commit", "after_refund"])
def test_a_refund_killed_mid_way_reaches_the_gateway_once(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path, kill_at
):
    invoice = _paid_invoice(make_card)
    with open(tmp_path / "refund.log", "w+") as log:
        _run_killed(invoice, stripe_proxy, kill_at, log)

    # What the kill left: the credit note issued, its refund unknown; at the gateway nothing, or the one refund.
    note = CreditNote.objects.get(invoice=invoice)
    refund = Refund.objects.get(credit_note=note)
    assert (note.status, note.total, note.refund_amount, refund.outcome) == (CreditNote.ISSUED, 300, 300, "unknown")
    sent = [e.action for e in stripe_proxy.entries("POST /v1/refunds")]
    at_gateway = _refunds_at_the_gateway(stripe_client, invoice)
    if kill_at == "after_commit":
        assert (sent, at_gateway) == ([], [])
    else:
        assert (sent, at_gateway) == (["forwarded"], [(300, "succeeded", refund.id)])

    # Still in flight (the dead process's window): the reconciler leaves it alone. Once past it (aged by updating
    # the row, not waited out), it sends the refund under its key: the gateway replays it or runs it once.
    assert reconcile_refunds(livemode=False) == {"refunds_resolved": 0, "refunds_unresolved": 0}
    Refund.objects.filter(pk=refund.pk).update(
        started_at=refund.started_at - timedelta(minutes=5), first_sent_at=refund.first_sent_at - timedelta(minutes=5)
    )
    assert reconcile_refunds(livemode=False) == {"refunds_resolved": 1, "refunds_unresolved": 0}
    assert reconcile_refunds(livemode=False) == {"refunds_resolved": 0, "refunds_unresolved": 0}

    refund.refresh_from_db()
    assert (refund.outcome, refund.status, refund.amount) == (Refund.SUCCEEDED, "succeeded", 300)
    assert _refunds_at_the_gateway(stripe_client, invoice) == [(300, "succeeded", refund.id)]
    calls = stripe_proxy.entries("POST /v1/refunds")
    assert {e.request.idempotency_key for e in calls} == {f"hc:{note.id}:refund"}
    expected = ["forwarded"] if kill_at == "after_commit" else ["forwarded", "replayed"]
    assert [e.action for e in calls] == expected
    intent = stripe.StripeClient(STRIPE_KEY, base_addresses={"api": stripe_proxy.api_base})
    charge = intent.v1.payment_intents.retrieve(invoice.payment_intent_id)
    assert (charge.amount, charge.status) == (1000, "succeeded")
    invoice.refresh_from_db()
    assert (invoice.post_payment_credit_notes_amount, invoice.amount_paid) == (300, 1000)


def _retry_after_the_kill(make_card, stripe_proxy, tmp_path):
    """A credit note served by a process SIGKILLed after the gateway ran its refund; its request's claim on the
    Idempotency-Key and its refund then aged past their windows (rows updated, not waited out)."""
    keys = make_keys("Refund retried")
    invoice = _paid_invoice(make_card, keys.tenant)
    with open(tmp_path / "refund.log", "w+") as log:
        _run_killed(invoice, stripe_proxy, "after_refund", log, api=(keys.test, "refund-cn-1"))
    (record,) = IdempotencyRecord.objects.filter(key="refund-cn-1")
    assert record.completed_at is None  # the dead request never answered
    IdempotencyRecord.objects.filter(pk=record.pk).update(created_at=record.created_at - timedelta(minutes=6))
    refund = Refund.objects.get()
    Refund.objects.filter(pk=refund.pk).update(
        started_at=refund.started_at - timedelta(minutes=5), first_sent_at=refund.first_sent_at - timedelta(minutes=5)
    )
    body = {"invoice": invoice.id, "amount": 300, "refund_amount": 300}
    return Api(keys.test), body, invoice


def test_a_credit_note_request_killed_mid_refund_and_retried_answers_the_same_credit_note(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path
):
    api, body, invoice = _retry_after_the_kill(make_card, stripe_proxy, tmp_path)
    (note,) = CreditNote.objects.filter(invoice=invoice)

    status, answer = api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"})

    assert status == 201, answer
    assert (answer["id"], answer["number"], answer["total"]) == (note.id, "CN-000001", 300)
    assert (answer["refund"]["outcome"], answer["refund"]["amount"]) == ("succeeded", 300)
    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    refund = Refund.objects.get()
    assert _refunds_at_the_gateway(stripe_client, invoice) == [(300, "succeeded", refund.id)]
    calls = stripe_proxy.entries("POST /v1/refunds")
    assert [e.action for e in calls] == ["forwarded", "replayed"]
    assert {e.request.idempotency_key for e in calls} == {f"hc:{note.id}:refund"}
    # Once more: the stored answer, nothing sent.
    assert api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"}) == (201, answer)
    assert len(stripe_proxy.entries("POST /v1/refunds")) == 2
    invoice.refresh_from_db()
    assert invoice.post_payment_credit_notes_amount == 300


def test_negative_control_without_the_lookup_the_retry_is_refused_by_the_request_keys_constraint(
    transactional_db, stripe_proxy, stripe_client, make_card, tmp_path, monkeypatch
):
    api, body, invoice = _retry_after_the_kill(make_card, stripe_proxy, tmp_path)
    monkeypatch.setattr(credit_notes, "_issued_under", lambda *args, **kwargs: None)

    # The retry issues the credit note again: the unique (tenant, mode, request_key) refuses it, so no second
    # refund is sent, but the client gets no answer either (a 500, its claim dropped).
    with pytest.raises(IntegrityError):
        api.post("/v1/credit_notes", body, headers={"Idempotency-Key": "refund-cn-1"})

    assert CreditNote.objects.filter(invoice=invoice).count() == 1
    assert [r[0] for r in _refunds_at_the_gateway(stripe_client, invoice)] == [300]
    assert [e.action for e in stripe_proxy.entries("POST /v1/refunds")] == ["forwarded"]
