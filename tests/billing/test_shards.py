"""Billing shards (billing/shards.py): the shard function, its SQL twin, the sharded drain and the shard roles."""

import hashlib
from collections import Counter

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from billing.loops import BillingRole
from billing.models import BillingRun, Invoice
from billing.services.drain import drain_due
from billing.shards import SHARD_OF_SQL, Shard, configured_count, lease_role, parse_lease_role, shard_of
from hardcount.scheduler import configured_roles
from hardcount.scheduler.registry import Role

# Pinned: a tenant's shard must never move between releases, replicas or Python runs (a moved tenant
# would be drained by two shards' leaders at once during a rolling deploy).
PINNED = {
    ("ten_a", 2): 0,
    ("ten_a", 7): 0,
    ("acme", 2): 1,
    ("acme", 5): 2,
    ("ten_01hzy3k4m5n6p7q8r9s0t1u2v3", 4): 2,
}


def test_a_tenants_shard_is_pinned_to_the_first_four_bytes_of_the_sha256_of_its_id():
    for (tenant_id, count), shard in PINNED.items():
        assert shard_of(tenant_id, count) == shard
        digest = hashlib.sha256(tenant_id.encode()).digest()
        assert shard == int.from_bytes(digest[:4], "big") % count


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 16])
def test_every_tenant_lands_in_one_of_the_count_shards_and_they_share_the_tenants_evenly(count):
    ids = [f"ten_{i:06d}" for i in range(4000)]
    shards = Counter(shard_of(tenant_id, count) for tenant_id in ids)
    assert set(shards) == set(range(count))
    expected = len(ids) / count
    # Evenly within 15 %: a hash that sent most tenants to one shard would fail.
    assert all(abs(n - expected) < 0.15 * expected for n in shards.values()), shards
    assert [shard_of(tenant_id, count) for tenant_id in ids] == [shard_of(tenant_id, count) for tenant_id in ids]


def test_a_count_below_one_is_refused(settings):
    with pytest.raises(ValueError):
        shard_of("ten_a", 0)
    with pytest.raises(ValueError):
        Shard(2, 2)
    settings.HARDCOUNT_BILLING_SHARDS = 0
    with pytest.raises(ImproperlyConfigured):
        configured_count()


def test_lease_roles_keep_the_single_billing_lease_for_one_shard():
    assert [lease_role(0, 1)] == ["billing"]
    assert [lease_role(i, 3) for i in range(3)] == ["billing:0", "billing:1", "billing:2"]
    assert [parse_lease_role(r) for r in ("billing", "billing:2", "dunning", "manual:ten_a:test", "billing:x")] == [
        0,
        2,
        None,
        None,
        None,
    ]


@pytest.mark.django_db
def test_the_sql_shard_function_agrees_with_pythons_for_every_tenant_id():
    ids = [f"ten_{i:05d}" for i in range(500)] + ["acme", "tenant-ü-ß", "x" * 64, ""]
    for count in (2, 3, 8):
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT t, {SHARD_OF_SQL.format(column='t')} FROM unnest(%s::text[]) AS t",
                [count, ids],
            )
            in_sql = dict(cursor.fetchall())
        assert in_sql == {tenant_id: shard_of(tenant_id, count) for tenant_id in ids}


def tenants_on_two_shards(book, count=2):
    """A tenant in shard 0 and one in shard 1 of ``count``."""
    found = {}
    while len(found) < 2:
        tenant = book.tenant(f"Tenant {len(found)}-{len(found) * 7}")
        shard = shard_of(tenant.id, count)
        if shard in (0, 1) and shard not in found:
            found[shard] = tenant
    return found[0], found[1]


def test_a_shards_drain_bills_only_its_tenants_and_records_its_lease(book):
    first, second = tenants_on_two_shards(book)
    first_subs = [book.subscribed(first) for _ in range(4)]
    second_subs = [book.subscribed(second) for _ in range(3)]

    run = drain_due(livemode=False, trigger="scheduler", shard=Shard(0, 2), page_size=2)

    assert (run.attempted, run.billed, run.lease_role) == (4, 4, "billing:0")
    billed = set(Invoice.objects.values_list("subscription_id", flat=True))
    assert billed == {s.id for s in first_subs}  # without the shard predicate the other tenant's would be here too

    other = drain_due(livemode=False, trigger="scheduler", shard=Shard(1, 2), page_size=2)
    assert (other.attempted, other.billed, other.lease_role) == (3, 3, "billing:1")
    assert set(Invoice.objects.values_list("subscription_id", flat=True)) == {s.id for s in first_subs + second_subs}


