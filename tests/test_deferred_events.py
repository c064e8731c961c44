"""``outbox.services.deferred_events``: a transaction's events written together, with the same guarantees."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from outbox.models import Delivery, Event
from outbox.services import create_webhook_endpoint, deferred_events, emit_event


@pytest.fixture
def endpoint(tenant):
    endpoint, _ = create_webhook_endpoint(
        tenant_id=tenant.id, livemode=False, url="http://127.0.0.1:1/hook", enabled_events=["invoice.*"]
    )
    return endpoint


def _emit(tenant, type_: str, object_id: str) -> Event:
    return emit_event(tenant_id=tenant.id, livemode=False, type=type_, data={"id": object_id})


@pytest.mark.django_db
def test_block_writes_its_events_in_order_in_one_statement(tenant, endpoint):
    with transaction.atomic(), CaptureQueriesContext(connection) as queries, deferred_events():
        for n in range(4):
            _emit(tenant, "invoice.created", f"in_{n}")
        _emit(tenant, "customer.created", "cus_1")
        assert Event.objects.count() == 0  # nothing written until the block ends

    events = list(Event.objects.order_by("sequence"))
    assert [e.data["id"] for e in events] == ["in_0", "in_1", "in_2", "in_3", "cus_1"]
    # Subscribed to invoice.* only: four deliveries, none for customer.created.
    assert sorted(d.event.data["id"] for d in Delivery.objects.select_related("event")) == [
        "in_0",
        "in_1",
        "in_2",
        "in_3",
    ]
    writes = [q["sql"] for q in queries.captured_queries if "outbox_" in q["sql"] and "COUNT" not in q["sql"]]
    assert len(writes) == 1  # events and their deliveries in one statement (instead of three per event)


@pytest.mark.django_db
def test_event_of_a_rolled_back_savepoint_is_not_written(tenant, endpoint):
    with transaction.atomic(), deferred_events():
        _emit(tenant, "invoice.created", "in_kept")
        try:
            with transaction.atomic():
                _emit(tenant, "invoice.voided", "in_rolled_back")
                raise RuntimeError("the savepoint rolls back")
        except RuntimeError:
            pass
        _emit(tenant, "invoice.paid", "in_kept")

    assert sorted((e.type, e.data["id"]) for e in Event.objects.all()) == [
        ("invoice.created", "in_kept"),
        ("invoice.paid", "in_kept"),
    ]
    assert Delivery.objects.count() == 2


@pytest.mark.django_db
def test_event_of_a_committed_savepoint_is_written_with_the_block(tenant, endpoint):
    with transaction.atomic(), deferred_events():
        _emit(tenant, "invoice.created", "in_1")
        with transaction.atomic():
            _emit(tenant, "invoice.finalized", "in_1")
        _emit(tenant, "invoice.paid", "in_1")

    assert sorted(e.type for e in Event.objects.all()) == ["invoice.created", "invoice.finalized", "invoice.paid"]
    assert Delivery.objects.count() == 3


@pytest.mark.django_db
def test_exception_in_the_block_writes_nothing(tenant, endpoint):
    with pytest.raises(ValueError), transaction.atomic(), deferred_events():
        _emit(tenant, "invoice.created", "in_1")
        raise ValueError("the change fails")

    assert Event.objects.count() == 0 and Delivery.objects.count() == 0


@pytest.mark.django_db
def test_deliveries_follow_each_endpoints_subscription_and_ids_keep_their_layout(tenant):
    import re

    from outbox.models import WebhookEndpoint
    from outbox.services import event_type_matches

    patterns = {
        "all": ["*"],
        "exact": ["invoice.paid"],
        "prefix": ["subscription.*"],
        "two": ["customer.*", "invoice.*"],
    }
    endpoints = {
        name: create_webhook_endpoint(
            tenant_id=tenant.id, livemode=False, url=f"http://127.0.0.1:1/{name}", enabled_events=p
        )[0]
        for name, p in patterns.items()
    }
    disabled, _ = create_webhook_endpoint(
        tenant_id=tenant.id, livemode=False, url="http://127.0.0.1:1/off", enabled_events=["*"]
    )
    WebhookEndpoint.objects.filter(pk=disabled.pk).update(enabled=False)
    types = ["invoice.paid", "invoice.created", "subscription.updated", "customer.created", "price.created"]

    with transaction.atomic(), deferred_events():
        for type_ in types:
            _emit(tenant, type_, "obj_1")

    got = {(d.event.type, d.endpoint_id) for d in Delivery.objects.select_related("event")}
    expected = {
        (type_, endpoint.id)
        for type_ in types
        for endpoint in endpoints.values()
        if any(event_type_matches(p, type_) for p in endpoint.enabled_events)
    }
    assert got == expected
    assert all(re.fullmatch(r"whd_[0-9a-hjkmnp-tv-z]{26}", d.id) for d in Delivery.objects.all())
