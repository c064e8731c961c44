"""Pausing payment collection: Stripe's ``pause_collection`` (https://docs.stripe.com/billing/subscriptions/pause-payment).

A subscription's collection is paused by ``pause_collection = {behavior, resumes_at}``
(:func:`update_pause_collection`, from ``POST /v1/subscriptions/{id}``) and resumed by clearing
it, or by the drain once ``resumes_at`` has come (:func:`resume_due`, on the database's now() or
the test clock's time). While a period that starts before ``resumes_at`` comes due, the close
paths never see it: the one due predicate (:func:`billing.queries.due_predicate`) leaves paused
periods out, and :func:`invoice_paused_periods` claims exactly those instead, with the same
predicate asked the other way. It writes the period's invoice without any charge, as the
behavior says, and advances the period once:

- ``void``: the draft is created and voided at once (no number, no tax, no balance applied);
- ``mark_uncollectible``: created, numbered and marked ``uncollectible`` at once, with its discount
  (no tax, no balance applied: nothing will be collected on it);
- ``keep_as_draft``: created and kept a draft (no number); nothing finalises or charges it later.

Reasons, and what Stripe does differently: docs/decisions/0144-pausing-collection.md.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from billing.events import invoice_event
from billing.lock_objects import customer_locked, subscription_qs_select_for_update
from billing.models import Invoice, Subscription
from billing.models.subscriptions import PauseBehavior
from billing.periods import period_bounds
from billing.queries import claim_due_page, lock_due_subscription, next_invoice_number, shard_filter
from billing.representations import iso, pause_collection_data, subscription_data
from billing.services.catalog import billing_now
from billing.services.close import cancel_at_period_end_locked, mark_finalized, materialise_period_invoice
from billing.services.discounts import apply_discount_locked
from billing.services.items import apply_scheduled_locked
from billing.services.payments import advance_period_locked, billing_time, clear_failure_state
from billing.services.usage import usage_before_schedule_locked
from billing.shards import Shard
from hardcount.errors import InvalidRequestError, NotFoundError, business_rule_codes
from hardcount.fencing import NO_FENCE, Fence
from outbox import services as outbox_services

log = logging.getLogger("billing.pausing")

BUSINESS_RULE_CODES = business_rule_codes("resumes_at_in_past", "subscription_canceled")

# Claimed per statement by the paused-period pass.
PAGE_SIZE = 100


def collection_paused(subscription: Subscription, *, now: datetime) -> bool:
    """True when the subscription's collection is paused at billing time ``now`` (paused, and ``resumes_at`` unset
    or after ``now``): nothing is charged for it, dunning included."""
    if not subscription.pause_collection_behavior:
        return False
    resumes_at = subscription.pause_collection_resumes_at
    return resumes_at is None or now < resumes_at


def update_pause_collection(
    *, tenant_id: str, livemode: bool, subscription_id: str, pause_collection: dict[str, Any] | None
) -> Subscription:
    """Pause (``{"behavior", "resumes_at"}``) or resume (None) a subscription's collection; returns it.

    ``behavior`` is a :class:`~billing.models.subscriptions.PauseBehavior`; ``resumes_at`` a UTC
    datetime after the subscription's billing time (its clock's, or the DB's now()), or None
    (paused until resumed by hand). Emits ``subscription.paused`` (collection was running),
    ``subscription.resumed`` (cleared) or ``subscription.updated`` (another pause), each with
    ``previous_attributes.pause_collection``; nothing when nothing changes. Raises
    :class:`NotFoundError`, or :class:`InvalidRequestError` (422) for a ``resumes_at`` not in the
    future (``resumes_at_in_past``) or a pause of a canceled subscription (``subscription_canceled``).
    """
    with transaction.atomic():
        subscription = (
            subscription_qs_select_for_update()
            .select_related("test_clock")
            .filter(tenant_id=tenant_id, livemode=livemode, pk=subscription_id)
            .first()
        )
        if subscription is None:
            raise NotFoundError(f"No such subscription: '{subscription_id}'.", param="id")
        now = billing_now(subscription.test_clock)
        previous = pause_collection_data(subscription)
        if pause_collection is None:
            behavior, resumes_at = "", None
        else:
            if subscription.status == Subscription.CANCELED:
                raise InvalidRequestError(
                    f"Subscription '{subscription.id}' is canceled; its collection cannot be paused.",
                    code="subscription_canceled",
                    param="pause_collection",
                )
            behavior = PauseBehavior(pause_collection["behavior"])
            resumes_at = pause_collection.get("resumes_at")
            if resumes_at is not None and resumes_at <= now:
                raise InvalidRequestError(
                    f"pause_collection.resumes_at must be after the subscription's current time {iso(now)}.",
                    code="resumes_at_in_past",
                    param="pause_collection.resumes_at",
                )
        if (behavior, resumes_at) == (
            subscription.pause_collection_behavior,
            subscription.pause_collection_resumes_at,
        ):
            return subscription
        subscription.pause_collection_behavior = behavior
        subscription.pause_collection_resumes_at = resumes_at
        subscription.save(update_fields=["pause_collection_behavior", "pause_collection_resumes_at", "updated_at"])
        if previous is None:
            event_type = "subscription.paused"
        elif not behavior:
            event_type = "subscription.resumed"
        else:
            event_type = "subscription.updated"
        _pause_event(subscription, event_type, previous=previous, at=now)
    return subscription


def _pause_event(subscription: Subscription, event_type: str, *, previous: dict | None, at: datetime) -> None:
    """The subscription's event with Stripe's ``previous_attributes`` for the pause field."""
    data = subscription_data(subscription)
    data["previous_attributes"] = {"pause_collection": previous}
    outbox_services.emit_for(subscription, event_type, data, created_at=at)


# --- the drain's passes -----------------------------------------------------------------------------------------------


def collect_paused(
    *,
    livemode: bool,
    tenant_id: str | None = None,
    test_clock_id: str | None = None,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
    shard: Shard | None = None,
) -> tuple[int, int]:
    """The drain's pause step, before its claims: invoice the paused periods due, then resume the pauses whose
    ``resumes_at`` has come. Returns ``(periods invoiced, subscriptions resumed)``.

    Same scope as :func:`billing.services.drain.drain_due` (a mode, optionally one tenant, wall-clock
    subscriptions or those of ``test_clock_id`` as of ``as_of``, of ``shard``'s tenants when given). The periods
    first: one that began before ``resumes_at`` is a paused one even when the drain reaches it later.
    """
    if not _anything_paused(livemode=livemode, tenant_id=tenant_id, test_clock_id=test_clock_id):
        return 0, 0
    scope = {"livemode": livemode, "tenant_id": tenant_id, "test_clock_id": test_clock_id, "as_of": as_of}
    invoiced = invoice_paused_periods(**scope, fence=fence, shard=shard)
    resumed = resume_due(**scope, fence=fence, shard=shard)
    return invoiced, resumed


def _anything_paused(*, livemode: bool, tenant_id: str | None, test_clock_id: str | None) -> bool:
    """Whether the scope has any paused subscription at all: a read on the partial index ``subscription_paused_idx``,
    unfenced (it writes nothing), so a book with no pause costs the drain one cheap statement and no transaction."""
    paused = Subscription.objects.filter(livemode=livemode, test_clock_id=test_clock_id).exclude(
        pause_collection_behavior=""
    )
    if tenant_id:
        paused = paused.filter(tenant_id=tenant_id)
    return paused.exists()


def invoice_paused_periods(
    *,
    livemode: bool,
    tenant_id: str | None = None,
    test_clock_id: str | None = None,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
    shard: Shard | None = None,
) -> int:
    """Write the invoice of every due period whose collection is paused, per its behavior, and advance it; no charge.

    A subscription several periods behind has each of them invoiced here, one transaction per
    period (no gateway call holds anything up). Returns how many periods were invoiced. Every
    write is fenced; :class:`~hardcount.fencing.LeaseLost` propagates.
    """
    done = 0
    # Each claim starts past the last one's rows: one this pass could not invoice (locked elsewhere) stays
    # behind, for the next pass.
    after = None
    while True:
        with transaction.atomic():
            fence.check()
            page = claim_due_page(
                livemode=livemode,
                tenant_id=tenant_id,
                test_clock_id=test_clock_id,
                as_of=as_of,
                after=after,
                page_size=PAGE_SIZE,
                paused=True,
                shard=shard,
            )
        if not page:
            return done
        after = (page[-1][2], page[-1][0])
        for subscription_id, claimed, _ in page:
            periods_billed: int | None = claimed
            while periods_billed is not None:
                periods_billed = _invoice_paused_period(
                    subscription_id,
                    periods_billed=periods_billed,
                    test_clock_id=test_clock_id,
                    as_of=as_of,
                    fence=fence,
                )
                if periods_billed is not None:
                    done += 1


def _invoice_paused_period(
    subscription_id: str, *, periods_billed: int, test_clock_id: str | None, as_of: datetime | None, fence: Fence
) -> int | None:
    """One paused period in one transaction; the next period's index when it is paused and due too, else None."""
    with transaction.atomic(), outbox_services.deferred_events():
        fence.check()
        if not lock_due_subscription(
            subscription_id, periods_billed=periods_billed, test_clock_id=test_clock_id, as_of=as_of, paused=True
        ):
            return None
        sub = Subscription.objects.select_related("price").get(pk=subscription_id)
        now = billing_time(test_clock_id, as_of)
        if sub.cancel_at_period_end:
            cancel_at_period_end_locked(sub, None, now)
            return None
        price = sub.price
        start, end = period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed)
        usage = None
        if sub.scheduled_items:
            # A change scheduled for the period's end takes effect at that boundary, collected or not (as in
            # Stripe, where a pause changes what becomes of invoices, not the subscription): the paused invoice
            # bills the new items, and so does every period after it (docs/decisions/0148); the usage of the
            # period that ended is still the old items' (0173).
            usage = usage_before_schedule_locked(sub)
            if apply_scheduled_locked(sub, now, usage_since=start):
                sub = Subscription.objects.select_related("price").get(pk=subscription_id)
        inserted = materialise_period_invoice(sub, start, end, now, sweep=False, usage=usage)
        if inserted is not None:
            settle_paused_draft_locked(inserted[0], PauseBehavior(sub.pause_collection_behavior), now=now)
            invoice = inserted[0]
        else:
            # The period's invoice was written before the pause (a close that crashed after its first
            # step): it stays as it is; the period still advances once.
            invoice = (
                Invoice.objects.filter(subscription_id=sub.id, period_start=start).exclude(status=Invoice.VOID).get()
            )
        advance_period_locked(sub, invoice)
        clear_failure_state(sub)
        if sub.status == Subscription.TRIALING:
            sub.status = Subscription.ACTIVE
        sub.save()
        outbox_services.emit_for(sub, "subscription.updated", subscription_data(sub), created_at=now)
        return sub.periods_billed


