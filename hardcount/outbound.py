"""Outbound HTTP requests made on a tenant's behalf: one policy and the one client that enforces it.

A tenant chooses where some of our requests go (today: webhook deliveries). Those requests
must not become a way into the network the service runs in (SSRF), whatever the URL says
and whatever its name resolves to. Design record: docs/decisions/0123-outbound-requests-policy.md.

- :func:`is_public_address`: the address rule. Public means global unicast; refused are
  loopback, private (RFC 1918, ULA), link-local, CGNAT ``100.64.0.0/10``, multicast,
  unspecified, reserved, documentation and benchmarking ranges, IPv6 site-local, the cloud
  metadata addresses, and IPv6 forms that embed a refused IPv4 address (IPv4-mapped,
  IPv4-compatible, 6to4, NAT64); Teredo is refused outright.
- :func:`registration_refusal`: the check made when a URL is registered. Names are not
  resolved there; literal non-public IPs and obviously local names are refused.
- :class:`OutboundClient`: an aiohttp session whose resolver resolves the host itself,
  refuses the connection **at connect time** when any address is not public, and hands the
  connector only the addresses it checked (no second resolution). TLS still verifies the
  certificate against, and sends SNI and ``Host`` for, the URL's own host name. Redirects are
  never followed, the environment's proxy settings are ignored, cookies are never kept.
- The operator's allowlist, setting ``HARDCOUNT_OUTBOUND_ALLOW`` (environment variable of the
  same name, comma-separated ``host:port``; empty by default, as in production), names the
  local receivers that may be reached anyway (``make run``'s receiver, the tests' own).

This module is kernel: it imports no app.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl as ssl_module
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from django.conf import settings
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# What an attempt records when the request did not get an answer (never the socket or TLS detail).
REFUSED_BY_POLICY = "connection_refused_by_policy"
CONNECTION_FAILED = "connection_failed"
TIMEOUT = "timeout"

METADATA_ADDRESSES = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack, ...
        ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
    }
)

# Besides what the ipaddress flags already say: every IPv4 block that is not global unicast.
_REFUSED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network", 0.0.0.0 included
        "10.0.0.0/8",
        "100.64.0.0/10",  # CGNAT (shared address space)
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, 255.255.255.255 included
    )
)
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
_REFUSED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "2001::/23",  # IETF protocol assignments, Teredo (2001::/32) included
        "2001:db8::/32",  # documentation
        "2002::/16",  # 6to4: judged by the IPv4 address it embeds, see _embedded_v4
        "3fff::/20",  # documentation
    )
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")

# Names that always mean this machine; any name under .localhost too (RFC 6761).
LOCAL_NAMES = frozenset(
    {"localhost", "localhost.localdomain", "localhost6", "localhost6.localdomain6", "ip6-localhost", "ip6-loopback"}
)

DEFAULT_PORTS = {"http": 80, "https": 443}


class OutboundRefused(OSError):
    """The policy refused to connect: the target is not public and not allowlisted.

    Raised by :func:`checked_addresses` at connect time; aiohttp wraps it (an ``OSError`` of
    its resolver) in a ``ClientConnectorError`` whose ``__cause__`` is this exception, and
    :class:`OutboundClient` reports it as an :class:`OutboundFailure` (see :func:`failure_class`).
    """


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64), or None."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public_address(address: str | IPAddress) -> bool:
    """True when ``address`` (an IP, a zone id allowed) is global unicast and not a metadata address.

    Raises ``ValueError`` when ``address`` is not an IP address.
    """
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
        embedded = _embedded_v4(ip)
        if embedded is not None:
            return is_public_address(embedded)
        if ip in _IPV4_COMPATIBLE or ip not in _GLOBAL_UNICAST_V6 or any(ip in n for n in _REFUSED_V6):
            return False
        if ip.is_site_local:
            return False
    elif any(ip in n for n in _REFUSED_V4):
        return False
    if ip in METADATA_ADDRESSES:
        return False
    flags = (ip.is_private, ip.is_loopback, ip.is_link_local, ip.is_multicast, ip.is_unspecified, ip.is_reserved)
    return ip.is_global and not any(flags)


def normalize_host(host: str) -> str:
    """``host`` as compared by the policy: brackets and a trailing dot removed, NFKC, lower case."""
    return unicodedata.normalize("NFKC", host.strip().strip("[]")).lower().rstrip(".")


def literal_address(host: str) -> IPAddress | None:
    """The IP address ``host`` spells (brackets allowed), or None for a name."""
    try:
        return ipaddress.ip_address(normalize_host(host))
    except ValueError:
        return None


def is_local_name(host: str) -> bool:
    """True for names that always mean this machine: ``localhost``, ``*.localhost``, ``localhost.localdomain``, ..."""
    name = normalize_host(host)
    return name in LOCAL_NAMES or name.endswith(".localhost")


@dataclass(frozen=True)
class Allowlist:
    """Targets the operator allows although they are not public: ``(host, port)`` pairs.

    An entry whose host is an IP address also matches a name that resolves to that
    address; an entry naming a host matches that name only.
    """

    names: frozenset[tuple[str, int]] = frozenset()
    addresses: frozenset[tuple[IPAddress, int]] = frozenset()

    def allows(self, host: str, port: int, address: str | IPAddress | None = None) -> bool:
        """True when ``host:port`` (or the resolved ``address`` on ``port``) is named by an entry."""
        if (normalize_host(host), port) in self.names:
            return True
        candidates = [literal_address(host)]
        if address is not None:
            candidates.append(literal_address(address) if isinstance(address, str) else address)
        return any(ip is not None and (_without_scope(ip), port) in self.addresses for ip in candidates)


def _without_scope(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    return ip


def parse_allowlist(entries: str | Iterable[str]) -> Allowlist:
    """An :class:`Allowlist` from ``host:port`` entries (a comma-separated string or an iterable).

    IPv6 hosts are bracketed (``[::1]:8000``). Empty entries are ignored. Raises
    ``ValueError`` naming a malformed entry (no port, a port outside 1..65535).
    """
    items = entries.split(",") if isinstance(entries, str) else list(entries)
    names: set[tuple[str, int]] = set()
    addresses: set[tuple[IPAddress, int]] = set()
    for raw in items:
        entry = raw.strip()
        if not entry:
            continue
        host, sep, port_text = entry.rpartition(":")
        if not sep or not host or not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"HARDCOUNT_OUTBOUND_ALLOW entry {entry!r} is not host:port")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"HARDCOUNT_OUTBOUND_ALLOW entry {entry!r}: write an IPv6 host in brackets")
        port = int(port_text)
        ip = literal_address(host)
        if ip is not None:
            addresses.add((_without_scope(ip), port))
        names.add((normalize_host(host), port))
    return Allowlist(frozenset(names), frozenset(addresses))


@functools.lru_cache(maxsize=8)
def _parsed(entries: tuple[str, ...]) -> Allowlist:
    return parse_allowlist(entries)


def allowlist() -> Allowlist:
    """The operator's allowlist, setting ``HARDCOUNT_OUTBOUND_ALLOW`` as it is now (tests may change it)."""
    value = getattr(settings, "HARDCOUNT_OUTBOUND_ALLOW", ())
    return _parsed(tuple(value.split(",")) if isinstance(value, str) else tuple(value))


