"""A small, clean book of every kind of row the doctor reads, written straight through the ORM.

The world is what a correct Hardcount leaves behind (docs/reference/domain.md–§6, and the semantics of
``billing.services``): paid, declined, voided-and-reissued, below-minimum and zero-amount
invoices, a credit ledger with grants, applied credit and a carried debit, waiting, parked,
trialing and test-clock subscriptions, a second tenant in live mode, events fanned out to
webhook endpoints, deliveries in every state, billing runs under an old and the current
fencing token. ``build_world()`` returns the ids the tests plant violations on.
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from django.db import transaction
from django.utils import timezone

from billing.models import (
    BillingAttempt,
    BillingRun,
    Customer,
    Invoice,
    InvoiceCounter,
    InvoiceLineItem,
    LedgerEntry,
    PaymentAttempt,
    Price,
    Subscription,
    SubscriptionItem,
    TestClock,
)
from billing.periods import period_bounds
from billing.representations import customer_data, invoice_data, ledger_entry_data, subscription_data
from dunning import services as dunning_services
from hardcount.ids import PREFIXES, _encode
from hardcount.models import Tenant
from leases.models import LeaderLease
from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
from outbox.services import emit_event


def id_at(kind: str, at: datetime) -> str:
    """An id of ``kind`` minted at ``at`` (hardcount.ids layout), to date a row without sleeping."""
    ms = int(at.timestamp() * 1000)
    return f"{PREFIXES[kind]}_{_encode((ms << 80) | secrets.randbits(80), 26)}"


def endpoint(
    tenant: Tenant, livemode: bool, url: str, enabled_events: list[str], secret: str, *, at: datetime, **fields
) -> str:
    """Create a webhook endpoint of ``tenant`` whose id is dated ``at`` (:func:`id_at`); returns the id.

    ``fields`` sets any other column (``enabled=False``, ``disabled_reason=…``).
    """
    return WebhookEndpoint.objects.create(
        id=id_at("webhook_endpoint", at),
        tenant=tenant,
        livemode=livemode,
        url=url,
        enabled_events=enabled_events,
        secret=secret,
        **fields,
    ).id


def clock_time(customer: Customer) -> datetime | None:
    """The time of the customer's test clock (the services date its objects' rows by it), or None."""
    return customer.test_clock.frozen_time if customer.test_clock_id else None


class Book:
    """Writes rows of one (tenant, mode) with their events, as the services would."""

    def __init__(self, tenant: Tenant, livemode: bool, prefix: str):
        self.tenant, self.livemode, self.prefix = tenant, livemode, prefix
        self.counter, _ = InvoiceCounter.objects.get_or_create(tenant=tenant, livemode=livemode)

    def event(self, type_: str, data: dict, at: datetime | None = None):
        return emit_event(tenant_id=self.tenant.id, livemode=self.livemode, type=type_, data=data, created_at=at)

    def customer(self, email: str, currency: str, *, clock: TestClock | None = None) -> Customer:
        c = Customer.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            email=email,
            currency=currency,
            default_payment_method="pm_card_visa",
            test_clock=clock,
        )
        self.event("customer.created", customer_data(c), clock_time(c))
        return c

    def price(self, amount: int, currency: str, interval: str = "month", count: int = 1) -> Price:
        return Price.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            amount=amount,
            currency=currency,
            interval=interval,
            interval_count=count,
        )

    def subscription(self, customer: Customer, price: Price, anchor: datetime, **fields) -> Subscription:
        s = Subscription.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            customer=customer,
            price=price,
            status=fields.pop("status", Subscription.ACTIVE),
            billing_cycle_anchor=anchor,
            next_billing_at=anchor,
            test_clock=customer.test_clock,
            **fields,
        )
        SubscriptionItem.objects.create(tenant=self.tenant, livemode=self.livemode, subscription=s, price=price)
        self.event("subscription.created", subscription_data(s), clock_time(customer))
        return s

    def ledger(self, customer: Customer, amount: int, reason: str, at: datetime, invoice=None) -> LedgerEntry:
        customer.refresh_from_db()
        customer.credit_balance += amount
        customer.save(update_fields=["credit_balance"])
        entry = LedgerEntry.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            customer=customer,
            amount=amount,
            currency=customer.currency,
            balance_after=customer.credit_balance,
            reason=reason,
            invoice=invoice,
            created_at=at,
        )
        if reason == LedgerEntry.GRANT:
            self.event("customer.credit_granted", ledger_entry_data(entry))
        return entry

    def invoice(self, sub: Subscription, n: int, *, tax_bps: int = 0, status: str = Invoice.OPEN) -> Invoice:
        """Invoice period ``n`` of ``sub``: materialised, credit applied, finalised (as the close's step 1)."""
        start, end = period_bounds(sub.billing_cycle_anchor, sub.price.interval, sub.price.interval_count, n)
        subtotal = sub.price.amount
        tax = subtotal * tax_bps // 10_000
        inv = Invoice.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            customer=sub.customer,
            subscription=sub,
            status=Invoice.DRAFT,
            currency=sub.price.currency,
            period_start=start,
            period_end=end,
            subtotal=subtotal,
            tax=tax,
            tax_rate_bps=tax_bps,
            tax_status=Invoice.TAX_CALCULATED if tax_bps else Invoice.TAX_NOT_APPLICABLE,
            total=subtotal + tax,
            amount_due=subtotal + tax,
            created_at=start,
        )
        InvoiceLineItem.objects.create(
            invoice=inv,
            description="1 × plan",
            price=sub.price,
            quantity=1,
            amount=subtotal,
            currency=inv.currency,
            period_start=start,
            period_end=end,
        )
        self.event("invoice.created", invoice_data(inv), at=start)
        customer = sub.customer
        customer.refresh_from_db()
        if customer.credit_balance:
            applied = (
                min(customer.credit_balance, inv.total) if customer.credit_balance > 0 else customer.credit_balance
            )
            inv.credit_applied, inv.amount_due = applied, inv.total - applied
            self.ledger(customer, -applied, LedgerEntry.APPLIED, start, invoice=inv)
        self.counter.last_number += 1
        self.counter.save()
        inv.number = f"{self.prefix}-{self.counter.last_number:06d}"
        inv.status, inv.finalized_at = Invoice.OPEN, start
        inv.save()
        self.event("invoice.finalized", invoice_data(inv), at=start)
        sub.periods_billed = n + 1
        sub.current_period_start, sub.current_period_end, sub.next_billing_at = start, end, end
        sub.save()
        return inv

    def attempt(self, inv: Invoice, outcome: str, *, settled: bool = False, decline_code: str = "") -> PaymentAttempt:
        number = inv.payment_attempts.count() + 1
        if not settled and not inv.payment_intent_id:
            inv.payment_intent_id = f"pi_{inv.id[-12:]}"
        attempt = PaymentAttempt.objects.create(
            tenant=self.tenant,
            livemode=self.livemode,
            invoice=inv,
            attempt_number=number,
            payment_intent_id="" if settled else inv.payment_intent_id,
            idempotency_key=""
            if settled
            else (f"hc:{inv.id}:create" if number == 1 else f"hc:{inv.id}:attempt:{number}"),
            payment_method="" if settled else "pm_card_visa",
            amount=inv.amount_due,
            currency=inv.currency,
            outcome=outcome,
            decline_code=decline_code,
            settled_without_charge=settled,
            **({"started_at": inv.period_start, "completed_at": inv.period_start} if clock_time(inv.customer) else {}),
        )
        inv.attempt_count = number
        if outcome == PaymentAttempt.SUCCEEDED:
            inv.status, inv.paid_at = Invoice.PAID, inv.period_start
            inv.amount_paid = 0 if settled else inv.amount_due
            if settled and inv.amount_due:
                self.ledger(inv.customer, -inv.amount_due, LedgerEntry.CARRIED_DEBIT, inv.period_start, invoice=inv)
        inv.save()
        if outcome == PaymentAttempt.SUCCEEDED:
            self.event("invoice.paid", invoice_data(inv), clock_time(inv.customer) and inv.period_start)
        elif outcome == PaymentAttempt.DECLINED:
            self.event("invoice.payment_failed", invoice_data(inv), clock_time(inv.customer) and inv.period_start)
            # As billing's record step does: the decline opens (or moves on) the invoice's dunning run.
            dunning_services.start_dunning(inv, declined_at=inv.period_start, decline_code=decline_code)
        return attempt

    def void(self, inv: Invoice) -> None:
        inv.status, inv.voided_at = Invoice.VOID, inv.period_start + timedelta(hours=1)
        inv.save()
        self.event("invoice.voided", invoice_data(inv))


