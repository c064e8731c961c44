"""Webhooks in the admin (replay reaches the receiver again as a new delivery), and the leader lease list."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from leases.models import LeaderLease
from outbox.models import Delivery, DeliveryAttempt
from tests.admin.conftest import changelist_ids, messages_of
from tests.outbox.conftest import emit, make_endpoint, wait_until

DELIVERIES = reverse("admin:outbox_delivery_changelist")


def _succeeded(delivery_id: str):
    return Delivery.objects.filter(pk=delivery_id, status="succeeded").first()


def test_replay_sends_the_event_again_as_a_new_delivery_with_its_own_attempt(
    transactional_db, tenant, receiver, make_executor, operator
):
    make_endpoint(tenant, receiver.url("/hook"), ["invoice.*"])
    event = emit(tenant, "invoice.paid", data={"id": "in_replayed"})
    make_executor()
    original = wait_until(lambda: _succeeded(Delivery.objects.get(event=event).pk), what="first delivery")

    response = operator.post(DELIVERIES, {"action": "replay", "_selected_action": [original.pk]}, follow=True)

    assert messages_of(response) == ["Replayed 1 delivery."]
    replay = Delivery.objects.get(replay_of=original)
    wait_until(lambda: _succeeded(replay.pk), what="replayed delivery")
    assert [(a.delivery_id, a.number, a.outcome) for a in DeliveryAttempt.objects.order_by("created_at")] == [
        (original.pk, 1, "succeeded"),
        (replay.pk, 1, "succeeded"),
    ]
    assert [r.json["id"] for r in receiver.wait_for(2, "/hook")] == [event.id, event.id]


@pytest.mark.django_db
def test_delivery_filters_build_their_choices_without_reading_the_table(tenant, operator):
    endpoint = make_endpoint(tenant, "https://example.com/hook")
    paid = emit(tenant, "invoice.paid")
    emit(tenant, "customer.created")
    Delivery.objects.filter(event=paid).update(status="failed")

    with CaptureQueriesContext(connection) as queries:
        ids = changelist_ids(operator, DELIVERIES, {"event__type": "invoice.paid"})

    assert ids == set(Delivery.objects.filter(event=paid).values_list("pk", flat=True))
    assert not [q["sql"] for q in queries if "DISTINCT" in q["sql"].upper()]
    assert changelist_ids(operator, DELIVERIES, {"status__exact": "failed", "endpoint__id__exact": endpoint.pk}) == ids
    events = changelist_ids(operator, reverse("admin:outbox_event_changelist"), {"type": "invoice.paid"})
    assert events == {paid.pk}


@pytest.mark.django_db
def test_lease_list_shows_holder_token_and_heartbeat_age_from_the_database_clock(operator):
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        db_now = cursor.fetchone()[0]
    LeaderLease.objects.create(
        role="billing",
        holder="web-1:4242:abcd",
        token=7,
        acquired_at=db_now - timedelta(minutes=5),
        heartbeat_at=db_now - timedelta(seconds=4),
        expires_at=db_now + timedelta(seconds=6),
        last_stamp_at=db_now - timedelta(seconds=30),
    )

    response = operator.get(reverse("admin:leases_leaderlease_changelist"))

    lease = response.context["cl"].result_list[0]
    assert 4 <= lease.heartbeat_age_d.total_seconds() < 14  # the request's now() is a little later
    assert -4 < lease.expires_in_d.total_seconds() <= 6
    text = response.content.decode()
    assert "web-1:4242:abcd" in text and ">7<" in text
    assert operator.get(reverse("admin:leases_leaderlease_add")).status_code == 403
    assert operator.post(reverse("admin:leases_leaderlease_change", args=["billing"]), {"token": 99}).status_code == 403
    assert LeaderLease.objects.get().token == 7


ENDPOINTS = reverse("admin:outbox_webhookendpoint_changelist")


@pytest.mark.django_db
def test_an_open_circuit_is_flagged_and_reset_through_the_service_with_an_audit_entry(tenant, operator):
    from django.utils import timezone

    from hardcount.models import AuditLogEntry
    from outbox.models import WebhookEndpoint

    endpoint = make_endpoint(tenant, "https://example.com/" + "long/" * 20 + "hook")
    emit(tenant)
    later = timezone.now() + timedelta(minutes=5)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(circuit_open_until=later, consecutive_failures=6)
    Delivery.objects.update(fire_after=later)
    page = operator.get(reverse("admin:outbox_webhookendpoint_change", args=[endpoint.pk])).content.decode()
    assert "circuit open until" in page and 'value="reset_circuit"' in page
    assert f"Webhook endpoint {endpoint.url} ({endpoint.pk})" in page
    assert endpoint.secret not in page and "whsec_" not in page  # the signing secret is never shown
    listed = operator.get(ENDPOINTS, {"circuit": "open"})
    assert [e.pk for e in listed.context["cl"].result_list] == [endpoint.pk]
    assert endpoint.url not in listed.content.decode().replace(f'title="{endpoint.url}"', "")  # truncated

    response = operator.post(
        ENDPOINTS, {"action": "reset_circuit", "_selected_action": [endpoint.pk], "_return_to": "change"}, follow=True
    )

    assert messages_of(response) == [f"{endpoint.pk}: circuit closed; 1 waiting deliveries are due now."]
    endpoint.refresh_from_db()
    assert (endpoint.circuit_open_until, endpoint.consecutive_failures) == (None, 0)
    assert Delivery.objects.get().fire_after <= timezone.now()
    entry = AuditLogEntry.objects.get(action="webhook_endpoint.reset_circuit")
    assert (entry.object_id, entry.actor_label) == (endpoint.pk, "operator-admin-test")


@pytest.mark.django_db
def test_a_disabled_endpoint_is_re_enabled_through_the_service_and_a_reset_of_it_is_refused(tenant, operator):
    from hardcount.models import AuditLogEntry
    from outbox.models import WebhookEndpoint

    endpoint = make_endpoint(tenant, "https://example.com/gone", enabled=False, disabled_reason="410 Gone")

    refused = operator.post(ENDPOINTS, {"action": "reset_circuit", "_selected_action": [endpoint.pk]}, follow=True)
    assert "is disabled; enable it" in messages_of(refused)[0]
    response = operator.post(ENDPOINTS, {"action": "reenable", "_selected_action": [endpoint.pk]}, follow=True)

    assert messages_of(response) == [f"{endpoint.pk}: re-enabled; its circuit is closed."]
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).enabled is True
    assert list(AuditLogEntry.objects.order_by("created_at").values_list("action", "message")) == [
        (
            "webhook_endpoint.reset_circuit",
            f"Refused: Webhook endpoint {endpoint.pk} is disabled; enable it, which also closes its circuit.",
        ),
        ("webhook_endpoint.reenable", "Re-enabled."),
    ]