def settle_paused_draft_locked(invoice: Invoice, behavior: PauseBehavior, *, now: datetime) -> None:
    """Settle a just-created draft (locked by its insert) as ``behavior`` says, with its events: every invoice made
    while collection is paused (a paused period's, or an ``always_invoice`` change's) is settled so, never charged."""
    if behavior == PauseBehavior.VOID:
        invoice.status = Invoice.VOID
        invoice.voided_at = now
        invoice.save(update_fields=["status", "voided_at"])
        invoice_event(invoice, "invoice.voided", created_at=now)
    elif behavior == PauseBehavior.MARK_UNCOLLECTIBLE:
        # The debt it records is what the customer would have owed: its discount applies, as at a finalisation
        # (the customer's lock before the discount's row, as every close takes them).
        customer_locked(invoice.customer_id)
        apply_discount_locked(invoice)
        # The counter is the last lock of the order: nothing else is locked after it here.
        mark_finalized(invoice, number=next_invoice_number(invoice.tenant_id, invoice.livemode), now=now)
        invoice.save()
        invoice_event(invoice, "invoice.finalized", created_at=now)
        invoice.status = Invoice.UNCOLLECTIBLE
        invoice.marked_uncollectible_at = now
        invoice.save(update_fields=["status", "marked_uncollectible_at"])
        invoice_event(invoice, "invoice.marked_uncollectible", created_at=now)
    # keep_as_draft: the draft stays as inserted.


