"""Every request a dunning run sends carries the invoice's frozen amount, checked at the gateway.

The rule: docs/reference/billing.md (idempotency keys).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from billing.models import Invoice, PaymentAttempt
from billing.services.dunning_pass import process_due
from billing.services.ledger import grant_credit
from tests.dunning.conftest import DAY, decline


@pytest.mark.parametrize(("amount", "currency"), [(1999, "usd"), (1200, "jpy")])
def test_the_amount_under_every_idempotency_key_is_the_invoices_frozen_amount(
    book, tenant, stripe_proxy, stripe_client, amount, currency
):
    declined = decline(book, tenant, amount=amount, currency=currency)
    invoice = Invoice.objects.get(pk=declined.invoice.pk)
    assert invoice.amount_due == amount
    for day in (1, 3, 5, 7):
        # Credit granted while the invoice is in dunning goes to the next invoice, never to this one.
        grant_credit(declined.subscription.customer_id, tenant_id=tenant.id, livemode=False, amount=100)
        process_due(livemode=False, as_of=declined.at + day * DAY)

    invoice.refresh_from_db()
    assert invoice.status == "uncollectible" and invoice.amount_due == amount
    prefix = f"hc:{invoice.id}:"
    bodies = defaultdict(set)
    for entry in stripe_proxy.entries():
        key = entry.request.idempotency_key
        if key and key.startswith(prefix):
            bodies[key].add((entry.request.line, tuple(sorted(entry.request.params.items()))))
    assert sorted(bodies) == sorted([f"{prefix}create", *(f"{prefix}attempt:{n}" for n in range(2, 6))])
    assert all(len(sent) == 1 for sent in bodies.values()), "a key was sent with two bodies"
    assert stripe_proxy.entries(action="conflict") == []
    [(create_line, create_params)] = bodies[f"{prefix}create"]
    assert create_line == "POST /v1/payment_intents"
    assert (dict(create_params)["amount"], dict(create_params)["currency"]) == (str(amount), currency)
    for n in range(2, 6):
        [(line, params)] = bodies[f"{prefix}attempt:{n}"]
        # A confirmation cannot change the amount: it confirms the invoice's one PaymentIntent.
        assert line == f"POST /v1/payment_intents/{invoice.payment_intent_id}/confirm"
        assert "amount" not in dict(params)
    intent = stripe_client.v1.payment_intents.retrieve(invoice.payment_intent_id)
    assert (intent.amount, intent.currency) == (amount, currency)
    assert set(PaymentAttempt.objects.filter(invoice=invoice).values_list("amount", "currency")) == {(amount, currency)}
