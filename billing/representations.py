"""The public JSON shape of billing objects, shared by API responses and event data.

Plain functions rather than serializers so the drain can build event payloads cheaply.
Times are ISO 8601 UTC with ``Z``; money is integer minor units beside its currency.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone

from billing import shards
from billing.hosted import hosted_invoice_pdf_url, hosted_invoice_url
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
        "discount": discount_data(c.discount) if c.discount_id else None,
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
        "discount": discount_data(s.discount) if s.discount_id else None,
        "discounts": [s.discount_id] if s.discount_id else [],
        "metadata": s.metadata,
        "created": iso(s.created_at),
    }


def line_item_data(line, discount_id: str | None = None) -> dict[str, Any]:
    """A line; ``discount_id``: its invoice's discount, which its ``discount_amount`` is of."""
    return {
        "id": line.id,
        "object": "line_item",
        "description": line.description,
        "price": line.price_id,
        "quantity": line.quantity,
        "amount": line.amount,
        "discount_amounts": _discount_amounts(line.discount_amount, discount_id),
        "currency": line.currency,
        "period_start": iso(line.period_start),
        "period_end": iso(line.period_end),
        "subscription_item": line.subscription_item or None,
        "invoice_item": line.invoice_item_id,
        "proration": line.proration,
    }


def _discount_amounts(amount: int, discount_id: str | None) -> list[dict[str, Any]]:
    """Stripe's ``discount_amounts`` / ``total_discount_amounts``: ``[{"amount", "discount"}]``, empty for none."""
    if not amount or discount_id is None:
        return []
    return [{"amount": amount, "discount": discount_id}]


def coupon_data(c) -> dict[str, Any]:
    """A coupon as Stripe's: ``percent_off`` a number, ``amount_off`` minor units of ``currency``; ``valid`` by
    the wall clock (:meth:`billing.models.Coupon.valid_at`)."""
    return {
        "id": c.id,
        "object": "coupon",
        "livemode": c.livemode,
        "name": c.name or None,
        "percent_off": float(c.percent_off) if c.percent_off is not None else None,
        "amount_off": c.amount_off,
        "currency": c.currency or None,
        "duration": c.duration,
        "duration_in_months": c.duration_in_months,
        "max_redemptions": c.max_redemptions,
        "redeem_by": iso(c.redeem_by),
        "times_redeemed": c.times_redeemed,
        "valid": c.valid_at(timezone.now()),
        "metadata": c.metadata,
        "created": iso(c.created_at),
    }


def discount_data(d) -> dict[str, Any]:
    """A discount as Stripe's: its coupon embedded, the customer and (a subscription's) subscription."""
    return {
        "id": d.id,
        "object": "discount",
        "coupon": coupon_data(d.coupon),
        "customer": d.customer_id,
        "subscription": d.subscription_id,
        "start": iso(d.start),
        "end": iso(d.end),
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
        "lines": [line_item_data(line, inv.discount_id) for line in lines],
        "subtotal": inv.subtotal,
        "discounts": [inv.discount_id] if inv.discount_id else [],
        "total_discount_amounts": _discount_amounts(inv.total_discount, inv.discount_id),
        "tax": inv.tax,
        "tax_rate_bps": inv.tax_rate_bps,
        "tax_status": inv.tax_status,
        "credit_applied": inv.credit_applied,
        "total": inv.total,
        "amount_due": inv.amount_due,
        "amount_paid": inv.amount_paid,
        "pre_payment_credit_notes_amount": inv.pre_payment_credit_notes_amount,
        "post_payment_credit_notes_amount": inv.post_payment_credit_notes_amount,
        "payment_intent": inv.payment_intent_id or None,
        "attempt_count": inv.attempt_count,
        "created": iso(inv.created_at),
        "finalized_at": iso(inv.finalized_at),
        "paid_at": iso(inv.paid_at),
        "voided_at": iso(inv.voided_at),
        "marked_uncollectible_at": iso(inv.marked_uncollectible_at),
        # Null on a draft, as Stripe's: only a finalized invoice has a document (billing/hosted.py).
        "hosted_invoice_url": hosted_invoice_url(inv),
        "invoice_pdf": hosted_invoice_pdf_url(inv),
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
        "shard": billing_run_shard(run),
    }


