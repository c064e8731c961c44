"""The page close: a drain page's plain closes share steps 1 and 3, each one transaction of set-wise statements.

A close (:mod:`billing.services.close`) costs two transactions of about twenty statements each
way; on a day when 20,000 subscriptions fall due, the drain's own CPU and PostgreSQL's, not the
gateway, bound how fast the book is billed (docs/benchmarks/drain.md). Most closes on such a day
are alike: a fresh period, no invoice yet, tax answered, an amount to charge (after any balance)
and a payment method to charge it to, and a first charge that succeeds. For those this module
writes the same rows as the close, with the same rules (the close's own builders:
:func:`~billing.services.close.new_draft_invoice`, :func:`~billing.services.close.apply_tax`,
:func:`~billing.services.payments.new_attempt`, :func:`~billing.services.payments.paid_changes` …),
a page at a time:

1. :func:`prepare_page`, one transaction: lock the page's subscriptions still due for the claimed
   period (``FOR UPDATE SKIP LOCKED``), lock their customers (in id order), materialise and
   finalise every plain close's invoice with its lines (one per subscription item, read for the
   whole page in one query) and their discounts (the page's in one query; a ``once`` discount, which
   must be claimed under its row lock, sends its close to the per-close path), take the tenant's gapless numbers in one
   counter update, reserve each first payment attempt, and emit ``invoice.created`` and
   ``invoice.finalized``, as step 1 of each close does (docs/reference/billing.md#closing-a-period).
2. The drain sends each plan (:func:`billing.services.payments.send`), in parallel.
3. :func:`record_page`, one transaction: lock subscriptions, invoices, attempts and customers (the
   order every billing writer uses, :mod:`billing.lock_objects`), record each successful charge
   (invoice paid, period advanced, ``invoice.paid`` and ``subscription.updated``) and each declined
   one (period advanced, ``past_due``, its dunning run opened, ``invoice.payment_failed``).

An invoice that comes to 0 is settled in step 1 itself, without a call, as the per-close path settles it.
Everything else goes back to the drain to close one by one with the full rules: a subscription
that is not plain (cancelling at period end, a change scheduled, pending invoice items of its
customer, ``past_due``, an invoice already there, tax pending, an amount under the minimum, no
payment method) and every charge that neither succeeded nor was declined (a failure goes on the
retry ladder; a pending payment or a rate limit keeps its attempt open). A database error in
either transaction rolls that page's batch back whole and hands every close in it to the same
per-close path, so a page close is never less safe than the closes it replaces; the unique index
on (subscription, period) still guards each invoice. docs/decisions/0016-page-close.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from billing import gateway as gw
from billing.events import invoice_event, subscription_event
from billing.lock_objects import (
    customer_qs_select_for_update,
    invoice_qs_select_for_update,
    locked_by_id,
    payment_attempt_qs_select_for_update,
    subscription_qs_select_for_update,
)
from billing.models import (
    BillingAttempt,
    BillingRun,
    Coupon,
    Customer,
    Invoice,
    InvoiceLineItem,
    PaymentAttempt,
    Subscription,
)
from billing.periods import period_bounds
from billing.queries import due_condition, next_invoice_number
from billing.representations import invoice_data
from billing.services.close import apply_tax, hooks, mark_finalized, new_draft_invoice, tax_quote
from billing.services.discounts import apply_discount, discounts_for_page
from billing.services.ledger import record_balance_applied_locked, set_balance_applied
from billing.services.lines import customers_with_pending, items_by_subscription
from billing.services.payments import (
    ATTEMPT_RESULT_FIELDS,
    PAID_FIELDS,
    ChargePlan,
    Outcome,
    OutcomeKind,
    apply_result,
    attempt_time,
    billing_attempt_row,
    billing_time,
    declined_changes,
    declined_events,
    is_current_period,
    mark_paid,
    needs_no_charge,
    new_attempt,
    note_gateway_ids,
    paid_changes,
    plan_for,
    settled_attempt,
    take_charge_locks,
)
from billing.services.usage import usage_lines_for
from dunning import services as dunning_services
from dunning.schedule import next_retry_at
from hardcount.bulk import insert_models, update_models
from hardcount.fencing import Fence
from hardcount.times import iso
from outbox import services as outbox_services
from outbox.services import emit_for

# Statuses a plain close starts from: paying never changes a past_due subscription's dunning here.
PLAIN_STATUSES = (Subscription.TRIALING, Subscription.ACTIVE)
SUBSCRIPTION_PAID_FIELDS = (
    "status",
    "current_period_start",
    "current_period_end",
    "periods_billed",
    "next_billing_at",
    "billing_failure_count",
    "next_billing_attempt_at",
    "billing_parked_at",
    "last_billing_error",
)


@dataclass
class PreparedClose:
    """One plain close after step 1: the claimed ``(subscription id, periods_billed)`` and its charge plan."""

    item: tuple[str, int]
    plan: ChargePlan
    lines: list[InvoiceLineItem]


def prepare_page(
    items: list[tuple[str, int]],
    *,
    run: BillingRun | None = None,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
) -> tuple[list[PreparedClose], dict[str, Outcome], list[tuple[str, int]]]:
    """Step 1 for a page's plain closes, in one transaction; ``(prepared, settled, others)``.

    ``items`` are the page's claimed ``(subscription id, periods_billed)``; ``as_of`` and
    ``test_clock_id`` as for :func:`billing.services.drain.drain_due`. ``prepared`` closes have
    their invoice finalised and their first attempt reserved, committed. ``settled`` maps the
    subscriptions whose invoice came to nothing to pay (amount due 0 after discounts and the
    customer's balance) to their ``billed`` :class:`Outcome`: closed in this transaction as the
    per-close path closes them (:func:`~billing.services.payments.settle_without_charge_locked`:
    paid without a call, ``invoice.paid``; the period advanced, ``subscription.updated``), with
    their billing attempt rows when ``run`` is given. ``others`` (in page order) were left
    untouched for the per-close path. On a test clock the charge lock of each
    prepared invoice is taken for this thread (:func:`~billing.services.payments.take_charge_locks`):
    call this inside :func:`~billing.services.payments.charging`. Raises the database's error
    (nothing of the batch is then written) and :class:`~hardcount.fencing.LeaseLost` when the
    fence refuses.
    """
    periods = dict(items)
    with transaction.atomic(), outbox_services.deferred_events():
        fence.check()
        subs = _lock_due(periods, as_of=as_of, test_clock_id=test_clock_id)
        now = billing_time(test_clock_id, as_of)
        attempted_at = attempt_time(now, test_clock_id=test_clock_id, as_of=as_of)
        bounds = {}
        for sub in subs:
            if sub.status in PLAIN_STATUSES and not sub.cancel_at_period_end and not sub.scheduled_items:
                price = sub.price
                bounds[sub.id] = period_bounds(
                    sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed
                )
        taken = _periods_invoiced(bounds)
        # A customer with pending invoice items is swept by the per-close path, under its items' locks.
        pending = customers_with_pending({sub.customer_id for sub in subs if sub.id in bounds})
        plain = [
            sub
            for sub in subs
            if sub.id in bounds and (sub.id, bounds[sub.id][0]) not in taken and sub.customer_id not in pending
        ]
        sub_items = items_by_subscription(sub.id for sub in plain)
        usage = usage_lines_for([(sub, sub_items[sub.id]) for sub in plain])  # the page's aggregation at once
        if hooks.after_usage:
            for sub in plain:
                hooks.after_usage(sub.id, usage.get(sub.id, []))
        customers = locked_by_id(customer_qs_select_for_update(), [sub.customer_id for sub in plain])
        page_discounts = discounts_for_page(plain, {sub.id: bounds[sub.id][0] for sub in plain})
        drafts = []
        for sub in plain:
            customer = customers[sub.customer_id]
            if not customer.default_payment_method:
                continue
            discount = page_discounts[sub.id]
            if discount is not None and discount.coupon.duration == Coupon.Duration.ONCE:
                continue  # claimed under its row lock by the per-close path
            invoice, sub_lines = new_draft_invoice(
                sub, *bounds[sub.id], now, sub_items[sub.id], usage=usage.get(sub.id, [])
            )
            if invoice.hold_reason:
                continue  # held for an operator by the per-close path (decision 0217)
            created = invoice_data(invoice, lines=sub_lines)
            apply_discount(invoice, sub_lines, discount)
            quote = tax_quote(invoice)
            if quote is None:
                continue
            apply_tax(invoice, quote)
            if invoice.hold_reason:
                continue  # tax carried it past one payment: held by the per-close path (decision 0231)
            set_balance_applied(customer, invoice)
            if needs_no_charge(invoice) and invoice.amount_due != 0:
                continue  # under the minimum: carried to the balance under the per-close path's ledger rules
            record_balance_applied_locked(customer, invoice, at=now)
            drafts.append((sub, customer, invoice, sub_lines, created))

        prepared, settled = [], {}
        numbers = _take_numbers(drafts)
        invoices, lines, attempts, changed_subs, rows = [], [], [], [], []
        for (sub, customer, invoice, sub_lines, created), number in zip(drafts, numbers, strict=True):
            mark_finalized(invoice, number=number, now=now)
            emit_for(invoice, "invoice.created", created, created_at=now)
            invoice_event(invoice, "invoice.finalized", lines=sub_lines, created_at=now)
            invoices.append(invoice)
            lines.extend(sub_lines)
            if invoice.amount_due == 0:
                attempts.append(settled_attempt(invoice, number=1, now=now))
                invoice.status, invoice.paid_at = Invoice.PAID, now  # no call: no attempt counted, nothing paid
                invoice_event(invoice, "invoice.paid", lines=sub_lines, created_at=now)
                if paid_changes(sub, invoice, other_open_invoices=False):
                    changed_subs.append(sub)
                    subscription_event(sub, "subscription.updated", created_at=now)
                settled[sub.id] = Outcome(OutcomeKind.BILLED, invoice.id)
                if run is not None:
                    rows.append(billing_attempt_row(run, sub.id, settled[sub.id], now=now))
                continue
            attempt = new_attempt(invoice, customer, number=1, now=attempted_at)
            attempts.append(attempt)
            prepared.append(PreparedClose((sub.id, periods[sub.id]), plan_for(invoice, customer, attempt), sub_lines))
        if test_clock_id:
            held = take_charge_locks([p.plan.invoice_id for p in prepared])
            if held:  # fresh ids: only a hash collision with another invoice's charge
                raise RuntimeError(f"the charge locks of new invoices {held} are held elsewhere")
        insert_models(Invoice, invoices)
        insert_models(InvoiceLineItem, lines)
        insert_models(PaymentAttempt, attempts)
        update_models(Subscription, changed_subs, SUBSCRIPTION_PAID_FIELDS)
        insert_models(BillingAttempt, rows)
    done = {p.item[0] for p in prepared} | set(settled)
    return prepared, settled, [item for item in items if item[0] not in done]


def _lock_due(periods: dict[str, int], *, as_of: datetime | None, test_clock_id: str | None) -> list[Subscription]:
    """Lock the subscriptions of ``periods`` still due for their claimed period, with their prices.

    The re-check of :func:`billing.queries.lock_due_subscription`, for a page: due by the same
    :func:`billing.queries.due_predicate` (on ``test_clock_id``'s clock, by ``as_of``), then the
    same period index. ``SKIP LOCKED``: one another transaction holds is being closed elsewhere
    (the per-close path then skips it). In id order.
    """
    subs = (
        subscription_qs_select_for_update(skip_locked=True)
        .select_related("price")
        .filter(due_condition(test_clock_id=test_clock_id, as_of=as_of), pk__in=sorted(periods))
    )
    return [sub for sub in subs if sub.periods_billed == periods[sub.id]]


def _periods_invoiced(bounds: dict[str, tuple[datetime, datetime]]) -> set[tuple[str, datetime]]:
    """Which ``(subscription id, period start)`` already have an invoice that is not void (left by an earlier
    close): those closes take the per-close path, which takes the invoice over."""
    if not bounds:
        return set()
    return set(
        Invoice.objects.filter(
            subscription_id__in=list(bounds),
            period_start__in={b[0] for b in bounds.values()},
            billing_reason=Invoice.CYCLE,
        )
        .exclude(status=Invoice.VOID)
        .values_list("subscription_id", "period_start")
    )


def _take_numbers(drafts: list[tuple]) -> list[int]:
    """The next gapless invoice numbers for ``drafts`` (in order), one counter update per (tenant, mode).

    The counters of :func:`billing.queries.next_invoice_number`, taken in key order (so two page
    closes never wait on each other's counters crosswise); a rolled-back page gives its
    numbers back.
    """
    wanted: dict[tuple[str, bool], int] = defaultdict(int)
    for sub, *_ in drafts:
        wanted[(sub.tenant_id, sub.livemode)] += 1
    last = {key: next_invoice_number(*key, count=count) - count for key, count in sorted(wanted.items())}
    numbers = []
    for sub, *_ in drafts:
        key = (sub.tenant_id, sub.livemode)
        last[key] += 1
        numbers.append(last[key])
    return numbers


def record_page(
    charged: list[tuple[PreparedClose, gw.ChargeResult]],
    *,
    run: BillingRun | None,
    as_of: datetime | None,
    test_clock_id: str | None,
    fence: Fence,
) -> tuple[dict[str, Outcome], list[tuple[PreparedClose, gw.ChargeResult]]]:
    """Step 3 for the first charges of a page's plain closes that succeeded or were declined, in one
    transaction; ``(outcomes, others)``.

    ``outcomes`` maps each recorded subscription id to its ``billed`` or ``declined``
    :class:`Outcome` (its billing attempt row is written when ``run`` is given). A success is
    recorded as :func:`billing.services.payments.record_outcome` records it: the invoice paid, the
    period advanced, ``invoice.paid`` and ``subscription.updated``. A decline too: the invoice
    stays open with one attempt counted, the period advances, the subscription is ``past_due``, its
    dunning run opens (:func:`dunning.services.start_dunning_for_first_declines`: one insert for the
    page) and ``invoice.payment_failed`` says when the first retry is. ``others`` are the results
    left for the per-close :func:`~billing.services.payments.record_outcome`: charges that neither
    succeeded nor were declined (errors, pending payments, rate limits), and any whose rows changed
    since step 1 (a racing same-key re-send recorded it, the period moved). Calls
    ``hooks.during_record`` for each inside the transaction, after the writes. Raises the
    database's error (nothing written) and :class:`~hardcount.fencing.LeaseLost`.
    """
    taken = [(p, r) for p, r in charged if r.outcome in (gw.SUCCEEDED, gw.DECLINED)]
    others = [(p, r) for p, r in charged if r.outcome not in (gw.SUCCEEDED, gw.DECLINED)]
    if not taken:
        return {}, others
    outcomes: dict[str, Outcome] = {}
    with transaction.atomic(), outbox_services.deferred_events():
        fence.check()
        subs = locked_by_id(
            subscription_qs_select_for_update().select_related("price").prefetch_related("items__price"),
            [p.plan.subscription_id for p, _ in taken],
        )
        invoices = locked_by_id(invoice_qs_select_for_update(), [p.plan.invoice_id for p, _ in taken])
        attempts = locked_by_id(payment_attempt_qs_select_for_update(), [p.plan.attempt_id for p, _ in taken])
        customers = locked_by_id(
            customer_qs_select_for_update(), [invoice.customer_id for invoice in invoices.values()]
        )
        now = billing_time(test_clock_id, as_of)
        completed_at = attempt_time(now, test_clock_id=test_clock_id, as_of=as_of)
        changed_customers: dict[str, Customer] = {}
        recorded, changed_subs, rows, paid, declined = [], [], [], [], []
        for prepared, result in taken:
            plan = prepared.plan
            sub, invoice = subs.get(plan.subscription_id), invoices.get(plan.invoice_id)
            attempt = attempts.get(plan.attempt_id)
            if not (
                sub is not None
                and invoice is not None
                and attempt is not None
                and attempt.outcome == PaymentAttempt.UNKNOWN
                and invoice.status == Invoice.OPEN
                and invoice.attempt_count == 0  # so no dunning run yet: only a recorded decline opens one
                and sub.status in PLAIN_STATUSES
                and is_current_period(sub, invoice)
            ):
                others.append((prepared, result))
                continue
            customer = customers[invoice.customer_id]
            if note_gateway_ids(customer, attempt, result):
                changed_customers[customer.id] = customer
            apply_result(attempt, result, completed_at=completed_at)
            if result.payment_intent_id and not invoice.payment_intent_id:
                invoice.payment_intent_id = result.payment_intent_id
            if result.outcome == gw.SUCCEEDED:
                mark_paid(invoice, now=now)
                paid.append(invoice)
                invoice_event(invoice, "invoice.paid", lines=prepared.lines, created_at=now)
                if paid_changes(sub, invoice, other_open_invoices=False):
                    changed_subs.append(sub)
                    subscription_event(sub, "subscription.updated", created_at=now)
                outcome = Outcome(OutcomeKind.BILLED, invoice.id)
            else:
                invoice.attempt_count += 1
                advanced, became_past_due = declined_changes(sub, invoice)
                changed_subs.append(sub)  # past_due at least: it was trialing or active
                declined_events(sub, advanced=advanced, became_past_due=became_past_due, now=now)
                declined.append((prepared, invoice, result.decline_code, sub.test_clock_id))
                outcome = Outcome(OutcomeKind.DECLINED, invoice.id, error=f"declined: {result.decline_code}")
            outcomes[sub.id] = outcome
            if run is not None:
                rows.append(billing_attempt_row(run, sub.id, outcome, now=now))
            recorded.append((invoice, attempt, outcome))
        if declined:
            # After the subscriptions' events, as record_outcome emits them, so invoice.payment_failed can say
            # when the first retry is (Stripe's next_payment_attempt).
            dunning_runs = dunning_services.start_dunning_for_first_declines(
                [(invoice, code, clock_id) for _, invoice, code, clock_id in declined], declined_at=now
            )
            for (prepared, invoice, _, _), dunning_run in zip(declined, dunning_runs, strict=True):
                invoice_event(
                    invoice,
                    "invoice.payment_failed",
                    lines=prepared.lines,
                    created_at=now,
                    extra={"next_payment_attempt": iso(next_retry_at(dunning_run))},
                )
        update_models(Customer, list(changed_customers.values()), ["gateway_customer_id", "gateway_payment_method"])
        update_models(PaymentAttempt, [attempt for _, attempt, _ in recorded], ATTEMPT_RESULT_FIELDS)
        update_models(Invoice, paid, [*PAID_FIELDS, "payment_intent_id"])
        update_models(Invoice, [invoice for _, invoice, _, _ in declined], ["attempt_count", "payment_intent_id"])
        update_models(Subscription, changed_subs, SUBSCRIPTION_PAID_FIELDS)
        insert_models(BillingAttempt, rows)
        if hooks.during_record:
            for invoice, attempt, outcome in recorded:
                hooks.during_record(invoice, attempt, outcome)
    return outcomes, others