# RESUME_DUE: pauses whose resumes_at has come by the billing time (the DB's now() when null),
# locked SKIP LOCKED (one being changed elsewhere is resumed by the next pass).
_RESUME_DUE = """
    SELECT id FROM billing_subscription
    WHERE livemode = %s
      AND pause_collection_behavior <> ''
      AND pause_collection_resumes_at <= COALESCE(%s::timestamptz, now())
      AND {clock}
      {tenant}
      {shard}
    ORDER BY id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
"""


def resume_due(
    *,
    livemode: bool,
    tenant_id: str | None = None,
    test_clock_id: str | None = None,
    as_of: datetime | None = None,
    fence: Fence = NO_FENCE,
    shard: Shard | None = None,
) -> int:
    """Clear every pause whose ``resumes_at`` has come by ``as_of`` (None: the DB's now()); returns how many.

    Wall-clock subscriptions (``test_clock_id`` None) or that clock's only; of ``shard``'s tenants when given
    (:func:`billing.queries.shard_filter`). Each resume emits
    ``subscription.resumed`` with ``previous_attributes.pause_collection``, dated by the billing time.
    """
    clock = "test_clock_id = %s" if test_clock_id else "test_clock_id IS NULL"
    in_shard, shard_params = shard_filter(shard)
    sql = _RESUME_DUE.format(clock=clock, tenant="AND tenant_id = %s" if tenant_id else "", shard=in_shard)
    params = [
        livemode,
        as_of,
        *([test_clock_id] if test_clock_id else []),
        *([tenant_id] if tenant_id else []),
        *shard_params,
    ]
    resumed = 0
    while True:
        with transaction.atomic(), outbox_services.deferred_events():
            fence.check()
            with connection.cursor() as cursor:
                cursor.execute(sql, [*params, PAGE_SIZE])
                ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return resumed
            now = billing_time(test_clock_id, as_of)
            for sub in Subscription.objects.filter(pk__in=ids).order_by("pk"):
                previous = pause_collection_data(sub)
                sub.pause_collection_behavior = ""
                sub.pause_collection_resumes_at = None
                sub.save(update_fields=["pause_collection_behavior", "pause_collection_resumes_at", "updated_at"])
                _pause_event(sub, "subscription.resumed", previous=previous, at=now)
                resumed += 1


def next_resume_at(*, test_clock_id: str, after: datetime | None) -> datetime | None:
    """The earliest ``resumes_at`` of the clock's paused subscriptions (after ``after``): an instant of its advance."""
    paused = Subscription.objects.filter(
        test_clock_id=test_clock_id, pause_collection_resumes_at__isnull=False
    ).exclude(pause_collection_behavior="")
    if after is not None:
        paused = paused.filter(pause_collection_resumes_at__gt=after)
    return paused.order_by("pause_collection_resumes_at").values_list("pause_collection_resumes_at", flat=True).first()


__all__ = [
    "BUSINESS_RULE_CODES",
    "collect_paused",
    "collection_paused",
    "invoice_paused_periods",
    "next_resume_at",
    "resume_due",
    "settle_paused_draft_locked",
    "update_pause_collection",
]
