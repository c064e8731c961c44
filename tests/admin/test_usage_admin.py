"""The console's usage panels: a customer's usage per meter and billing period, and an invoice's usage lines, against
hand-computed quantities; both computed by the aggregation statement, with no meter event read into Python."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from billing.models import Invoice
from billing.services import usage
from billing.services.catalog import create_price, create_subscription
from tests.clocks.helpers import advance, make_clock

T0 = datetime(2027, 1, 1, tzinfo=UTC)
FEB = datetime(2027, 2, 1, tzinfo=UTC)


def _event(customer, value, at=None):
    event = {"event_name": "api_calls", "payload": {"stripe_customer_id": customer.id, "value": str(value)}}
    if at is not None:
        event["timestamp"] = int(at.timestamp())
    return event


def _book(book):
    """1,000 licensed + 3 cents a unit of a ``sum`` meter, on a clock from Jan 1 2027: 40 units in January, billed by
    February's invoice; 5 units in February so far. Another customer's 1,000 units of the same meter beside it."""
    tenant = book.tenant()
    clock = make_clock(tenant, T0)
    customer, other = book.customer(tenant, clock=clock), book.customer(tenant, clock=clock)
    meter = usage.create_meter(
        tenant_id=tenant.id, livemode=False, display_name="API calls", event_name="api_calls", formula="sum"
    )
    metered = create_price(
        tenant_id=tenant.id,
        livemode=False,
        amount=3,
        currency="usd",
        interval="month",
        nickname="Calls",
        recurring={"usage_type": "metered", "meter": meter.id},
    )
    licensed = create_price(tenant_id=tenant.id, livemode=False, amount=1000, currency="usd", interval="month")
    sub = create_subscription(
        tenant_id=tenant.id,
        livemode=False,
        customer_id=customer.id,
        items=[{"price": licensed.id, "quantity": 1}, {"price": metered.id, "quantity": 1}],
    )
    advance(clock, T0 + timedelta(hours=1))
    ingest = lambda events: usage.record_meter_events(tenant_id=tenant.id, livemode=False, events=events)  # noqa: E731
    ingest([_event(customer, 25), _event(other, 1000)])
    advance(clock, datetime(2027, 1, 20, tzinfo=UTC))
    ingest([_event(customer, 15)])
    advance(clock, FEB + timedelta(hours=2))
    ingest([_event(customer, 5)])  # February's, not billed yet
    return customer, sub, meter, Invoice.objects.get(subscription=sub, period_start=FEB)


def _cells(html: str, heading: str) -> list[list[str]]:
    """The rows of the usage table after ``heading`` on a page, as text cells."""
    table = html[html.index(heading) :]
    table = table[table.index('<table class="usage">') : table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    return [[_text(cell) for cell in re.findall(r"<td>(.*?)</td>", row, re.S)] for row in rows]


def _text(cell: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", cell).split())


def _event_reads(queries) -> list[str]:
    return [q["sql"] for q in queries if "billing_meterevent" in q["sql"]]


def test_a_customers_page_shows_its_usage_per_meter_and_period_with_what_billed_it(book, operator):
    customer, sub, _meter, february = _book(book)
    with CaptureQueriesContext(connection) as queries:
        response = operator.get(reverse("admin:billing_customer_change", args=[customer.pk]))
    assert response.status_code == 200
    rows = _cells(response.content.decode(), "Usage by period:")
    meter_label = "API calls (sum of api_calls)"
    assert rows == [
        [sub.id, meter_label, "2027-02-01 00:00 UTC → 2027-03-01 00:00 UTC", "5", "not billed yet"],
        [
            sub.id,
            meter_label,
            "2027-01-01 00:00 UTC → 2027-02-01 00:00 UTC",
            "40",
            f"40 units, $1.20 on {february.number}",
        ],
    ]
    # One statement read the events, and it is the aggregation (no row of billing_meterevent reached Python).
    reads = _event_reads(queries.captured_queries)
    assert len(reads) == 1 and "WITH wanted AS" in reads[0] and "payload ->>" in reads[0]


def test_an_invoices_page_shows_its_usage_lines_beside_the_events_of_their_window(book, operator):
    _customer, sub, _meter, february = _book(book)
    with CaptureQueriesContext(connection) as queries:
        response = operator.get(reverse("admin:billing_invoice_change", args=[february.pk]))
    assert response.status_code == 200
    rows = _cells(response.content.decode(), "Usage lines:")
    assert rows == [
        ["API calls (sum of api_calls)", "2027-01-01 00:00 UTC → 2027-02-01 00:00 UTC", "40", "$1.20", "40"],
    ]
    reads = _event_reads(queries.captured_queries)
    assert len(reads) == 1 and "WITH wanted AS" in reads[0]

    # January's invoice (billed in advance, no usage) says so.
    january = Invoice.objects.get(subscription=sub, period_start=T0)
    page = operator.get(reverse("admin:billing_invoice_change", args=[january.pk])).content.decode()
    assert "No usage." in page