def registration_refusal(url: str) -> str | None:
    """Why ``url`` may not be registered as a target, or None.

    Refuses a literal IP that is not public and an obviously local name (see
    :func:`is_local_name`), unless the allowlist names the host and port. Names are not
    resolved: one that resolves to a private address is refused at connect time instead.
    ``url`` must already be a valid absolute http(s) URL; raises ``ValueError`` for a port
    outside 0..65535.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower(), 0)
    if allowlist().allows(host, port):
        return None
    if is_local_name(host):
        return f"{normalize_host(host)} is this machine"
    ip = literal_address(host)
    if ip is not None and not is_public_address(ip):
        return f"{ip} is not a public address"
    return None


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for a TCP connection to ``port``, in the resolver's order.

    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def checked_addresses(host: str, port: int, resolver: Resolver | None = None) -> list[str]:
    """The addresses to connect to for ``host:port``, each public or allowlisted.

    A literal IP is its own address; a name is resolved once by ``resolver`` (default
    :func:`resolve`). Raises :class:`OutboundRefused` when any address is neither public nor
    allowlisted (one bad address refuses the name: a resolver may answer in any order), and
    ``OSError`` when the name does not resolve.
    """
    ip = literal_address(host)
    if ip is not None:
        addresses = [str(ip)]
    else:
        addresses = await (resolver or resolve)(host, port)
    if not addresses:
        raise OSError(f"{host} has no address")
    rules = allowlist()
    if rules.allows(host, port):
        return addresses
    for address in addresses:
        if not (_is_public(address) or rules.allows(host, port, address)):
            raise OutboundRefused(REFUSED_BY_POLICY)
    return addresses


def _is_public(address: str) -> bool:
    try:
        return is_public_address(address)
    except ValueError:
        return False


class PolicyResolver(AbstractResolver):
    """aiohttp's resolver with the policy: the names it returns were checked by :func:`checked_addresses`.

    The connector connects to exactly the addresses returned (no second lookup), and keeps the
    URL's own name for TLS (certificate check and SNI) and ``Host``. aiohttp never asks a
    resolver about a literal IP: :meth:`OutboundClient.post` checks those itself.
    """

    def __init__(self, resolver: Resolver | None = None):
        self._resolver = resolver

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        """aiohttp's ``ResolveResult`` dicts for ``host:port``; raises :class:`OutboundRefused` or ``OSError``."""
        addresses = await checked_addresses(host, port, self._resolver)
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in addresses
        ]

    async def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Answer:
    """What a target answered: ``status`` (HTTP code), ``headers`` (case-insensitive), the body's first bytes."""

    status: int
    headers: Mapping[str, str]
    excerpt: bytes


