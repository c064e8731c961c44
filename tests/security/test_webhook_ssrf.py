"""Webhook deliveries as an SSRF and port-scanning tool: refused, at registration and at connect time.

The attacks of the red-team pass (docs/security.md), each against the tests' own servers on
127.0.0.1: register a local URL (test and live mode), or a public-looking name that resolves
to 127.0.0.1, then read the target's answer back from ``GET /v1/webhook_deliveries`` or tell
open TLS, open plaintext and closed ports apart from ``last_error``.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from hardcount import outbound
from hardcount.models import ApiKey
from outbox.models import Delivery, DeliveryAttempt, WebhookEndpoint
from tests.outbox.conftest import emit, make_endpoint, wait_until

from .conftest import INTERNAL_SECRET, PUBLIC_LOOKING

pytestmark = pytest.mark.django_db(transaction=True)


def _client(tenant, *, livemode: bool) -> Client:
    _, key = ApiKey.issue(tenant, livemode=livemode)
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def _register(client: Client, url: str):
    return client.post(
        "/v1/webhook_endpoints", data=json.dumps({"url": url, "enabled_events": ["*"]}), content_type="application/json"
    )


TEST_MODE_LOCAL = [
    "http://127.0.0.1:{port}/admin/",
    "http://localhost:{port}/",
    "http://[::1]:{port}/",
    "http://0.0.0.0:{port}/",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.1/",
    "http://100.64.0.1/",
    "http://api.localhost/",
    "http://localhost.localdomain/",
    "http://224.0.0.1/",
    "http://[ff02::1]/",
    "http://[fd00:ec2::254]/",
]
LIVE_MODE_LOCAL = [u.replace("http://", "https://") for u in TEST_MODE_LOCAL]


@pytest.mark.parametrize(
    ("livemode", "url"), [(False, u) for u in TEST_MODE_LOCAL] + [(True, u) for u in LIVE_MODE_LOCAL]
)
def test_registering_a_local_url_is_422_naming_url_in_both_modes(tenant_t, internal_service, livemode, url):
    response = _register(_client(tenant_t, livemode=livemode), url.format(port=internal_service.port))
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("url_not_public", "url")
    assert "public host" in error["message"]
    assert not WebhookEndpoint.objects.exists()


def test_changing_an_endpoints_url_to_a_local_one_is_422(tenant_t, internal_service):
    client = _client(tenant_t, livemode=False)
    created = _register(client, "https://example.com/hooks").json()
    response = client.post(
        f"/v1/webhook_endpoints/{created['id']}",
        data=json.dumps({"url": internal_service.url("/admin/")}),
        content_type="application/json",
    )
    assert response.status_code == 422 and response.json()["error"]["param"] == "url"
    assert WebhookEndpoint.objects.get().url == "https://example.com/hooks"


def test_an_allowlisted_local_receiver_can_be_registered(tenant_t, internal_service, allow):
    allow(f"127.0.0.1:{internal_service.port}")
    assert _register(_client(tenant_t, livemode=False), internal_service.url("/hooks")).status_code == 201


def _first_attempt(endpoint) -> DeliveryAttempt:
    return wait_until(
        lambda: DeliveryAttempt.objects.filter(delivery__endpoint=endpoint).first(), what="the first attempt"
    )


def test_a_stored_local_endpoint_is_refused_at_connect_time_and_nothing_is_read_back(
    tenant_t, internal_service, make_executor
):
    # As left by the registrations the red team made before this fix (or written by anything but the API).
    endpoint = make_endpoint(tenant_t, internal_service.url("/admin/"))
    emit(tenant_t)
    make_executor()
    attempt = _first_attempt(endpoint)
    assert (attempt.outcome, attempt.status_code, attempt.error) == ("retryable", None, "connection_refused_by_policy")
    assert attempt.response_excerpt == ""
    assert internal_service.connections == []

    response = _client(tenant_t, livemode=False).get("/v1/webhook_deliveries", {"webhook_endpoint": endpoint.id})
    assert response.status_code == 200
    (delivery,) = response.json()["data"]
    assert delivery["last_error"] == "connection_refused_by_policy"
    assert [a["response_excerpt"] for a in delivery["attempts"]] == [None]
    assert INTERNAL_SECRET.decode() not in response.content.decode()


@pytest.mark.parametrize("host", ["localhost", "[::1]", "0.0.0.0", "[::ffff:127.0.0.1]"])
def test_every_spelling_of_this_machine_is_refused_at_connect_time(tenant_t, internal_service, make_executor, host):
    endpoint = make_endpoint(tenant_t, internal_service.url("/", host=host))
    emit(tenant_t)
    make_executor()
    assert _first_attempt(endpoint).error == "connection_refused_by_policy"
    assert internal_service.connections == []


def test_a_live_name_resolving_to_loopback_is_accepted_then_refused_at_connect_time(
    tenant_t, internal_service, stub_dns, make_executor
):
    dns = stub_dns({PUBLIC_LOOKING: ["127.0.0.1"], "127.0.0.1.nip.io": ["127.0.0.1"]})
    client = _client(tenant_t, livemode=True)
    for host in (PUBLIC_LOOKING, "127.0.0.1.nip.io"):
        assert _register(client, internal_service.url("/", host=host, scheme="https")).status_code == 201
    emit(tenant_t, livemode=True)
    make_executor()
    wait_until(lambda: DeliveryAttempt.objects.count() == 2, what="both attempts")
    assert {a.error for a in DeliveryAttempt.objects.all()} == {"connection_refused_by_policy"}
    assert set(DeliveryAttempt.objects.values_list("response_excerpt", flat=True)) == {""}
    assert internal_service.connections == []
    assert {host for host, _ in dns.asked} == {PUBLIC_LOOKING, "127.0.0.1.nip.io"}


def _scan(tenant, ports: list[int], *, host: str) -> list[str]:
    endpoints = [make_endpoint(tenant, f"https://{host}:{port}/", livemode=True) for port in ports]
    emit(tenant, livemode=True)
    wait_until(lambda: all(Delivery.objects.get(endpoint=e).last_error for e in endpoints), what="every port answered")
    return [Delivery.objects.get(endpoint=e).last_error for e in endpoints]


def test_the_port_scanner_learns_nothing_through_dns(
    tenant_t, tls_target, plaintext_port, closed_port, stub_dns, make_executor
):
    stub_dns({PUBLIC_LOOKING: ["127.0.0.1"]})
    make_executor()
    errors = _scan(tenant_t, [tls_target.port, plaintext_port.port, closed_port], host=PUBLIC_LOOKING)
    assert errors == ["connection_refused_by_policy"] * 3
    assert tls_target.connections == [] and plaintext_port.connections == []


def test_failed_connections_record_one_coarse_error_whatever_the_port_said(
    tenant_t, tls_target, plaintext_port, closed_port, allow, make_executor
):
    # Even where the policy lets the connection through, the TLS and socket detail stays in our log.
    for port in (tls_target.port, plaintext_port.port, closed_port):
        allow(f"127.0.0.1:{port}")
    make_executor()
    errors = _scan(tenant_t, [tls_target.port, plaintext_port.port, closed_port], host="127.0.0.1")
    assert errors == ["connection_failed"] * 3
    assert tls_target.connections and plaintext_port.connections  # reached, and still nothing told apart
    for attempt in DeliveryAttempt.objects.all():
        assert attempt.error == "connection_failed" and attempt.response_excerpt == ""


def test_an_allowlisted_receiver_still_gets_its_deliveries_and_its_excerpt_is_kept(
    tenant_t, internal_service, allow, make_executor
):
    allow(f"127.0.0.1:{internal_service.port}")
    endpoint = make_endpoint(tenant_t, internal_service.url("/hooks"))
    emit(tenant_t)
    make_executor()
    attempt = _first_attempt(endpoint)
    assert (attempt.outcome, attempt.status_code) == ("succeeded", 200)
    assert attempt.response_excerpt == INTERNAL_SECRET.decode()
    assert outbound.allowlist().allows("127.0.0.1", internal_service.port)
