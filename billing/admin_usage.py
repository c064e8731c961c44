"""The usage panels of the operators' console: a customer's usage by period, and an invoice's usage lines.

Every quantity is computed by PostgreSQL with the close's own aggregation statement
(:func:`billing.queries.usage_quantities`, one statement per page); no meter event is loaded into the
application. The quantities are read as committed now, without the close's barrier: a page never waits
for ingestion.
"""

from __future__ import annotations

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from billing.models import Customer, Invoice, InvoiceLineItem, Meter, Subscription, SubscriptionItem
from billing.periods import period_bounds
from billing.queries import usage_quantities
from billing.services.usage import item_window
from hardcount.admin import id_link, money, short_time

# The most recent periods shown per metered item, and subscriptions per customer: a page stays one statement
# of bounded size whatever the customer's history.
PERIODS_SHOWN = 12
SUBSCRIPTIONS_SHOWN = 20


def _meter_label(meter: Meter) -> str:
    return f"{meter.display_name} ({meter.formula} of {meter.event_name})"


def _table(head: tuple[str, ...], rows: list[tuple], empty: str) -> SafeString:
    if not rows:
        return format_html("<p>{}</p>", empty)
    header = format_html_join("", "<th>{}</th>", ((h,) for h in head))
    body = format_html_join(
        "", "<tr>{}</tr>", ((format_html_join("", "<td>{}</td>", ((cell,) for cell in row)),) for row in rows)
    )
    return format_html('<table class="usage"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>', header, body)


def customer_usage(customer: Customer) -> SafeString:
    """The customer's usage per meter and billing period of each metered item of its subscriptions (the last
    ``PERIODS_SHOWN`` periods, the one under way included), each with what the invoices billed for it.

    A row: subscription, meter, period, the meter's quantity over the item's window of that period
    (cut at the item's ``usage_since``), and the usage lines (quantity, amount, invoice) of the item
    within that period; ``not billed yet`` for the period under way and one awaiting its close.
    """
    subs = list(
        Subscription.objects.filter(customer=customer)
        .select_related("price")
        .order_by("-created_at", "-id")[:SUBSCRIPTIONS_SHOWN]
    )
    items = list(
        SubscriptionItem.objects.filter(subscription__in=subs, price__usage_type="metered")
        .select_related("price__meter")
        .order_by("subscription_id", "created_at", "id")
    )
    by_sub = {sub.id: sub for sub in subs}
    wanted, rows = [], []
    for item in items:
        sub = by_sub[item.subscription_id]
        price = sub.price
        last = max(sub.periods_billed - 1, 0)
        for n in range(max(last - PERIODS_SHOWN + 1, 0), last + 1):
            start, end = period_bounds(sub.billing_cycle_anchor, price.interval, price.interval_count, n)
            window = item_window(item, start, end)
            key = f"{item.id}:{n}"
            wanted.append((key, customer.id, item.price.meter_id, *window))
            rows.append((key, sub, item, start, end, window))
    quantities = usage_quantities([w for w in wanted if w[3] < w[4]])
    billed = _billed_lines([item.id for item in items])
    out = []
    for key, sub, item, start, end, window in reversed(rows):
        lines = [
            line
            for line in billed.get(item.id, [])
            if line.period_start >= start and line.period_end <= end and line.period_start < line.period_end
        ]
        out.append(
            (
                id_link(Subscription, sub.id),
                id_link(Meter, item.price.meter_id, text=_meter_label(item.price.meter)),
                f"{short_time(start)} → {short_time(end)}",
                f"{quantities.get(key, 0):,}" + ("" if window == (start, end) else f" (from {short_time(window[0])})"),
                _billed_cell(lines),
            )
        )
    return _table(
        ("subscription", "meter", "billing period", "usage", "billed"),
        out,
        "No metered items on this customer's subscriptions.",
    )


def _billed_lines(item_ids: list[str]) -> dict[str, list[InvoiceLineItem]]:
    found: dict[str, list[InvoiceLineItem]] = {}
    lines = (
        InvoiceLineItem.objects.filter(subscription_item__in=item_ids, price__usage_type="metered")
        .exclude(invoice__status=Invoice.VOID)
        .select_related("invoice")
        .order_by("period_start", "pk")
    )
    for line in lines:
        found.setdefault(line.subscription_item, []).append(line)
    return found


def _billed_cell(lines: list[InvoiceLineItem]) -> SafeString | str:
    if not lines:
        return "not billed yet"
    return format_html_join(
        mark_safe("<br>"),
        "{} units, {} on {}",
        (
            (
                f"{line.quantity:,}",
                money(line.amount, line.currency),
                id_link(Invoice, line.invoice_id, text=line.invoice.number or line.invoice_id),
            )
            for line in lines
        ),
    )


def invoice_usage(invoice: Invoice) -> SafeString:
    """The invoice's usage lines: meter, window, the quantity billed and its amount, and the meter's quantity over
    the same window as stored now (they agree: an event of a billed window is refused after its close)."""
    lines = list(
        InvoiceLineItem.objects.filter(invoice=invoice, price__usage_type="metered")
        .select_related("price__meter")
        .order_by("pk")
    )
    wanted = [
        (str(line.pk), invoice.customer_id, line.price.meter_id, line.period_start, line.period_end) for line in lines
    ]
    now = usage_quantities(wanted)
    rows = [
        (
            id_link(Meter, line.price.meter_id, text=_meter_label(line.price.meter)),
            f"{short_time(line.period_start)} → {short_time(line.period_end)}",
            f"{line.quantity:,}",
            money(line.amount, line.currency),
            _agreement(line.quantity, now.get(str(line.pk), 0)),
        )
        for line in lines
    ]
    return _table(("meter", "usage window", "billed quantity", "amount", "events in the window now"), rows, "No usage.")


def _agreement(billed: int, now: int) -> str:
    return f"{now:,}" if now == billed else f"{now:,} (differs from the billed {billed:,})"
