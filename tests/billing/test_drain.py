"""The drain (SPEC §4): pages, exactly-once, the exclude list, no circuit breaker, the retry ladder."""

from billing.models import BillingRun, Invoice, PaymentAttempt
from billing.services.drain import drain_due


def test_drain_of_several_pages_bills_each_subscription_exactly_once(book, tenant, stripe_proxy):
    subs = [book.subscribed(tenant) for _ in range(23)]

    run = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=5, concurrency=4)

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
    again = drain_due(livemode=False, trigger="manual", tenant_id=tenant.id, page_size=5)
    assert (again.pages, again.attempted) == (0, 0)
    assert BillingRun.objects.get(pk=run.pk).status == "completed"
