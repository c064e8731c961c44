"""The subscription list at 1,000 and at 100,000 subscriptions: same queries, flat time, bounded rows read.

Rows are bulk-inserted with ``generate_series`` (:mod:`tests.admin.bulk`) and analysed, as
autovacuum would. The figures are printed; the test asserts the query count is the same at
both sizes and that no statement reads the table through (rows read stay within a few times the
count cap, whatever the table's size) — never a time.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from billing.models import Price
from hardcount.admin import COUNT_CAP
from hardcount.models import Tenant
from tests.admin.bulk import bulk_subscriptions

pytestmark = pytest.mark.django_db

SUBSCRIPTIONS = reverse("admin:billing_subscription_changelist")
PAGES = {
    "all": {},
    "parked": {"billing_state": "parked"},
    "waiting, test mode": {"billing_state": "waiting", "mode": "test"},
    "canceled": {"status__exact": "canceled"},
    "one tenant": {"tenant__id__exact": "{tenant}"},
    "search by email": {"q": "BULK77@example.com"},
    "page 20": {"p": "20"},
}
REPEATS = 3


def _rows_read(sql: str, params) -> int:
    """Rows the statement's scans of billing_subscription produced or filtered out (EXPLAIN ANALYZE)."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node) -> int:
        here = 0
        if node.get("Relation Name") == "billing_subscription":
            here = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        return here + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan[0]["Plan"])


def _measure(client, params: dict) -> tuple[int, float, int]:
    """(queries, median ms, most rows one statement read) of the list page with ``params``."""
    client.get(SUBSCRIPTIONS, params)  # warm: session, templates
    elapsed = []
    for _ in range(REPEATS):
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            response = client.get(SUBSCRIPTIONS, params)
            elapsed.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
    subscription_sql = [q["sql"] for q in ctx.captured_queries if "billing_subscription" in q["sql"]]
    for sql in subscription_sql:
        if "COUNT(" in sql.upper():
            assert "LIMIT" in sql.upper(), f"uncapped count: {sql}"
    most = max(_rows_read(sql, None) for sql in subscription_sql)
    return len(ctx.captured_queries), statistics.median(elapsed), most


def test_subscription_list_query_count_and_time_stay_flat_from_1k_to_100k(operator, capsys):
    tenants = (Tenant.objects.create(name="Bulk A"), Tenant.objects.create(name="Bulk B"))
    prices = {
        livemode: Price.objects.create(
            tenant=tenants[0], livemode=livemode, amount=1000, currency="usd", interval="month"
        ).pk
        for livemode in (True, False)
    }
    ids = (tenants[0].pk, tenants[1].pk)
    pages = {name: {k: v.format(tenant=ids[1]) for k, v in params.items()} for name, params in PAGES.items()}

    bulk_subscriptions(1, 1_000, tenant_ids=ids, price_ids=prices)
    small = {name: _measure(operator, params) for name, params in pages.items()}
    started = time.perf_counter()
    bulk_subscriptions(1_001, 100_000, tenant_ids=ids, price_ids=prices)
    seeded_s = time.perf_counter() - started
    large = {name: _measure(operator, params) for name, params in pages.items()}

    with capsys.disabled():
        print(f"\nsubscription admin list, 1k vs 100k subscriptions (99k rows seeded in {seeded_s:.1f} s)")
        print(f"{'page':<20} {'queries':>9} {'median ms':>17} {'max rows read':>19}")
        for name in pages:
            (q1, t1, r1), (q2, t2, r2) = small[name], large[name]
            print(f"{name:<20} {q1:>4} {q2:>4} {t1:>8.1f} {t2:>8.1f} {r1:>9} {r2:>9}")
    for name in pages:
        assert small[name][0] == large[name][0], name
        # No statement reads the table through, as a full COUNT(*) or an unindexed filter would (100,000
        # rows): the count stops at COUNT_CAP matches, the page at its 50 (plus the rows a filter skips).
        assert large[name][2] <= 3 * COUNT_CAP, name
