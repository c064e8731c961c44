"""The ``idempotency_maintenance`` role: registered by default, ticks under its lease and prunes expired keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import connection

from hardcount.fencing import LeaseLost
from hardcount.loops import IdempotencyMaintenanceRole
from hardcount.models import IdempotencyRecord, Tenant
from hardcount.scheduler import Runtime, configured_roles
from leases import services as leases
from tests.leases.helpers import expire, lease_row, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ROLE = "idempotency_maintenance"


@pytest.fixture(autouse=True)
def fast_leases(settings):
    settings.HARDCOUNT_LEASE_POLL_S = 0.05
    settings.HARDCOUNT_LEASE_HEARTBEAT_S = 0.1


def make_records(*, expired: int, kept: int) -> None:
    tenant = Tenant.objects.create(name="Maintenance")
    with connection.cursor() as cursor:
        for n in range(expired + kept):
            age = "25 hours" if n < expired else "1 hour"
            cursor.execute(
                "INSERT INTO hardcount_idempotencyrecord (tenant_id, livemode, key, request_fingerprint,"
                " response_status, response_body, created_at, completed_at)"
                " VALUES (%s, true, %s, %s, 201, '\"{}\"'::jsonb, now() - %s::interval, now() - %s::interval)",
                [tenant.pk, f"{'old' if n < expired else 'new'}-{n}", "f" * 64, age, age],
            )


def test_the_role_is_configured_by_default():
    assert "hardcount.loops.IdempotencyMaintenanceRole" in settings.HARDCOUNT_ROLES
    (role,) = configured_roles([ROLE])
    assert isinstance(role, IdempotencyMaintenanceRole)
    assert role.interval_s == 300.0


def test_a_runtime_leads_the_role_and_its_tick_prunes_in_batches(settings):
    settings.HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH = 4
    make_records(expired=10, kept=2)
    runtime = Runtime([IdempotencyMaintenanceRole()], [])
    runtime.start()
    try:
        assert wait_until(lambda: (lease_row(ROLE) or {}).get("last_tick_at") is not None)
        assert runtime.leadership() == {ROLE: True}
        assert lease_row(ROLE)["holder"] == runtime.holder
    finally:
        assert runtime.stop(5)
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == ["new-10", "new-11"]


def test_the_tick_stamps_after_every_batch_and_reports_the_count(settings):
    settings.HARDCOUNT_IDEMPOTENCY_PRUNE_BATCH = 4
    make_records(expired=10, kept=1)
    token = leases.acquire(ROLE, "h1", ttl_s=10)
    fence = leases.LeaseFence(ROLE, "h1", token)
    stamps = []
    ctx = SimpleNamespace(role=ROLE, holder="h1", token=token, fence=fence, stamp=lambda *a: stamps.append(a))

    assert IdempotencyMaintenanceRole().tick(ctx) == {"pruned": 10}

    assert stamps == [(4,), (4,), (2,), ()]
    assert IdempotencyRecord.objects.count() == 1


def test_a_deposed_leader_deletes_nothing():
    make_records(expired=3, kept=0)
    old_token = leases.acquire(ROLE, "h1", ttl_s=10)
    expire(ROLE)
    assert leases.acquire(ROLE, "h2", ttl_s=10) == old_token + 1
    deposed = leases.LeaseFence(ROLE, "h1", old_token)
    ctx = SimpleNamespace(role=ROLE, holder="h1", token=old_token, fence=deposed, stamp=lambda *a: None)

    with pytest.raises(LeaseLost):
        IdempotencyMaintenanceRole().tick(ctx)

    assert IdempotencyRecord.objects.count() == 3
