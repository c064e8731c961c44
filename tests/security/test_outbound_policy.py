"""The outbound policy's rules, without a connection: which addresses are public, what registration refuses."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from hardcount import outbound
from hardcount.outbound import OutboundRefused, checked_addresses, is_public_address, parse_allowlist

REFUSED = [
    # IPv4: loopback, private, link-local and metadata, CGNAT, "this network", multicast, reserved, special use
    "127.0.0.1",
    "127.255.255.254",
    "10.0.0.1",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    "169.254.169.254",
    "169.254.0.1",
    "100.64.0.1",
    "100.127.255.254",
    "100.100.100.200",
    "0.0.0.0",
    "0.1.2.3",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.0.8",
    "192.0.2.1",
    "192.88.99.1",
    "198.18.0.1",
    "198.51.100.1",
    "203.0.113.1",
    # IPv6: loopback, unspecified, ULA (AWS metadata included), link-local, site-local, multicast, documentation
    "::1",
    "::",
    "fd00:ec2::254",
    "fd12:3456::1",
    "fc00::1",
    "fe80::1",
    "fe80::1%1",
    "fec0::1",
    "ff02::1",
    "ff05::1:3",
    "2001:db8::1",
    "3fff::1",
    "100::1",
    # IPv6 forms of refused IPv4 addresses: mapped, compatible, translated, 6to4, NAT64; Teredo
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "::127.0.0.1",
    "::ffff:0:7f00:1",
    "2002:7f00:1::1",
    "2002:a00:1::1",
    "2002:a9fe:a9fe::",
    "64:ff9b::7f00:1",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::1",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",
]

PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "100.63.255.255",
    "100.128.0.1",
    "172.32.0.1",
    "2606:4700:4700::1111",
    "2a00:1450:4001:80b::200e",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address):
    assert is_public_address(address) is False


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address):
    assert is_public_address(address) is True


def test_a_name_is_not_an_address():
    with pytest.raises(ValueError):
        is_public_address("example.com")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/hook",
        "http://localhost:8000/",
        "http://LOCALHOST./",
        "http://api.localhost/",
        "http://localhost.localdomain/",
        "http://[::1]:8000/",
        "http://0.0.0.0/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/",
        "http://[::ffff:127.0.0.1]/",
        "http://[fd00:ec2::254]/",
        "http://224.0.0.1/",
        "http://[ff02::1]/",
        "https://100.64.0.1/",
    ],
)
def test_registration_refuses_literal_non_public_hosts_and_local_names(url, settings):
    settings.HARDCOUNT_OUTBOUND_ALLOW = []
    assert outbound.registration_refusal(url)


@pytest.mark.parametrize(
    "url",
    ["https://example.com/hook", "https://8.8.8.8/", "https://127.0.0.1.nip.io/", "https://hooks.internal.example/"],
)
def test_registration_leaves_names_to_the_connect_time_check(url, settings):
    settings.HARDCOUNT_OUTBOUND_ALLOW = []
    assert outbound.registration_refusal(url) is None


def test_the_allowlist_names_host_and_port_exactly(settings):
    settings.HARDCOUNT_OUTBOUND_ALLOW = ["127.0.0.1:8001", "localhost:8002", "[::1]:8003"]
    assert outbound.registration_refusal("http://127.0.0.1:8001/webhooks") is None
    assert outbound.registration_refusal("http://localhost:8002/") is None
    assert outbound.registration_refusal("http://[::1]:8003/") is None
    assert outbound.registration_refusal("http://127.0.0.1:8002/")  # another port
    assert outbound.registration_refusal("http://localhost:8001/")  # a name the entry does not name
    assert outbound.registration_refusal("http://127.0.0.1/")  # port 80


@pytest.mark.parametrize("entries", ["127.0.0.1", "127.0.0.1:", ":80", "::1:80", "host:0", "host:65536", "host:8o"])
def test_malformed_allowlist_entries_are_refused(entries):
    with pytest.raises(ValueError):
        parse_allowlist(entries)


def test_a_malformed_allowlist_stops_the_process_at_start():
    from django.conf import settings

    env = {
        **os.environ,
        "HARDCOUNT_OUTBOUND_ALLOW": "127.0.0.1",
        "DJANGO_SETTINGS_MODULE": "hardcount.settings",
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",  # parsed only: no connection is made
    }
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        check=False,
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "HARDCOUNT_OUTBOUND_ALLOW" in result.stderr


def _checked(host: str, port: int, answers: list[str]) -> list[str]:
    async def resolver(name, _port):
        assert name == host
        return answers

    return asyncio.run(checked_addresses(host, port, resolver))


def test_a_name_with_any_non_public_address_is_refused_before_connecting(settings):
    settings.HARDCOUNT_OUTBOUND_ALLOW = []
    for answers in (["127.0.0.1"], ["93.184.216.34", "127.0.0.1"], ["2606:4700::1", "fd00:ec2::254"], ["10.0.0.5"]):
        with pytest.raises(OutboundRefused):
            _checked("hooks.acme-payments.com", 443, answers)
    assert _checked("hooks.acme-payments.com", 443, ["93.184.216.34", "2606:4700::1"]) == [
        "93.184.216.34",
        "2606:4700::1",
    ]


def test_an_allowlisted_address_admits_a_name_resolving_to_it(settings):
    settings.HARDCOUNT_OUTBOUND_ALLOW = ["127.0.0.1:9000"]
    assert _checked("dev.acme-payments.com", 9000, ["127.0.0.1"]) == ["127.0.0.1"]
    with pytest.raises(OutboundRefused):
        _checked("dev.acme-payments.com", 9001, ["127.0.0.1"])
    with pytest.raises(OutboundRefused):
        _checked("dev.acme-payments.com", 9000, ["127.0.0.1", "10.0.0.1"])