def billing_run_shard(run) -> str:
    """The billing shard of a run, as its lease role: the shard a scheduler run drained (``billing`` or
    ``billing:<index>``), or, for a tenant's run, the shard whose scheduler leader bills that tenant now."""
    if run.tenant_id is None:
        return run.lease_role if shards.parse_lease_role(run.lease_role) is not None else shards.FAMILY
    count = shards.configured_count()
    return shards.lease_role(shards.shard_of(run.tenant_id, count), count)


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


def credit_note_line_data(line) -> dict[str, Any]:
    """One credit-note line: ``amount`` minor units (before tax) credited for an invoice line."""
    return {
        "id": line.id,
        "object": "credit_note_line_item",
        "type": "invoice_line_item",
        "invoice_line_item": line.invoice_line_item_id,
        "description": line.description,
        "quantity": line.quantity,
        "amount": line.amount,
    }


def refund_data(refund) -> dict[str, Any]:
    """A refund to the card (Stripe's ``refund`` fields, with Hardcount's own id and ``outcome``)."""
    return {
        "id": refund.id,
        "object": "refund",
        "livemode": refund.livemode,
        "credit_note": refund.credit_note_id,
        "invoice": refund.invoice_id,
        "payment_intent": refund.payment_intent_id,
        "gateway_refund": refund.gateway_refund_id or None,
        "amount": refund.amount,
        "currency": refund.currency,
        "status": refund.status or None,
        "outcome": refund.outcome,
        "idempotency_key": refund.idempotency_key,
        "error_message": refund.error_message or None,
        "created": iso(refund.first_sent_at) if hasattr(refund.first_sent_at, "isoformat") else None,
        "completed_at": iso(refund.completed_at),
    }


def credit_note_pdf_url(note) -> str:
    """Stripe's ``credit_note.pdf``: ``<HARDCOUNT_PUBLIC_URL>/v1/credit_notes/<id>/pdf``, fetched with the tenant's
    API key (docs/decisions/0169)."""
    return f"{settings.HARDCOUNT_PUBLIC_URL.rstrip('/')}/v1/credit_notes/{note.id}/pdf"


def credit_note_data(note, lines=None) -> dict[str, Any]:
    """A credit note (Stripe's ``credit_note``): ``total = subtotal + tax`` and
    ``total = pre_payment_amount + refund_amount + credit_amount + out_of_band_amount``, minor units."""
    if lines is None:
        lines = list(note.lines.all())
    refund = getattr(note, "refund", None) if note.refund_amount else None
    return {
        "id": note.id,
        "object": "credit_note",
        "livemode": note.livemode,
        "number": note.number,
        "invoice": note.invoice_id,
        "customer": note.customer_id,
        "status": note.status,
        "type": note.type,
        "reason": note.reason or None,
        "memo": note.memo or None,
        "currency": note.currency,
        "lines": [credit_note_line_data(line) for line in lines],
        "subtotal": note.subtotal,
        "tax": note.tax,
        "total": note.total,
        "amount": note.total,
        "pre_payment_amount": note.pre_payment_amount,
        "post_payment_amount": note.total - note.pre_payment_amount,
        "refund_amount": note.refund_amount,
        "credit_amount": note.credit_amount,
        "out_of_band_amount": note.out_of_band_amount,
        "refund": refund_data(refund) if refund is not None else None,
        "customer_balance_transaction": note.credit_entry_id,
        "created": iso(note.created_at),
        "voided_at": iso(note.voided_at),
        "pdf": credit_note_pdf_url(note),
    }


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