def test_a_shards_new_run_supersedes_only_its_own_shards_running_run(book):
    first, _ = tenants_on_two_shards(book)
    book.subscribed(first)
    stale = BillingRun.objects.create(
        trigger="scheduler", livemode=False, as_of="2026-01-01T00:00Z", started_at="2026-01-01T00:00Z",
        lease_role="billing:0",
    )  # fmt: skip
    other = BillingRun.objects.create(
        trigger="scheduler", livemode=False, as_of="2026-01-01T00:00Z", started_at="2026-01-01T00:00Z",
        lease_role="billing:1",
    )  # fmt: skip

    single = BillingRun.objects.create(
        trigger="scheduler", livemode=False, as_of="2026-01-01T00:00Z", started_at="2026-01-01T00:00Z",
    )  # fmt: skip

    drain_due(livemode=False, trigger="scheduler", shard=Shard(1, 2))
    assert BillingRun.objects.get(pk=other.pk).status == "abandoned"  # shard 1's own
    assert BillingRun.objects.get(pk=stale.pk).status == "running"  # shard 0's leader may still be at it
    assert BillingRun.objects.get(pk=single.pk).status == "running"
    other = BillingRun.objects.filter(lease_role="billing:1", status="completed").get()
    BillingRun.objects.filter(pk=other.pk).update(status="running")

    drain_due(livemode=False, trigger="scheduler", shard=Shard(0, 2))
    assert BillingRun.objects.get(pk=stale.pk).status == "abandoned"
    # Left by the single leader before the switch to shards: shard 0 ends it.
    assert BillingRun.objects.get(pk=single.pk).status == "abandoned"
    assert BillingRun.objects.get(pk=other.pk).status == "running"  # shard 1's leader is still at it
    BillingRun.objects.filter(pk=other.pk).update(status="abandoned")


def test_one_shard_is_the_single_billing_role_and_more_are_one_role_each(settings):
    settings.HARDCOUNT_ROLES = ["billing.loops.BillingRole", "billing.loops.DunningRole"]
    settings.HARDCOUNT_BILLING_SHARDS = 1
    assert [r.name for r in configured_roles()] == ["billing", "dunning"]
    assert getattr(configured_roles()[0], "family", None) is None

    settings.HARDCOUNT_BILLING_SHARDS = 3
    roles = configured_roles()
    assert [r.name for r in roles] == ["billing:0", "billing:1", "billing:2", "dunning"]
    assert all(isinstance(r, Role) for r in roles)
    assert [r.shard for r in roles[:3]] == [Shard(0, 3), Shard(1, 3), Shard(2, 3)]
    # The family's name selects every shard (runscheduler --role billing).
    assert [r.name for r in configured_roles(["billing"])] == ["billing:0", "billing:1", "billing:2"]
    assert [r.name for r in configured_roles(["billing:1"])] == ["billing:1"]
    with pytest.raises(ImproperlyConfigured):
        configured_roles(["billing:3"])
    assert BillingRole().name == "billing:0"


def test_a_shards_fence_guards_only_that_shards_drain(book, settings):
    """A leader deposed from billing:0 writes nothing of shard 0; its live billing:1 lease still bills shard 1 (the
    control: the refusal is the lost shard's own lease, not the process)."""
    from hardcount.fencing import LeaseLost
    from leases import services as leases
    from tests.leases.helpers import expire

    settings.HARDCOUNT_BILLING_SHARDS = 2  # as the leaders run, for the doctor's sweep after the test
    first, second = tenants_on_two_shards(book)
    book.subscribed(first)
    second_sub = book.subscribed(second)
    stale_0 = leases.try_acquire("billing:0", "stale:1:aaaa")
    live_1 = leases.try_acquire("billing:1", "stale:1:aaaa")
    expire("billing:0")
    assert leases.try_acquire("billing:0", "successor:2:bbbb") is not None

    with pytest.raises(LeaseLost):
        drain_due(livemode=False, trigger="scheduler", shard=Shard(0, 2), fence=stale_0)
    assert not BillingRun.objects.exists()
    assert not Invoice.objects.exists()

    run = drain_due(livemode=False, trigger="scheduler", shard=Shard(1, 2), fence=live_1)
    assert (run.billed, run.lease_role, run.lease_token) == (1, "billing:1", live_1.token)
    assert list(Invoice.objects.values_list("subscription_id", flat=True)) == [second_sub.id]
    for lease in (stale_0, live_1):
        lease.close()