class OutboundFailure(Exception):
    """A request of :class:`OutboundClient` that got no answer.

    ``kind`` is :data:`REFUSED_BY_POLICY`, :data:`TIMEOUT` or :data:`CONNECTION_FAILED` (what an
    attempt records, see :func:`failure_class`); ``connecting`` is True when the connect timeout
    (resolution and connection together) ran out, so the caller can name the bound that did. The
    underlying exception is the ``__cause__``, for our logs only.
    """

    def __init__(self, kind: str, *, connecting: bool = False):
        super().__init__(kind)
        self.kind = kind
        self.connecting = connecting


class OutboundClient:
    """The client for every request made on a tenant's behalf (aiohttp); use it as ``async with``.

    ``timeout_s`` bounds a whole request, ``connect_timeout_s`` resolution and connection
    together; at most ``max_connections`` are open, each idle one closed after ``keepalive_s``.
    ``ssl`` is for tests with a certificate of their own; ``resolver`` (``async (host, port) ->
    [address, ...]``) replaces DNS in tests. Targets are checked at connect time
    (:class:`PolicyResolver`, literal IPs in :meth:`post`); redirects are never followed (a 3xx
    is the answer); proxy variables are ignored; cookies are neither kept nor sent, so one
    receiver's cookie never reaches another; the body is read as sent (no decompression).
    Why aiohttp: docs/decisions/0226-executor-client-aiohttp.md.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int = 100,
        keepalive_s: float = 5.0,
        ssl: ssl_module.SSLContext | bool = True,
        resolver: Resolver | None = None,
    ):
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._connector_args = {
            "limit": max_connections,
            "limit_per_host": 0,
            "keepalive_timeout": keepalive_s,
            "use_dns_cache": False,  # every new connection is resolved and checked afresh
            "resolver": PolicyResolver(resolver),
            "ssl": ssl,
        }
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OutboundClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(**self._connector_args),
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
        )
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *, max_bytes: int = 65536) -> Answer:
        """POST ``body`` to ``url`` with exactly ``headers``; the answer with at most ``max_bytes`` of its body.

        Raises :class:`OutboundFailure` when there is no answer (refused by the policy, timed
        out, or any network, TLS or protocol failure), and ``ValueError`` for a URL that is not
        an absolute http(s) URL.
        """
        target = _parsed_url(url)
        if target.host is None or target.scheme not in DEFAULT_PORTS:
            raise ValueError(f"not an absolute http(s) URL: {url!r}")
        if literal_address(target.host) is not None:
            try:
                await checked_addresses(target.host, target.port or DEFAULT_PORTS[target.scheme])
            except OutboundRefused as exc:
                raise OutboundFailure(REFUSED_BY_POLICY) from exc
        assert self._session is not None, "use OutboundClient as `async with`"
        try:
            async with self._session.post(target, data=body, headers=headers, allow_redirects=False) as response:
                excerpt = bytearray()
                while len(excerpt) < max_bytes:
                    chunk = await response.content.read(max_bytes - len(excerpt))
                    if not chunk:
                        break
                    excerpt += chunk
                return Answer(response.status, response.headers, bytes(excerpt))
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise OutboundFailure(
                failure_class(exc), connecting=isinstance(exc, aiohttp.ConnectionTimeoutError)
            ) from exc


@functools.lru_cache(maxsize=4096)
def _parsed_url(url: str) -> URL:
    """``url`` parsed once per URL (yarl's URL is immutable); raises ``ValueError`` when it is not one."""
    return URL(url)


def failure_class(exc: BaseException) -> str:
    """What to record for a request that raised ``exc`` and got no answer.

    :data:`REFUSED_BY_POLICY` when the policy refused the target, :data:`TIMEOUT` for a
    timeout, :data:`CONNECTION_FAILED` for anything else (resolution, refused or reset
    connections, TLS, protocol errors): the detail stays in our logs, never in what the
    tenant reads, so a delivery cannot tell open, closed and TLS ports apart.
    """
    if isinstance(exc, OutboundFailure):
        return exc.kind
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OutboundRefused):
            return REFUSED_BY_POLICY
        current = current.__cause__ or current.__context__
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    return CONNECTION_FAILED


__all__ = [
    "CONNECTION_FAILED",
    "LOCAL_NAMES",
    "METADATA_ADDRESSES",
    "REFUSED_BY_POLICY",
    "TIMEOUT",
    "Allowlist",
    "Answer",
    "OutboundClient",
    "OutboundFailure",
    "OutboundRefused",
    "PolicyResolver",
    "checked_addresses",
    "failure_class",
    "is_local_name",
    "is_public_address",
    "literal_address",
    "normalize_host",
    "parse_allowlist",
    "registration_refusal",
    "resolve",
]
