"""The outbound client against the tests' own servers: refused at connect time, or reached as the policy says.

Each request is one ``asyncio.run`` of :class:`hardcount.outbound.OutboundClient`, the client the
webhook executor uses. Names are answered by the stub resolver; nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from hardcount import outbound

from .conftest import PUBLIC_LOOKING


def post(url: str, *, timeout_s: float = 3.0, connect_timeout_s: float = 2.0, **client_kwargs):
    """POST ``url`` once; returns the :class:`~hardcount.outbound.Answer`, or the failure the client raised."""

    async def run():
        client = outbound.OutboundClient(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, **client_kwargs)
        async with client:
            try:
                return await client.post(url, b"{}", {"Content-Type": "application/json"})
            except outbound.OutboundFailure as exc:
                return exc

    return asyncio.run(run())


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "0.0.0.0", "[::ffff:127.0.0.1]", "127.1.2.3"])
def test_literal_local_addresses_are_refused_without_connecting(internal_service, host):
    result = post(internal_service.url("/admin/", host=host))
    assert isinstance(result, outbound.OutboundFailure)
    assert outbound.failure_class(result) == outbound.REFUSED_BY_POLICY
    assert internal_service.connections == []


@pytest.mark.parametrize("host", ["2130706433", "127.1", "0x7f.0.0.1", "017700000001"])
def test_legacy_numeric_spellings_of_loopback_never_connect(internal_service, host):
    result = post(internal_service.url("/admin/", host=host))
    assert isinstance(result, outbound.OutboundFailure), result
    assert internal_service.connections == []


def test_a_hosts_file_name_is_refused_after_the_real_lookup(internal_service):
    # localhost resolves through /etc/hosts (the guard lets it through): the answer is what is refused.
    result = post(internal_service.url(host="localhost"))
    assert outbound.failure_class(result) == outbound.REFUSED_BY_POLICY
    assert internal_service.connections == []


def test_a_public_looking_name_resolving_to_loopback_is_refused_at_connect_time(internal_service, stub_dns):
    dns = stub_dns({PUBLIC_LOOKING: ["127.0.0.1"]})
    for scheme in ("http", "https"):
        result = post(internal_service.url(host=PUBLIC_LOOKING, scheme=scheme))
        assert outbound.failure_class(result) == outbound.REFUSED_BY_POLICY
    assert internal_service.connections == []
    assert dns.asked == [(PUBLIC_LOOKING, internal_service.port)] * 2


def test_an_allowlisted_address_is_reached_once_resolved_with_the_original_host_header(
    internal_service, stub_dns, allow
):
    allow(f"127.0.0.1:{internal_service.port}")
    dns = stub_dns({PUBLIC_LOOKING: ["127.0.0.1"]})
    response = post(internal_service.url("/hook", host=PUBLIC_LOOKING))
    assert isinstance(response, outbound.Answer) and response.status == 200
    assert internal_service.requests == [
        {"path": "/hook", "host": f"{PUBLIC_LOOKING}:{internal_service.port}", "method": "POST"}
    ]
    assert dns.asked == [(PUBLIC_LOOKING, internal_service.port)]  # one lookup: the address checked is the one used


def test_https_keeps_sni_certificate_check_and_host_on_the_name(tls_target, certificate, stub_dns, allow):
    allow(f"127.0.0.1:{tls_target.port}")
    dns = stub_dns({PUBLIC_LOOKING: ["127.0.0.1"]})
    response = post(tls_target.url("/hook", host=PUBLIC_LOOKING, scheme="https"), ssl=certificate.client_context())
    assert isinstance(response, outbound.Answer) and response.status == 200, response
    assert tls_target.sni == [PUBLIC_LOOKING]
    assert tls_target.requests[0]["host"] == f"{PUBLIC_LOOKING}:{tls_target.port}"
    assert dns.asked == [(PUBLIC_LOOKING, tls_target.port)]
    # The certificate is checked against the URL's name: by IP, the same server fails verification.
    result = post(tls_target.url("/hook", scheme="https"), ssl=certificate.client_context())
    assert outbound.failure_class(result) == outbound.CONNECTION_FAILED


def test_redirects_are_not_followed(internal_service, http_target_factory, allow):
    redirector = http_target_factory(lambda handler: (302, {"Location": internal_service.url("/admin/")}, b""))
    allow(f"127.0.0.1:{redirector.port}")
    allow(f"127.0.0.1:{internal_service.port}")  # even to a target the policy would let through
    response = post(redirector.url())
    assert isinstance(response, outbound.Answer) and response.status == 302
    assert internal_service.connections == []


def test_proxy_variables_are_ignored(internal_service, http_target_factory, allow, monkeypatch):
    target = http_target_factory()
    allow(f"127.0.0.1:{target.port}")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, internal_service.url())
    response = post(target.url("/direct"))
    assert isinstance(response, outbound.Answer) and response.status == 200
    assert [r["path"] for r in target.requests] == ["/direct"]
    assert internal_service.connections == []


def test_failed_connections_look_alike_tls_plaintext_and_closed(tls_target, plaintext_port, closed_port, allow):
    for port in (tls_target.port, plaintext_port.port, closed_port):
        allow(f"127.0.0.1:{port}")
    results = [post(f"https://127.0.0.1:{port}/") for port in (tls_target.port, plaintext_port.port, closed_port)]
    assert [outbound.failure_class(r) for r in results] == [outbound.CONNECTION_FAILED] * 3


def test_the_connect_timeout_covers_a_hanging_lookup(internal_service, stub_dns, monkeypatch):
    async def hang(host, port):
        await asyncio.sleep(30)
        return ["127.0.0.1"]

    monkeypatch.setattr(outbound, "resolve", hang)
    started = time.monotonic()

    result = post(internal_service.url(host=PUBLIC_LOOKING), timeout_s=5.0, connect_timeout_s=0.3)
    assert outbound.failure_class(result) == outbound.TIMEOUT and result.connecting
    assert time.monotonic() - started < 3
