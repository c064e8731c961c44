"""The public JSON shape of billing objects, shared by API responses and event data.

Plain functions rather than serializers so the drain can build event payloads cheaply.
Times are ISO 8601 UTC with ``Z``; money is integer minor units beside its currency.
"""

from __future__ import annotations

from typing import Any

from hardcount.times import iso


def customer_data(c) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "customer",
        "livemode": c.livemode,
        "email": c.email,
        "name": c.name,
        "external_id": c.external_id,
        "default_payment_method": c.default_payment_method or None,
        "credit_balance": c.credit_balance,
        "currency": c.currency or None,
        "test_clock": c.test_clock_id,
        "metadata": c.metadata,
        "created": iso(c.created_at),
    }


def price_data(p) -> dict[str, Any]:
    return {
        "id": p.id,
        "object": "price",
        "livemode": p.livemode,
        "nickname": p.nickname,
        "amount": p.amount,
        "currency": p.currency,
        "interval": p.interval,
        "interval_count": p.interval_count,
        "active": p.active,
        "created": iso(p.created_at),
        "recurring": {
            "interval": p.interval,
            "interval_count": p.interval_count,
            "usage_type": p.usage_type,
            "meter": p.meter_id,
        },
        "billing_scheme": p.billing_scheme,
        "tiers_mode": p.tiers_mode or None,
        "tiers": None if p.tiers is None else [{**t, "up_to": t["up_to"] or "inf"} for t in p.tiers],
        "transform_quantity": (
            {"divide_by": p.transform_divide_by, "round": p.transform_round} if p.transform_divide_by else None
        ),
    }


def pause_collection_data(s) -> dict[str, Any] | None:
    """Stripe's ``pause_collection``: ``{"behavior", "resumes_at"}`` (ISO 8601 UTC or null) while paused, else None."""
    pause = s.pause_collection
    if pause is None:
        return None
    return {"behavior": pause["behavior"], "resumes_at": iso(pause["resumes_at"])}


def subscription_item_data(item) -> dict[str, Any]:
    """A subscription item, its price embedded as Stripe's is."""
    return {
        "id": item.id,
        "object": "subscription_item",
        "subscription": item.subscription_id,
        "price": price_data(item.price),
        "quantity": item.quantity,
        "created": iso(item.created_at),
    }


def _items_of(s) -> list:
    prefetched = getattr(s, "_prefetched_objects_cache", {}).get("items")
    if prefetched is not None:
        return sorted(prefetched, key=lambda item: (item.created_at, item.id))
    return list(s.items.select_related("price").order_by("created_at", "id"))


def scheduled_change_data(s, schedule) -> dict[str, Any] | None:
    """A change scheduled for the next period (``schedule``: the stored ``scheduled_items``), or None."""
    if not schedule:
        return None
    return {
        "effective_at": iso(s.next_billing_at),
        "items": [{"id": e["id"], "price": e["price"], "quantity": e["quantity"]} for e in schedule],
    }


def subscription_data(s, items=None) -> dict[str, Any]:
    """Subscription shape; ``items`` (with prices) may be passed, or prefetched as ``items__price``, to save queries.

    ``items`` is a list object as Stripe's (``{"object": "list", "data": [...]}``); ``price`` is the
    first item's price.
    """
    if items is None:
        items = _items_of(s)
    return {
        "id": s.id,
        "object": "subscription",
        "livemode": s.livemode,
        "customer": s.customer_id,
        "price": s.price_id,
        "items": {"object": "list", "data": [subscription_item_data(item) for item in items]},
        "scheduled_change": scheduled_change_data(s, s.scheduled_items),
        "status": s.status,
        "billing_cycle_anchor": iso(s.billing_cycle_anchor),
        "trial_end": iso(s.trial_end),
        "current_period_start": iso(s.current_period_start),
        "current_period_end": iso(s.current_period_end),
        "next_billing_at": iso(s.next_billing_at),
        "test_clock": s.test_clock_id,
        "cancel_at_period_end": s.cancel_at_period_end,
        "canceled_at": iso(s.canceled_at),
        "ended_at": iso(s.ended_at),
        "billing_state": s.billing_state,
        "billing_failure_count": s.billing_failure_count,
        "next_billing_attempt_at": iso(s.next_billing_attempt_at),
        "billing_parked_at": iso(s.billing_parked_at),
        "last_billing_error": s.last_billing_error or None,
        "pause_collection": pause_collection_data(s),
        "metadata": s.metadata,
        "created": iso(s.created_at),
    }


def line_item_data(line) -> dict[str, Any]:
    return {
        "id": line.id,
        "object": "line_item",
        "description": line.description,
        "price": line.price_id,
        "quantity": line.quantity,
        "amount": line.amount,
        "currency": line.currency,
        "period_start": iso(line.period_start),
        "period_end": iso(line.period_end),
        "subscription_item": line.subscription_item or None,
        "invoice_item": line.invoice_item_id,
        "proration": line.proration,
    }


