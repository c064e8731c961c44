"""The executor's claim still reads the due index, partition by partition, never a whole partition.

The claim has no predicate on the partition key (a delivery due now may have been made months ago),
so it does not prune: it merges the due index of every partition. That index is partial (pending and
retrying rows only), so a past month's is nearly empty and the current month's holds the queue. The
claim's UPDATE finds each claimed row by its primary key, one index probe per partition holding rows.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection

from outbox import queries
from tests.admin.bulk import insert_series

pytestmark = pytest.mark.django_db(transaction=True)


def scans(node, out):
    if "Relation Name" in node:
        out.append((node["Node Type"], node["Relation Name"], node.get("Index Name", "")))
    for child in node.get("Plans", []):
        scans(child, out)
    return out


def test_the_claim_reads_the_current_partitions_due_index(tenant):
    from hardcount.ids import new_id
    from outbox.models import Delivery, Event, WebhookEndpoint

    endpoint = WebhookEndpoint.objects.create(
        tenant=tenant, livemode=False, url="http://127.0.0.1:9/x", enabled_events=["*"], secret="whsec_x"
    )
    event = Event.objects.create(tenant=tenant, livemode=False, type="x", data={})
    # 20,000 delivered rows and 50 due ones, all made now (their ids: this month's partition).
    insert_series(
        Delivery, 1, 20_050,
        {"id": "%(floor)s || lpad(g::text, 16, '0')",
         "status": "CASE WHEN g > 20000 THEN 'pending' ELSE 'succeeded' END", "fire_after": "now()",
         "event_id": "%(event)s", "endpoint_id": "%(endpoint)s", "created_at": "now()"},
        {"floor": new_id("whd")[:14], "event": event.id, "endpoint": endpoint.id},
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE outbox_delivery")
        cursor.execute("SELECT tableoid::regclass::text FROM outbox_delivery WHERE status = 'pending' LIMIT 1")
        (current,) = cursor.fetchone()
        cursor.execute(
            "EXPLAIN (FORMAT JSON) " + queries.CLAIM_DUE, {"limit": 10, "executor": "probe", "lease_s": 10.0}
        )
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    found = [s for s in scans(plan[0]["Plan"], []) if s[1].startswith("outbox_delivery")]
    assert current.startswith("outbox_delivery_p")
    # The due rows' partition is read through its partial due index ...
    assert any(kind == "Index Scan" and rel == current and "fire_after" in index for kind, rel, index in found), found
    # ... and no partition holding rows is read whole (an empty month's sequential scan reads no page).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'outbox_delivery'::regclass AND c.reltuples > 0"
        )
        holding = {row[0] for row in cursor.fetchall()}
    assert current in holding
    assert not [s for s in found if s[0] in ("Seq Scan", "Bitmap Heap Scan") and s[1] in holding], found
