"""Operators replay deliveries from the admin (docs/reference/webhooks.md)."""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from outbox.models import Delivery

from .conftest import emit, make_endpoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator_client():
    user = User.objects.create_superuser("operator", "op@example.com", "pw-for-tests-only")
    client = Client()
    client.force_login(user)
    return client


def test_replay_action_creates_new_deliveries_and_reports_refusals(tenant, operator_client):
    make_endpoint(tenant, "https://example.com/hook")
    emit(tenant)
    emit(tenant)
    done, queued = Delivery.objects.order_by("created_at")
    Delivery.objects.filter(id=done.id).update(status="succeeded")

    response = operator_client.post(
        "/admin/outbox/delivery/",
        {"action": "replay", "_selected_action": [done.id, queued.id]},
        follow=True,
    )

    assert response.status_code == 200
    text = [str(m) for m in response.context["messages"]]
    assert "Replayed 1 delivery." in text
    assert any(queued.id in m and "still pending" in m for m in text)
    replay = Delivery.objects.get(replay_of=done)
    assert replay.status == "pending" and replay.event_id == done.event_id


def test_delivery_admin_filters_by_status_event_type_and_endpoint(tenant, operator_client):
    endpoint = make_endpoint(tenant, "https://example.com/hook")
    emit(tenant, "invoice.paid")
    response = operator_client.get(
        "/admin/outbox/delivery/",
        {"status": "pending", "event__type": "invoice.paid", "endpoint__id__exact": endpoint.id},
    )
    assert response.status_code == 200
    assert response.context["cl"].result_count == 1
