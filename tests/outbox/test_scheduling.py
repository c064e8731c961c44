"""The outbox's scheduler entries: the executor as a leaderless service, the maintenance role."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db.models.functions import Now

from hardcount.fencing import NO_FENCE
from outbox.models import Delivery, DeliveryAttempt
from outbox.scheduling import ExecutorService, OutboxMaintenanceRole

from .conftest import emit, make_endpoint, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_runtime_starts_the_executor_and_the_maintenance_role_by_default():
    assert "outbox.scheduling.ExecutorService" in settings.HARDCOUNT_SERVICES
    assert "outbox.scheduling.OutboxMaintenanceRole" in settings.HARDCOUNT_ROLES


def test_executor_service_delivers_until_stopped(tenant_t, receiver):
    make_endpoint(tenant_t, receiver.url("/hook"))
    emit(tenant_t)
    service = ExecutorService()
    service.start()
    try:
        wait_until(lambda: Delivery.objects.filter(status="succeeded").exists(), what="delivered by the service")
        executor = service.executor
    finally:
        service.stop()
    assert service.executor is None and not executor.running


def test_maintenance_tick_reaps_expired_leases_and_purges_old_deliveries(tenant_t):
    make_endpoint(tenant_t, "http://127.0.0.1:9/unused")
    emit(tenant_t)
    emit(tenant_t)
    stuck, old = Delivery.objects.order_by("created_at")
    Delivery.objects.filter(id=stuck.id).update(
        claimed_by="dead:1:x/abc", claim_expires_at=Now() - timedelta(seconds=5), attempts=2
    )
    Delivery.objects.filter(id=old.id).update(status="succeeded", completed_at=Now() - timedelta(days=400))
    stamps = []
    ctx = SimpleNamespace(
        role="outbox_maintenance", holder="h1", token=1, fence=NO_FENCE, stamp=lambda *a: stamps.append(a)
    )

    counts = OutboxMaintenanceRole().tick(ctx)

    assert counts == {"reaped": 1, "purged": 1}
    assert Delivery.objects.get(id=stuck.id).claimed_by is None
    assert DeliveryAttempt.objects.get(delivery_id=stuck.id).number == 2
    assert not Delivery.objects.filter(id=old.id).exists()
    assert len(stamps) == 1


def test_a_scheduler_runtime_runs_the_executor_in_its_replica(tenant_t, receiver):
    from hardcount.scheduler import Runtime

    make_endpoint(tenant_t, receiver.url("/hook"))
    runtime = Runtime(roles=[])  # services from settings: the outbox executor
    assert [s.name for s in runtime.services] == ["outbox_executor"]
    runtime.start()
    try:
        emit(tenant_t)
        wait_until(lambda: Delivery.objects.filter(status="succeeded").exists(), what="delivered by the runtime")
    finally:
        assert runtime.stop(timeout_s=10)
