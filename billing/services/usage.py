"""Usage-based billing: meters, meter events, metered prices' charges, and a period's usage lines.

Shapes follow Stripe's Billing Meters and tiered prices (https://docs.stripe.com/billing/subscriptions/usage-based,
https://docs.stripe.com/products-prices/pricing-models#tiered-pricing). Decisions:
0164 (events: storage, identifiers, set-wise insert), 0165 (the grace window and when usage is billed),
0166 (metered prices and their charge models), 0167 (what this first version leaves out).

A period's usage is billed in arrears: the cycle invoice of period n+1 carries the usage of period n,
aggregated set-wise per close or page (:func:`usage_lines_for`) inside the transaction that
writes the invoice, so the invoice's unique index on (subscription, period) makes it exactly once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from dateutil.parser import isoparse
from django.conf import settings
from django.db import IntegrityError, connection, transaction

from billing import queries
from billing.events import invoice_event
from billing.models import (
    Customer,
    Invoice,
    InvoiceLineItem,
    Meter,
    MeterEvent,
    MeterEventIdentifier,
    Price,
    Subscription,
    SubscriptionItem,
)
from billing.periods import period_bounds
from billing.queries import aggregate_usage, ingest_time_locked, insert_meter_events, materialise_invoice
from billing.representations import meter_data
from hardcount.errors import InvalidRequestError, business_rule_codes, storable_text
from hardcount.fencing import NO_FENCE, Fence
from hardcount.ids import new_ids
from hardcount.money import MAX_AMOUNT
from hardcount.times import iso
from outbox.services import emit_for

BUSINESS_RULE_CODES = business_rule_codes(
    "meter_event_name_taken",
    "meter_invalid",
    "tiers_invalid",
    "transform_quantity_invalid",
    "meter_not_found",
    "customer_not_found",
    "value_invalid",
    "value_missing",
    "timestamp_in_future",
    "timestamp_too_old",
    "timestamp_out_of_range",
    "usage_amount_too_large",
)

# Stripe: a meter event may be at most 5 minutes in the future.
FUTURE_SKEW = timedelta(minutes=5)
# Largest batch of POST /v1/billing/meter_events/batch.
MAX_BATCH = 1000
# Largest value of one event: keeps every period's sum and every charge far inside bigint.
MAX_EVENT_VALUE = 10**9
# An invoice line's quantity column is a 32-bit integer; a larger usage is shown in the description.
MAX_LINE_QUANTITY = 2**31 - 1
MAX_TIERS = 25
# Why a close holds an invoice for an operator: a usage line or its total beyond one PaymentIntent (decision 0217).
HOLD_AMOUNT_TOO_LARGE = "amount_too_large"
# An identifier's guard row is kept at least this long after it was taken (Stripe: at least 24 hours), and at least
# the grace window plus the 5 minutes an event may be ahead, so an event re-sent with its own timestamp after its
# row is pruned is refused as too old (decision 0219).
IDENTIFIER_RETENTION_MIN = timedelta(hours=24)
IDENTIFIER_PRUNE_BATCH = 10_000


# -- Meters ---------------------------------------------------------------------------------


def create_meter(
    *,
    tenant_id: str,
    livemode: bool,
    display_name: str,
    event_name: str,
    formula: str,
    customer_key: str = "stripe_customer_id",
    value_key: str = "value",
) -> Meter:
    """Create a meter (Stripe's ``POST /v1/billing/meters``) and emit ``billing.meter.created``; one per
    ``event_name`` in the tenant and mode.

    Raises :class:`InvalidRequestError` ``meter_event_name_taken`` when another meter has the event name.
    """
    try:
        with transaction.atomic():
            meter = Meter.objects.create(
                tenant_id=tenant_id,
                livemode=livemode,
                display_name=display_name,
                event_name=event_name,
                formula=Meter.Formula(formula),
                customer_key=customer_key,
                value_key=value_key,
            )
            emit_for(meter, "billing.meter.created", meter_data(meter))
            return meter
    except IntegrityError as exc:
        raise InvalidRequestError(
            f"A meter for event_name '{event_name}' exists already.", code="meter_event_name_taken", param="event_name"
        ) from exc


# -- Metered prices ---------------------------------------------------------------------------


def validate_usage_terms(
    *,
    tenant_id: str,
    livemode: bool,
    amount: int,
    recurring: dict | None,
    billing_scheme: str,
    tiers_mode: str,
    tiers: list[dict] | None,
    transform_quantity: dict | None,
) -> dict:
    """The usage columns of a new price (``usage_type``, ``meter``, ``billing_scheme``, ``tiers_mode``, ``tiers``,
    ``transform_divide_by``, ``transform_round``), after checking Stripe's rules.

    ``tiered`` needs ``tiers_mode`` and 1..25 tiers with strictly ascending integer ``up_to``, the last
    ``"inf"`` (stored as None), each ``unit_amount`` and ``flat_amount`` minor units (0..``MAX_AMOUNT``), and
    an ``amount`` of 0; ``transform_quantity`` (``divide_by`` ≥ 1, ``round`` up or down) only with
    ``per_unit``. A metered price names a meter of the tenant and mode. Raises :class:`InvalidRequestError`.
    """
    recurring = recurring or {}
    usage_type = recurring.get("usage_type", Price.LICENSED)
    meter = None
    if usage_type == Price.METERED:
        meter = Meter.objects.filter(tenant_id=tenant_id, livemode=livemode, pk=recurring.get("meter") or "").first()
        if meter is None:
            raise InvalidRequestError(
                "A metered price needs recurring.meter, a meter of this tenant and mode.",
                code="meter_invalid",
                param="recurring.meter",
            )
    elif recurring.get("meter"):
        raise InvalidRequestError(
            "recurring.meter is for metered prices only.", code="meter_invalid", param="recurring.meter"
        )
    columns = {
        "usage_type": usage_type,
        "meter": meter,
        "billing_scheme": billing_scheme,
        "tiers_mode": "",
        "tiers": None,
        "transform_divide_by": None,
        "transform_round": "",
    }
    if billing_scheme == Price.TIERED:
        if transform_quantity:
            raise InvalidRequestError(
                "transform_quantity cannot be used with tiered prices.",
                code="transform_quantity_invalid",
                param="transform_quantity",
            )
        columns["tiers_mode"] = tiers_mode
        columns["tiers"] = _checked_tiers(tiers, tiers_mode, amount)
    else:
        if tiers or tiers_mode:
            raise InvalidRequestError(
                "tiers and tiers_mode need billing_scheme=tiered.", code="tiers_invalid", param="tiers"
            )
        if transform_quantity:
            columns["transform_divide_by"] = transform_quantity["divide_by"]
            columns["transform_round"] = transform_quantity["round"]
    return columns


def _checked_tiers(tiers: list[dict] | None, tiers_mode: str, amount: int) -> list[dict]:
    if tiers_mode not in (Price.GRADUATED, Price.VOLUME):
        raise InvalidRequestError(
            "tiered prices need tiers_mode graduated or volume.", code="tiers_invalid", param="tiers_mode"
        )
    if amount:
        raise InvalidRequestError(
            "A tiered price's amount must be 0: its tiers give the amounts.", code="tiers_invalid", param="amount"
        )
    if not tiers or len(tiers) > MAX_TIERS:
        raise InvalidRequestError(f"tiers needs 1 to {MAX_TIERS} tiers.", code="tiers_invalid", param="tiers")
    checked, previous = [], 0
    for index, tier in enumerate(tiers):
        last = index == len(tiers) - 1
        up_to = tier["up_to"]
        if last != (up_to == "inf"):
            raise InvalidRequestError(
                'Only the last tier, and it always, has up_to "inf".', code="tiers_invalid", param=f"tiers[{index}]"
            )
        if not last and (isinstance(up_to, bool) or not isinstance(up_to, int) or up_to <= previous):
            raise InvalidRequestError(
                "up_to must be integers in strictly ascending order.", code="tiers_invalid", param=f"tiers[{index}]"
            )
        checked.append(
            {
                "up_to": None if last else up_to,
                "unit_amount": tier.get("unit_amount", 0),
                "flat_amount": tier.get("flat_amount", 0),
            }
        )
        previous = up_to if not last else previous
    return checked


def billed_quantity(price: Price, quantity: int) -> int:
    """The quantity a price charges for ``quantity`` units of usage: ``transform_quantity`` applied (Stripe's
    package pricing: ``quantity / divide_by`` rounded ``up`` or ``down``), else ``quantity`` itself."""
    if not price.transform_divide_by:
        return quantity
    whole, rest = divmod(quantity, price.transform_divide_by)
    return whole + (1 if rest and price.transform_round == "up" else 0)


def usage_amount(price: Price, quantity: int) -> int:
    """What ``quantity`` units (≥ 0) of usage cost under ``price``, in minor units of its currency.

    ``per_unit``: billed quantity (:func:`billed_quantity`) × ``amount``. ``tiered`` (Stripe's rules):
    ``graduated`` charges each tier's units at its ``unit_amount`` plus the ``flat_amount`` of each tier
    the quantity reaches; ``volume`` charges every unit at the ``unit_amount`` of the tier the whole
    quantity falls in (the first whose ``up_to`` ≥ quantity) plus that tier's ``flat_amount``. No usage
    costs nothing (docs/decisions/0166).
    """
    if quantity <= 0:
        return 0
    if price.billing_scheme != Price.TIERED:
        return billed_quantity(price, quantity) * price.amount
    if price.tiers_mode == Price.VOLUME:
        for tier in price.tiers:
            if tier["up_to"] is None or quantity <= tier["up_to"]:
                return quantity * tier["unit_amount"] + tier["flat_amount"]
    total, below = 0, 0
    for tier in price.tiers:
        top = quantity if tier["up_to"] is None else min(quantity, tier["up_to"])
        if top <= below:
            break
        total += (top - below) * tier["unit_amount"] + tier["flat_amount"]
        below = top
    return total


# -- Usage lines of a close -------------------------------------------------------------------


def usage_period(sub: Subscription) -> tuple[datetime, datetime] | None:
    """The period whose usage the close of ``sub``'s period ``periods_billed`` bills: the one before it, or
    None for the first period (billed in advance, it has no usage behind it). ``sub.price`` must be loaded."""
    if sub.periods_billed == 0:
        return None
    price = sub.price
    return period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed - 1)


def usage_lines_for(closes: list[tuple[Subscription, list[SubscriptionItem]]]) -> dict[str, list[InvoiceLineItem]]:
    """The unsaved usage lines of each close ``(subscription, its items with prices)``, keyed by subscription id.

    One line per metered item: its meter's quantity over the customer's events of :func:`usage_period`,
    priced by :func:`usage_amount`; aggregated for all of ``closes`` at once
    (:func:`billing.queries.aggregate_usage`: one statement, and one more per large window, decision 0230).
    Subscriptions without metered items, or on their first period, get no lines, except a first period of
    metered items only: one line of no usage per item, over that period (docs/decisions/0166). Call it inside
    the transaction that writes the invoice.
    """
    wanted, found = [], {}
    lines: dict[str, list[InvoiceLineItem]] = {}
    for sub, items in closes:
        metered = [item for item in items if item.price.is_metered]
        if not metered:
            continue
        window = usage_period(sub)
        if window is None:
            if len(metered) == len(items):
                # A first invoice of metered items only: a line of no usage for each (an invoice has lines).
                price = sub.price
                own = period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, sub.periods_billed)
                lines[sub.id] = [usage_line(item.price, item.id, 0, *own) for item in metered]
            continue
        found[sub.id] = (window, metered)
        wanted += [(item.id, sub.customer_id, item.price.meter_id, *item_window(item, *window)) for item in metered]
    quantities = aggregate_usage(wanted)
    for sub_id, ((start, end), metered) in found.items():
        lines[sub_id] = [
            usage_line(item.price, item.id, quantities.get(item.id, 0), *item_window(item, start, end))
            for item in metered
        ]
    return lines


def usage_before_schedule_locked(sub: Subscription) -> list[InvoiceLineItem] | None:
    """The usage lines the close of ``sub`` (locked, price loaded) bills with the items it has now, taken before its
    scheduled change replaces them; None for a first period (no usage behind it: the close bills the new items).

    A change scheduled for the period's end takes effect at the boundary the close bills the usage up to, so
    the usage of the period that ended is its old items' and prices' (docs/decisions/0173).
    """
    if usage_period(sub) is None:
        return None
    items = list(SubscriptionItem.objects.filter(subscription=sub).select_related("price").order_by("created_at", "id"))
    return usage_lines_for([(sub, items)]).get(sub.id, [])


def item_window(item: SubscriptionItem, start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """``[start, end)`` cut to begin at the item's ``usage_since`` (what a change billed already, or the instant
    the item was added), empty (start = end) when that is past ``end`` (docs/decisions/0170)."""
    if item.usage_since is not None and item.usage_since > start:
        start = min(item.usage_since, end)
    return start, end


def unbilled_usage_start(sub: Subscription) -> datetime:
    """The start of the usage ``sub`` (price loaded) has not billed yet: the period the next close bills the usage
    of (the one before ``periods_billed``), or the first period while none has been closed."""
    price = sub.price
    return period_bounds(
        sub.billing_cycle_anchor, price.interval, price.interval_count, max(sub.periods_billed - 1, 0)
    )[0]


def usage_until_locked(sub: Subscription, items: list[SubscriptionItem], at: datetime) -> list[InvoiceLineItem]:
    """The unsaved usage lines of ``items`` (metered ones; others are skipped) of ``sub`` (locked, price loaded) from
    :func:`unbilled_usage_start` (or each item's ``usage_since``) up to ``at``, and the cutoff recorded.

    For a change that removes or re-prices a metered item and for an immediate cancel (Stripe bills the usage
    accrued up to the change). Takes :func:`billing.queries.usage_hold_locked` first (before any customer row
    lock), aggregates with :func:`billing.queries.aggregate_usage`, and sets the customer's
    ``usage_billed_until[meter]`` to ``at``: an event timestamped before ``at`` arriving later is refused
    (``timestamp_too_old``), so each event is billed once, here or by a close, or refused (docs/decisions/0170).
    Lines of no usage are left out.
    """
    metered = [item for item in items if item.price.is_metered]
    start = unbilled_usage_start(sub)
    if not metered or at <= max(start, sub.billing_cycle_anchor):
        return []
    queries.usage_hold_locked()
    windows = {item.id: item_window(item, start, at) for item in metered}
    quantities = aggregate_usage(
        [(item.id, sub.customer_id, item.price.meter_id, *windows[item.id]) for item in metered]
    )
    billed = dict(Customer.objects.filter(pk=sub.customer_id).values_list("usage_billed_until", flat=True).get())
    for item in metered:
        previous = billed.get(item.price.meter_id)
        if previous is None or isoparse(previous) < at:
            billed[item.price.meter_id] = at.isoformat()
    Customer.objects.filter(pk=sub.customer_id).update(usage_billed_until=billed)
    lines = [
        usage_line(item.price, item.id, quantities.get(item.id, 0), *windows[item.id])
        for item in metered
        if windows[item.id][0] < at
    ]
    if hold_reason(lines):
        # A change is a request: refused whole (nothing written), where a close holds its invoice instead (0217).
        raise InvalidRequestError(
            f"The usage to bill up to this change comes to more than {MAX_AMOUNT:,} (minor units), more than one "
            "payment can take; an operator has to settle it first.",
            code="usage_amount_too_large",
        )
    return [line for line in lines if line.amount != 0]


def usage_line(price: Price, item_id: str, quantity: int, start: datetime, end: datetime) -> InvoiceLineItem:
    """The unsaved line billing ``quantity`` units of ``price``'s meter over ``[start, end)``.

    The amount is computed exactly (Python integers; the quantity is PostgreSQL's ``numeric`` sum). One above
    ``MAX_AMOUNT``, more than a PaymentIntent can take and possibly more than the ``bigint`` column holds, is
    not stored: the line's ``amount`` is 0, its description states the exact amount, and ``line.oversized`` holds
    it, so :func:`hold_reason` holds the invoice for an operator (decision 0217).
    """
    name = price.nickname or "Usage"
    amount = usage_amount(price, quantity)
    description = f"{quantity:,} × {name} usage ({_day(start)} – {_day(end)})"
    oversized = amount > MAX_AMOUNT
    if oversized:
        description += f": {amount:,} {price.currency.upper()} minor units, beyond {MAX_AMOUNT:,}; held for review"
    line = InvoiceLineItem(
        description=description[:500],
        price_id=price.id,
        quantity=min(quantity, MAX_LINE_QUANTITY),
        amount=0 if oversized else amount,
        currency=price.currency,
        period_start=start,
        period_end=end,
        subscription_item=item_id,
    )
    line.oversized = amount if oversized else None
    return line


def hold_reason(lines: list[InvoiceLineItem]) -> str:
    """``HOLD_AMOUNT_TOO_LARGE`` when one of ``lines`` (unsaved, as :func:`usage_line` and the period's lines make
    them) is oversized or their sum is above ``MAX_AMOUNT``: no PaymentIntent could take the invoice; else ``""``."""
    if any(getattr(line, "oversized", None) for line in lines) or sum(line.amount for line in lines) > MAX_AMOUNT:
        return HOLD_AMOUNT_TOO_LARGE
    return ""


def _day(at: datetime) -> str:
    return f"{at:%b} {at.day}, {at.year}"


def bill_final_usage_locked(sub: Subscription, now: datetime, *, finalize) -> Invoice | None:
    """A subscription canceled at its period's end (locked, in the close that cancels it): its final invoice,
    of the usage of the period that just ended, created and finalised; None when there is nothing to bill.

    Stripe bills a canceled subscription's last usage on a final invoice. This one has
    ``billing_reason=subscription_update`` and the period of the usage, and the UNIQUE ``change_key``
    ``final_usage:<subscription>:<period start>``, so a re-run of the close makes none a second time; it
    is charged by the reconciler's pass over open ``subscription_update`` invoices without an attempt
    (docs/decisions/0167). ``finalize`` is :func:`billing.services.close.finalize_or_pend_locked`
    (passed in: the close imports this module). No usage (an amount of 0) makes no invoice.
    """
    items = list(SubscriptionItem.objects.filter(subscription=sub).select_related("price").order_by("created_at", "id"))
    window = usage_period(sub)
    if window is None:
        return None
    lines = usage_lines_for([(sub, items)]).get(sub.id, [])
    return final_usage_invoice_locked(sub, lines, window, now, finalize=finalize)


def final_usage_invoice_locked(
    sub: Subscription, lines: list[InvoiceLineItem], window: tuple[datetime, datetime], now: datetime, *, finalize
) -> Invoice | None:
    """The final invoice of ``lines`` (unsaved usage lines of ``sub``, locked) over ``window``, created and finalised
    by ``finalize``; None when they cost nothing or the invoice of that window exists (its UNIQUE ``change_key``
    ``final_usage:<subscription>:<window start>``). Charged by the reconciler (docs/decisions/0167, 0170)."""
    amount = sum(line.amount for line in lines)
    held = hold_reason(lines)
    if amount == 0 and not held:
        return None
    invoice = Invoice(
        tenant_id=sub.tenant_id,
        livemode=sub.livemode,
        customer_id=sub.customer_id,
        subscription_id=sub.id,
        status=Invoice.DRAFT,
        billing_reason=Invoice.UPDATE,
        change_key=f"final_usage:{sub.id}:{window[0].isoformat()}",
        currency=sub.price.currency,
        period_start=window[0],
        period_end=window[1],
        subtotal=amount,
        total=amount,
        amount_due=amount,
        created_at=now,
        hold_reason=held,
    )
    row = {f.column: f.get_db_prep_save(getattr(invoice, f.attname), connection) for f in Invoice._meta.concrete_fields}
    if not materialise_invoice(row):
        return None
    invoice._state.adding = False
    invoice._state.db = connection.alias
    for line in lines:
        line.invoice_id = invoice.id
    InvoiceLineItem.objects.bulk_create(lines)
    invoice_event(invoice, "invoice.created", lines=lines, created_at=now)
    if not held:  # a held draft waits for an operator (decision 0217)
        finalize(invoice, now=now, lines=lines)
    return invoice


# -- Meter events -----------------------------------------------------------------------------


@dataclass(slots=True)
class EventResult:
    """One event of a batch: ``accepted`` (stored now), ``duplicate`` (its identifier was stored before: not
    counted again) or ``refused`` (``error``: ``{"code", "message", "param"}``; nothing stored)."""

    index: int
    identifier: str | None
    status: str
    error: dict | None = None
    row: tuple | None = field(default=None, repr=False)
    livemode: bool = False

    @property
    def event(self) -> dict | None:
        """The stored ``billing.meter_event`` of an accepted event (built on demand: only the single endpoint
        answers with it, and building one per event cost a batch a tenth of its time; decision 0172)."""
        if self.row is None:
            return None
        event_name, payload, timestamp, created_at = self.row
        row = {
            "event_name": event_name,
            "identifier": self.identifier,
            "payload": payload,
            "timestamp": timestamp,
            "created_at": created_at,
        }
        return meter_event_data(row, self.livemode)

    def data(self) -> dict:
        """The JSON of one entry of the batch response."""
        return {"index": self.index, "identifier": self.identifier, "status": self.status, "error": self.error}


class _Refused(Exception):
    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.error = {"code": code, "message": message, "param": param}


def record_meter_events(*, tenant_id: str, livemode: bool, events: list) -> list[EventResult]:
    """Validate and store a batch of meter events (each ``{"event_name", "payload", "timestamp"?,
    "identifier"?}``); one :class:`EventResult` per event, in order.

    An event is refused (never silently dropped) for a bad shape, an unknown ``event_name`` (no meter),
    a payload without the meter's customer key naming a customer of the tenant and mode, a value that is
    not an integer 0..10⁹ (for ``sum``/``max``/``last`` meters; the counted property for
    ``unique_count``), or a timestamp more than 5 minutes ahead of, or more than the grace
    (``HARDCOUNT_USAGE_GRACE_S``) behind, the customer's billing time (its test clock's time, else the
    DB's clock once the insert holds the usage lock, :func:`billing.queries.ingest_time_locked`).
    ``timestamp``: unix seconds or ISO 8601, default the billing time; ``identifier`` defaults to a fresh
    one (the event's own id). The accepted events are inserted by one statement
    (:func:`billing.queries.insert_meter_events`); an identifier stored before is a ``duplicate``.
    What is the same for the whole batch (the meters, the customers, their clocks and cutoffs, the ids) is
    read or made once per batch, not per event (decision 0174).
    """
    results: list[EventResult] = []
    with transaction.atomic():
        now = ingest_time_locked()
        shaped = [_shape(index, raw) for index, raw in enumerate(events)]
        names = {s[0] for s in shaped if type(s) is tuple}
        meters = queries.ingest_meters(tenant_id, livemode, names)
        customer_ids = set()
        for s in shaped:
            if type(s) is tuple and s[0] in meters:
                value = s[1].get(meters[s[0]].customer_key)
                if type(value) is str:
                    customer_ids.add(value)
        customers = queries.ingest_customers(tenant_id, livemode, customer_ids)
        clock_times = _clock_times_shared({clock for clock, _ in customers.values() if clock})
        grace = timedelta(seconds=settings.HARDCOUNT_USAGE_GRACE_S)
        ids = iter(new_ids("mev", len(shaped)))
        # A customer's cutoffs per meter (decision 0170), parsed once per batch.
        cutoffs: dict[tuple[str, str], tuple[datetime, str] | None] = {}
        rows, seen = [], set()
        for index, s in enumerate(shaped):
            if type(s) is not tuple:
                results.append(s)
                continue
            event_name, payload, timestamp, identifier = s
            try:
                meter = meters.get(event_name)
                if meter is None:
                    raise _Refused("meter_not_found", f"No meter for event_name '{event_name}'.", "event_name")
                customer_id = payload.get(meter.customer_key)
                customer = customers.get(customer_id) if type(customer_id) is str else None
                if customer is None:
                    raise _Refused(
                        "customer_not_found",
                        f"payload.{meter.customer_key} must be the id of a customer of this tenant and mode.",
                        f"payload.{meter.customer_key}",
                    )
                value = _value(meter, payload)
                clock, billed = customer
                at = clock_times.get(clock, now) if clock else now
                if timestamp is not None:
                    if timestamp > at + FUTURE_SKEW:
                        raise _Refused(
                            "timestamp_in_future", "timestamp is more than 5 minutes in the future.", "timestamp"
                        )
                    if timestamp < at - grace:
                        raise _Refused(
                            "timestamp_too_old",
                            f"timestamp is older than the grace window ({grace.total_seconds():.0f} s): "
                            "its period's usage may be billed already.",
                            "timestamp",
                        )
                if billed:
                    key = (customer_id, meter.id)
                    if key not in cutoffs:
                        billed_until = json.loads(billed).get(meter.id)
                        cutoffs[key] = None if billed_until is None else (isoparse(billed_until), billed_until)
                    cutoff = cutoffs[key]
                    if cutoff is not None and (timestamp or at) < cutoff[0]:
                        raise _Refused(
                            "timestamp_too_old",
                            f"timestamp is before {cutoff[1]}: this customer's usage of the meter up to then "
                            "has been billed.",
                            "timestamp",
                        )
            except _Refused as refused:
                results.append(EventResult(index, identifier, "refused", refused.error))
                continue
            event_id = next(ids)
            identifier = identifier or event_id
            if identifier in seen:
                results.append(EventResult(index, identifier, "duplicate"))
                continue
            seen.add(identifier)
            # The billing time, the default of both instants, is the statement's parameter: sent once, not per row.
            row = (event_id, identifier, event_name, customer_id, value, payload)
            if timestamp is not None or clock:
                row += (timestamp and timestamp.isoformat(), at.isoformat() if clock else None)
            rows.append(row)
            stored = (event_name, payload, timestamp or at, at)
            results.append(EventResult(index, identifier, "accepted", None, stored, livemode))
        stored_before = insert_meter_events(tenant_id=tenant_id, livemode=livemode, rows=rows, now=now)
        if stored_before:
            for result in results:
                if result.status == "accepted" and result.identifier in stored_before:
                    result.status, result.row = "duplicate", None
    return results


def _clock_times_shared(clock_ids: set[str]) -> dict[str, datetime]:
    """The test clocks' times, each clock row held ``FOR SHARE`` until commit: an advance (which updates the
    row first) waits for this batch, so its drain sees every event accepted at the old time."""
    if not clock_ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, frozen_time FROM billing_testclock WHERE id = ANY(%s) ORDER BY id FOR SHARE",
            [sorted(clock_ids)],
        )
        return dict(cursor.fetchall())


_EVENT_KEYS = frozenset(("event_name", "payload", "timestamp", "identifier"))
# The integers of at most 500 characters, the sign included.
_INT_LOW, _INT_HIGH = -(10**499), 10**500


def _shape(index: int, raw) -> tuple | EventResult:
    """An event's fields checked on their own: ``(event_name, payload, timestamp or None, identifier or None)``,
    or its refusal.

    A well-formed event, the usual case, is recognised by one conjunction of exact-type checks; anything else
    (including every event this refuses) goes through :func:`_shape_checked`, which names the first fault. Both
    accept exactly the same events (decision 0229; ``tests/billing/test_usage.py`` holds the two to each other).
    """
    if type(raw) is dict and _EVENT_KEYS.issuperset(raw):
        name = raw.get("event_name")
        payload = raw.get("payload")
        identifier = raw.get("identifier", _ABSENT)
        given = raw.get("timestamp")
        timestamp = None if given is None else _timestamp(given)
        if (
            _plain_name(name)
            and type(payload) is dict
            and (identifier is _ABSENT or _plain_name(identifier))
            and (timestamp is not None or given is None)
        ):
            payload = _checked_payload(payload)
            if payload is not None:
                return (name, payload, timestamp, None if identifier is _ABSENT else identifier)
    return _shape_checked(index, raw)


_ABSENT = object()


def _plain_name(value) -> bool:
    """A string of 1 to 100 ASCII characters without NUL: an ``event_name`` or ``identifier`` that needs no
    further check (a longer check of other text is :func:`_shape_checked`'s)."""
    return type(value) is str and 0 < len(value) <= 100 and value.isascii() and "\x00" not in value


def _shape_checked(index: int, raw) -> tuple | EventResult:
    """:func:`_shape`'s every case, each fault checked in turn and the first one refused."""
    identifier = raw.get("identifier") if isinstance(raw, dict) else None
    # Echoed in the batch's results: text that cannot be stored cannot be rendered back either (a lone surrogate).
    # _storable, not storable_text: ASCII, the usual case, is known storable without encoding it (decision 0215).
    storable_identifier = isinstance(identifier, str) and _storable(identifier)
    identifier = identifier if storable_identifier else None

    def refused(code: str, message: str, param: str) -> EventResult:
        return EventResult(index, identifier, "refused", {"code": code, "message": message, "param": param})

    if not isinstance(raw, dict):
        return refused("parameter_invalid", "An event must be a JSON object.", "")
    if not raw.keys() <= _EVENT_KEYS:
        return refused("parameter_unknown", "Unknown parameter.", sorted(set(raw) - _EVENT_KEYS)[0])
    name = raw.get("event_name")
    if not isinstance(name, str) or not 1 <= len(name) <= 100 or not _storable(name):
        return refused(
            "parameter_invalid", "event_name must be a string of 1 to 100 characters (no NUL).", "event_name"
        )
    payload = raw.get("payload")
    payload = _checked_payload(payload) if isinstance(payload, dict) else None
    if payload is None:
        return refused(
            "parameter_invalid",
            "payload must be an object of up to 50 string or integer values (text without NUL characters).",
            "payload",
        )
    if "identifier" in raw and not (storable_identifier and 1 <= len(identifier) <= 100):
        return refused(
            "parameter_invalid", "identifier must be a string of 1 to 100 characters (no NUL).", "identifier"
        )
    timestamp = None
    if raw.get("timestamp") is not None:
        timestamp = _timestamp(raw["timestamp"])
        if timestamp is None:
            # A string shaped like a date-time that names no representable instant (year 0, a leap second).
            code = "timestamp_out_of_range" if isinstance(raw["timestamp"], str) else "parameter_invalid"
            return refused(code, "timestamp must be unix seconds or ISO 8601 with a zone.", "timestamp")
    return (name, payload, timestamp, identifier)


def _checked_payload(payload: dict) -> dict | None:
    """``payload`` with its integral numbers as ``int`` (:func:`_json_integer`), or None unless it has at most 50
    keys of up to 100 characters, each value a string or integer of up to 500 characters, all text storable
    (:func:`hardcount.errors.storable_text`). One pass; ASCII text, the usual case, needs no encoding to check.
    The same dict is returned when nothing needs converting (the usual case): a copy per event cost a batch of
    1,000 about half a millisecond (decision 0229)."""
    if len(payload) > 50:
        return None
    converted = None
    for key, value in payload.items():
        if type(key) is not str or len(key) > 100 or not _storable(key):
            return None
        # Exact types (what the JSON parser makes; a bool is not an int here): cheaper than isinstance of a union.
        kind = type(value)
        if kind is str:
            if len(value) > 500 or not _storable(value):
                return None
        elif kind is int:
            if not _INT_LOW < value < _INT_HIGH:  # len(str(value)) <= 500, its sign included
                return None
        elif kind is float and value.is_integer() and _INT_LOW < int(value) < _INT_HIGH:
            if converted is None:
                converted = {}
            converted[key] = int(value)
        else:
            return None
    # Updating keys keeps their places, so the stored payload keeps the sender's order.
    return payload if converted is None else {**payload, **converted}


def _storable(text: str) -> bool:
    return "\x00" not in text and (text.isascii() or storable_text(text))


def _json_integer(value):
    """``value`` as an ``int`` when JSON Schema calls it an integer (``5`` and ``5.0`` alike), else ``value``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _timestamp(value) -> datetime | None:
    value = _json_integer(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= 253402300799:
            return None
        return datetime.fromtimestamp(value, tz=UTC)
    if isinstance(value, str):
        try:
            parsed = isoparse(value)
            # An offset can carry a valid local time out of datetime's range (9999-12-31T23:59:59-14:00).
            return parsed.astimezone(UTC) if parsed.tzinfo else None
        except (ValueError, OverflowError):
            return None
    return None


_COUNT, _UNIQUE_COUNT = Meter.Formula.COUNT.value, Meter.Formula.UNIQUE_COUNT.value


def _value(meter: queries.IngestMeter, payload: dict) -> int | None:
    """The stored value of an event for ``meter``: an integer 0..10⁹ under its value key (None for ``count``
    and ``unique_count``, which need no value; ``unique_count`` needs the property present)."""
    raw = payload.get(meter.value_key)
    formula = meter.formula
    # Plain strings: an enum member read through its class costs a microsecond, twice per event.
    if formula == _COUNT:
        return None
    if formula == _UNIQUE_COUNT:
        if raw is None or raw == "":
            raise _Refused("value_missing", f"payload.{meter.value_key} is required.", f"payload.{meter.value_key}")
        return None
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        raw = int(raw)
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= MAX_EVENT_VALUE:
        raise _Refused(
            "value_invalid",
            f"payload.{meter.value_key} must be an integer from 0 to {MAX_EVENT_VALUE}.",
            f"payload.{meter.value_key}",
        )
    return raw


def meter_event_data(row: dict, livemode: bool) -> dict:
    """Stripe's ``billing.meter_event`` object of a stored event row."""
    return {
        "object": "billing.meter_event",
        "event_name": row["event_name"],
        "identifier": row["identifier"],
        "livemode": livemode,
        "payload": json.loads(row["payload"]) if isinstance(row["payload"], str) else row["payload"],
        "timestamp": iso(row["timestamp"]),
        "created": iso(row["created_at"]),
    }


def event_summaries(meter: Meter, customer_id: str, start: datetime, end: datetime, *, by_day: bool) -> list[dict]:
    """Stripe's ``billing.meter_event_summary`` objects of a customer's usage of ``meter`` in ``[start, end)``: one
    for the whole range, or (``by_day``) one per UTC day with events, each clipped to the range."""
    rows = queries.event_summaries(meter.id, customer_id, start, end, by_day=by_day)
    if not by_day and not rows:
        rows = [(None, 0)]
    return [
        {
            "object": "billing.meter_event_summary",
            "meter": meter.id,
            "customer": customer_id,
            "aggregated_value": value,
            "start_time": iso(max(day, start) if day else start),
            "end_time": iso(min(day + timedelta(days=1), end) if day else end),
        }
        for day, value in rows
    ]


def stored_event(*, tenant_id: str, livemode: bool, identifier: str) -> dict | None:
    """The ``billing.meter_event`` stored under ``identifier`` in the tenant and mode, or None."""
    guard = MeterEventIdentifier.objects.filter(tenant_id=tenant_id, livemode=livemode, identifier=identifier).first()
    if guard is None:
        return None
    event = MeterEvent.objects.filter(timestamp=guard.event_timestamp, id=guard.event_id).values().first()
    return None if event is None else meter_event_data(event, livemode)


def identifier_retention() -> timedelta:
    """How long an identifier's guard row is kept after it was taken: ``IDENTIFIER_RETENTION_MIN`` (Stripe keeps an
    identifier unique for at least 24 hours) or the grace window plus ``FUTURE_SKEW``, whichever is longer, plus an
    hour for clock drift between the processes that make ids and the database (decision 0219)."""
    grace = timedelta(seconds=settings.HARDCOUNT_USAGE_GRACE_S) + FUTURE_SKEW
    return max(IDENTIFIER_RETENTION_MIN, grace) + timedelta(hours=1)


def prune_identifiers(*, fence: Fence = NO_FENCE, batch: int = IDENTIFIER_PRUNE_BATCH, on_batch=None) -> int:
    """Delete the meter events' guard rows taken (``created_at``, the database's clock) more than
    :func:`identifier_retention` ago, in fenced transactions of at most ``batch`` rows (oldest first, by their
    index); the number deleted. The events stay: only a retry's de-duplication after that long is given up,
    as Stripe does after 24 hours. Raises :class:`hardcount.fencing.LeaseLost` when the fence refuses."""
    pruned = 0
    while fence.alive():
        with transaction.atomic():
            fence.check()
            deleted = queries.prune_meter_event_identifiers(identifier_retention(), batch)
        pruned += deleted
        if on_batch:
            on_batch()
        if deleted < batch:
            break
    return pruned