def test_health_and_metrics_report_each_shard(book, client, settings):
    from billing.metrics import BillingMetrics
    from leases import services as leases

    settings.HARDCOUNT_ROLES = ["billing.loops.BillingRole"]
    settings.HARDCOUNT_BILLING_SHARDS = 2
    first, second = tenants_on_two_shards(book)
    for _ in range(3):
        book.subscribed(first)
    book.subscribed(second)
    leases.acquire("billing:1", "host:1:aaaa", ttl_s=10)

    families = {f.name: f for f in BillingMetrics().collect()}
    due = {
        (s.labels["mode"], s.labels["shard"]): s.value
        for s in families["hardcount_billing_shard_due_subscriptions"].samples
    }
    assert due == {
        ("test", "billing:0"): 3,
        ("test", "billing:1"): 1,
        ("live", "billing:0"): 0,
        ("live", "billing:1"): 0,
    }
    oldest = families["hardcount_billing_shard_oldest_due_age_seconds"].samples
    assert {(s.labels["mode"], s.labels["shard"]) for s in oldest if s.value > 3000} == {
        ("test", "billing:0"),
        ("test", "billing:1"),
    }  # due an hour ago (the book's anchor)

    ready = client.get("/health/ready").json()
    assert ready["billing"]["shards"] == {
        "count": 2,
        "due_subscriptions": {"billing:0": {"live": 0, "test": 3}, "billing:1": {"live": 0, "test": 1}},
    }
    assert {role: entry["held"] for role, entry in ready["roles"].items()} == {"billing:0": False, "billing:1": True}
    metrics = client.get("/metrics").content.decode()
    assert 'hardcount_leader_is_leader{role="billing:0"} 0.0' in metrics
    assert 'hardcount_leader_is_leader{role="billing:1"} 1.0' in metrics
    leases.release("billing:1", "host:1:aaaa", 1)


def test_billing_runs_over_the_api_name_their_shard(book, settings):
    from tests.api.conftest import Api, make_keys
    from tests.billing.conftest import wait_for_manual_runs

    settings.HARDCOUNT_BILLING_SHARDS = 2
    acme = make_keys("Acme")
    book.subscribed(acme.tenant)
    expected = f"billing:{shard_of(acme.tenant.id, 2)}"
    api = Api(acme.test)

    status, manual = api.post("/v1/billing/run", {})
    assert (status, manual["shard"]) == (200, expected)
    wait_for_manual_runs()
    book.subscribed(acme.tenant)
    scheduler_run = drain_due(livemode=False, trigger="scheduler", shard=Shard(shard_of(acme.tenant.id, 2), 2))
    assert scheduler_run.billed == 1

    status, listed = api.get("/v1/billing/runs")
    assert status == 200
    assert {(r["trigger"], r["shard"]) for r in listed["data"]} == {("manual", expected), ("scheduler", expected)}


def test_the_doctor_finds_a_shard_run_that_billed_another_shards_tenant(book, settings, no_doctor):
    from leases import services as leases
    from ops.doctor import run_checks

    settings.HARDCOUNT_BILLING_SHARDS = 2
    first, _ = tenants_on_two_shards(book)
    book.subscribed(first)
    fence = leases.try_acquire("billing:0", "host:1:aaaa")
    run = drain_due(livemode=False, trigger="scheduler", shard=Shard(0, 2), fence=fence)
    fence.close()

    def found():
        (result,) = run_checks(names=["scheduler_run_bills_only_its_shard"])
        return result

    assert (found().status, run.billed) == ("ok", 1)
    # The same attempt recorded as shard 1's (under billing:1's current token): its tenant is shard 0's.
    other = leases.try_acquire("billing:1", "host:1:aaaa")
    BillingRun.objects.filter(pk=run.pk).update(lease_role="billing:1", lease_token=other.token)
    other.close()
    result = found()
    assert (result.status, result.violations) == ("fail", 1)
    assert "which is in shard 0 of 2" in result.examples[0]