def build_world() -> SimpleNamespace:
    """Write the clean book (committed by the caller's blocker) and return the ids tests need."""
    now = timezone.now()
    w = SimpleNamespace(now=now)
    with transaction.atomic():
        acme = Tenant.objects.create(name="Acme")
        globex = Tenant.objects.create(name="Globex")
        w.acme, w.globex = acme.id, globex.id
        # Endpoints exist a day before any event (ids dated, so fan-out is required for them).
        day_ago = now - timedelta(days=1)
        w.endpoint_all = endpoint(acme, False, "https://acme.example/hooks", ["*"], "whsec_a", at=day_ago)
        w.endpoint_invoices = endpoint(
            acme, False, "https://acme.example/invoices", ["invoice.*"], "whsec_b", at=day_ago
        )
        w.endpoint_disabled = endpoint(
            acme,
            False,
            "https://acme.example/gone",
            ["*"],
            "whsec_c",
            at=day_ago,
            enabled=False,
            disabled_reason="410 Gone",
        )
        w.endpoint_live = endpoint(
            globex, True, "https://globex.example/hooks", ["invoice.paid"], "whsec_d", at=day_ago
        )

        book = Book(acme, False, "ACME")
        jan31 = datetime(2026, 1, 31, 10, 0, tzinfo=UTC)

        # A past-due monthly subscription on a Jan 31 anchor: paid (with credit), declined (in
        # dunning), voided and reissued.
        alice = book.customer("alice@example.com", "usd")
        monthly = book.price(2000, "usd")
        sub = book.subscription(alice, monthly, jan31)
        book.ledger(alice, 500, LedgerEntry.GRANT, jan31 - timedelta(days=1))
        paid = book.invoice(sub, 0, tax_bps=1000)
        book.attempt(paid, PaymentAttempt.SUCCEEDED)
        declined = book.invoice(sub, 1, tax_bps=1000)
        book.attempt(declined, PaymentAttempt.DECLINED, decline_code="insufficient_funds")
        book.attempt(declined, PaymentAttempt.DECLINED, decline_code="insufficient_funds")
        sub.status = Subscription.PAST_DUE
        sub.save()
        voided = book.invoice(sub, 2, tax_bps=1000)
        book.void(voided)
        reissued = book.invoice(sub, 2, tax_bps=1000)
        book.attempt(reissued, PaymentAttempt.SUCCEEDED)
        book.ledger(alice, 300, LedgerEntry.GRANT, jan31 + timedelta(days=70))
        w.alice, w.monthly, w.sub = alice.id, monthly.id, sub.id
        w.paid, w.declined, w.voided, w.reissued = paid.id, declined.id, voided.id, reissued.id

        # A JPY subscription whose ¥40 invoice is under Stripe's ¥50 minimum: settled without a
        # call and carried to the balance; the next invoice takes the debit.
        bob = book.customer("bob@example.com", "jpy")
        yen = book.price(40, "jpy")
        yen_sub = book.subscription(bob, yen, datetime(2026, 3, 1, tzinfo=UTC))
        below = book.invoice(yen_sub, 0)
        book.attempt(below, PaymentAttempt.SUCCEEDED, settled=True)
        carried = book.invoice(yen_sub, 1)
        book.attempt(carried, PaymentAttempt.SUCCEEDED)
        w.bob, w.yen_sub, w.below_minimum, w.carried = bob.id, yen_sub.id, below.id, carried.id

        # Waiting (2 failures) and parked (8) subscriptions, and a trial not yet billed.
        carol = book.customer("carol@example.com", "usd")
        w.waiting = book.subscription(
            carol,
            monthly,
            now,
            billing_failure_count=2,
            next_billing_attempt_at=now + timedelta(hours=1),
            last_billing_error="gateway 503",
        ).id
        parked = book.subscription(
            carol, monthly, now, billing_failure_count=8, billing_parked_at=now, last_billing_error="gateway 503"
        )
        book.event("subscription.billing_parked", subscription_data(parked))
        w.parked = parked.id
        w.trialing = book.subscription(
            carol, monthly, now + timedelta(days=14), status=Subscription.TRIALING, trial_end=now + timedelta(days=14)
        ).id
        w.carol = carol.id

        # A test clock with a free plan: the zero invoice is paid without a call.
        clock = TestClock.objects.create(tenant=acme, livemode=False, frozen_time=jan31)
        dave = book.customer("dave@example.com", "usd", clock=clock)
        free = book.price(0, "usd", interval="week")
        clock_sub = book.subscription(dave, free, jan31)
        zero = book.invoice(clock_sub, 0)
        book.attempt(zero, PaymentAttempt.SUCCEEDED, settled=True)
        w.clock, w.dave, w.clock_sub, w.zero = clock.id, dave.id, clock_sub.id, zero.id

        # Another tenant, live mode, its own invoice numbers.
        live = Book(globex, True, "GLOBEX")
        erin = live.customer("erin@example.com", "eur")
        yearly = live.price(12000, "eur", interval="year")
        live_sub = live.subscription(erin, yearly, datetime(2024, 2, 29, tzinfo=UTC))
        live_paid = live.invoice(live_sub, 0)
        live.attempt(live_paid, PaymentAttempt.SUCCEEDED)
        w.erin, w.live_sub, w.live_paid = erin.id, live_sub.id, live_paid.id

        # The billing lease: token 3 since an hour ago; a finished run of token 2, a live run of token 3.
        LeaderLease.objects.create(
            role="billing",
            holder="host:1:abc",
            token=3,
            acquired_at=now - timedelta(hours=1),
            heartbeat_at=now,
            expires_at=now + timedelta(hours=1),
        )
        old_run = BillingRun.objects.create(
            trigger=BillingRun.SCHEDULER,
            livemode=False,
            status=BillingRun.COMPLETED,
            as_of=now - timedelta(hours=2),
            started_at=now - timedelta(hours=2),
            finished_at=now - timedelta(hours=2) + timedelta(seconds=5),
            pages=1,
            attempted=1,
            billed=1,
            lease_token=2,
        )
        w.old_attempt = BillingAttempt.objects.create(
            run=old_run,
            subscription=sub,
            invoice=reissued,
            outcome=BillingAttempt.BILLED,
            created_at=now - timedelta(hours=2) + timedelta(seconds=1),
        ).id
        w.old_run = old_run.id
        w.live_run = BillingRun.objects.create(
            trigger=BillingRun.SCHEDULER,
            livemode=False,
            status=BillingRun.RUNNING,
            as_of=now,
            started_at=now,
            lease_token=3,
        ).id

        # Deliveries in every state: succeeded, retrying after a 500, claimed in flight.
        deliveries = list(Delivery.objects.filter(endpoint_id=w.endpoint_all).order_by("id")[:3])
        ok, retrying, in_flight = deliveries
        DeliveryAttempt.objects.create(
            delivery=ok, number=1, outcome=DeliveryAttempt.SUCCEEDED, status_code=200, executor="host:1"
        )
        Delivery.objects.filter(pk=ok.pk).update(status=Delivery.SUCCEEDED, attempts=1, completed_at=now)
        DeliveryAttempt.objects.create(
            delivery=retrying, number=1, outcome=DeliveryAttempt.RETRYABLE, status_code=500, executor="host:1"
        )
        Delivery.objects.filter(pk=retrying.pk).update(
            status=Delivery.RETRYING, attempts=1, fire_after=now + timedelta(minutes=1)
        )
        Delivery.objects.filter(pk=in_flight.pk).update(
            attempts=1, claimed_by="host:2/claim", claim_expires_at=now + timedelta(seconds=20)
        )
        w.delivery_ok, w.delivery_retrying, w.delivery_in_flight = ok.id, retrying.id, in_flight.id
    return w


def wipe() -> None:
    """Remove every row the world wrote (all application tables), keeping the schema."""
    from django.core.management import call_command

    call_command("flush", interactive=False, verbosity=0)


__all__ = ["Book", "build_world", "id_at", "time", "wipe"]