def invoice_data(inv, lines=None) -> dict[str, Any]:
    """Invoice shape; ``lines`` may be passed to avoid a query (defaults to ``inv.lines.all()``)."""
    if lines is None:
        lines = list(inv.lines.all())
    return {
        "id": inv.id,
        "object": "invoice",
        "livemode": inv.livemode,
        "number": inv.number,
        "customer": inv.customer_id,
        "subscription": inv.subscription_id,
        "status": inv.status,
        "billing_reason": inv.billing_reason,
        "currency": inv.currency,
        "period_start": iso(inv.period_start),
        "period_end": iso(inv.period_end),
        "lines": [line_item_data(line) for line in lines],
        "subtotal": inv.subtotal,
        "tax": inv.tax,
        "tax_rate_bps": inv.tax_rate_bps,
        "tax_status": inv.tax_status,
        "credit_applied": inv.credit_applied,
        "total": inv.total,
        "amount_due": inv.amount_due,
        "amount_paid": inv.amount_paid,
        "payment_intent": inv.payment_intent_id or None,
        "attempt_count": inv.attempt_count,
        "created": iso(inv.created_at),
        "finalized_at": iso(inv.finalized_at),
        "paid_at": iso(inv.paid_at),
        "voided_at": iso(inv.voided_at),
        "marked_uncollectible_at": iso(inv.marked_uncollectible_at),
    }


def invoice_item_data(item) -> dict[str, Any]:
    """A pending invoice item (Stripe's ``invoiceitem``): signed ``amount`` (negative: a credit); ``invoice`` is
    null until an invoice sweeps it."""
    return {
        "id": item.id,
        "object": "invoiceitem",
        "livemode": item.livemode,
        "customer": item.customer_id,
        "subscription": item.subscription_id,
        "invoice": item.invoice_id,
        "amount": item.amount,
        "currency": item.currency,
        "description": item.description,
        "price": item.price_id,
        "quantity": item.quantity,
        "proration": item.proration,
        "period": {"start": iso(item.period_start), "end": iso(item.period_end)},
        "date": iso(item.created_at),
    }


def ledger_entry_data(entry) -> dict[str, Any]:
    """A credit ledger entry: signed ``amount`` (+ grants, − applies or carries a debit) and the balance after."""
    return {
        "id": entry.id,
        "object": "customer_balance_transaction",
        "livemode": entry.livemode,
        "customer": entry.customer_id,
        "amount": entry.amount,
        "currency": entry.currency,
        "balance_after": entry.balance_after,
        "reason": entry.reason,
        "description": entry.description,
        "invoice": entry.invoice_id,
        "created": iso(entry.created_at),
    }


def payment_attempt_data(attempt) -> dict[str, Any]:
    """One call (or same-key series of calls) to the gateway for an invoice."""
    return {
        "id": attempt.id,
        "object": "payment_attempt",
        "livemode": attempt.livemode,
        "invoice": attempt.invoice_id,
        "attempt_number": attempt.attempt_number,
        "payment_intent": attempt.payment_intent_id or None,
        "idempotency_key": attempt.idempotency_key or None,
        "payment_method": attempt.payment_method or None,
        "amount": attempt.amount,
        "currency": attempt.currency,
        "outcome": attempt.outcome,
        "payment_intent_status": attempt.payment_intent_status or None,
        "decline_code": attempt.decline_code or None,
        "error_message": attempt.error_message or None,
        "http_status": attempt.http_status,
        "settled_without_charge": attempt.settled_without_charge,
        "started_at": iso(attempt.started_at),
        "completed_at": iso(attempt.completed_at),
    }


def billing_run_data(run, tenant_counts: dict[str, int] | None = None) -> dict[str, Any]:
    """One drain: trigger, scope, status and counts.

    A scheduler run covers every tenant (``scope`` ``all_tenants``): shown to one tenant, it
    carries that tenant's ``tenant_counts`` (``attempted``, ``billed``, ``failed``) and no page
    count, so no tenant learns another's volume.
    """
    shared = run.tenant_id is None
    counts = tenant_counts if shared and tenant_counts is not None else run.__dict__
    return {
        "id": run.id,
        "object": "billing_run",
        "livemode": run.livemode,
        "trigger": run.trigger,
        "scope": "all_tenants" if shared else "tenant",
        "test_clock": run.test_clock_id,
        "status": run.status,
        "as_of": iso(run.as_of),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "pages": None if shared and tenant_counts is not None else run.pages,
        "attempted": counts["attempted"],
        "billed": counts["billed"],
        "failed": counts["failed"],
        "error": run.error or None,
    }


def billing_attempt_data(attempt) -> dict[str, Any]:
    """One subscription attempted by one run: outcome, error, and its failure number after the attempt."""
    return {
        "id": attempt.id,
        "object": "billing_attempt",
        "billing_run": attempt.run_id,
        "subscription": attempt.subscription_id,
        "invoice": attempt.invoice_id,
        "outcome": attempt.outcome,
        "error": attempt.error or None,
        "failure_number": attempt.failure_number,
        "created": iso(attempt.created_at),
    }


def test_clock_data(clock) -> dict[str, Any]:
    """A test clock: its ``frozen_time``, ``status`` (``ready`` | ``advancing``), the target of a running
    advance, and the reason of the latest failed close (or stopped advance) on it."""
    return {
        "id": clock.id,
        "object": "test_clock",
        "livemode": clock.livemode,
        "name": clock.name,
        "frozen_time": iso(clock.frozen_time),
        "status": clock.status,
        "advance_target": iso(clock.advance_target),
        "last_failure": clock.last_failure or None,
        "created": iso(clock.created_at),
    }


test_clock_data.__test__ = False  # not a pytest test despite its name


def meter_data(m) -> dict[str, Any]:
    """A meter, as Stripe's ``billing.meter``."""
    return {
        "id": m.id,
        "object": "billing.meter",
        "livemode": m.livemode,
        "display_name": m.display_name,
        "event_name": m.event_name,
        "status": m.status,
        "default_aggregation": {"formula": m.formula},
        "customer_mapping": {"event_payload_key": m.customer_key, "type": "by_id"},
        "value_settings": {"event_payload_key": m.value_key},
        "created": iso(m.created_at),
    }
