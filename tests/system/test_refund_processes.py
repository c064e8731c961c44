"""A credit note's refund to the card, its process SIGKILLed mid-refund (tests/system/refund_once.py): real
processes, real PostgreSQL, the strict dev Stripe.

Killed after the credit note committed (the refund not sent) and after the gateway ran the refund (its answer
not recorded): the reconciler finishes it under the refund's one key, and the gateway holds exactly one refund
of the credit note's amount. Checked at the gateway: its refunds of the PaymentIntent, and every refund request
that reached it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import stripe

from billing.models import CreditNote, Invoice, Refund
from billing.services.credit_notes import reconcile_refunds
from billing.services.drain import drain_due
from tests.billing.conftest import STRIPE_KEY, VISA, Book
from tests.system.harness import BASE_DIR, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    # The stripe library hands httpx bytes as data= (tests/billing/conftest.py ignores it there too).
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _paid_invoice(make_card) -> Invoice:
    """A tenant's one 10.00 usd period, billed by the drain and paid by card."""
    book = Book(make_card)
    tenant = book.tenant("Refunds killed")
    sub = book.subscribed(tenant, card=VISA, amount=1000)
    drain_due(livemode=False, trigger="manual", tenant_id=tenant.id)
    invoice = Invoice.objects.get(subscription=sub)
    assert (invoice.status, invoice.amount_paid) == (Invoice.PAID, 1000)
    return invoice


def _run_killed(invoice: Invoice, stripe_proxy, kill_at: str, log) -> str:
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
