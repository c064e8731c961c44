"""Fixtures for the attacks in docs/security.md, all on this machine.

Targets are the tests' own servers on 127.0.0.1: an HTTP server standing in for an internal
service (it answers with a body an attacker would like to read back), a TLS server with a
certificate of its own, a plaintext TCP port, a closed port. None is on the outbound allowlist
unless a test puts it there. A public-looking name is mapped to 127.0.0.1 by a stub resolver
(:func:`stub_dns`); a guard makes any other name lookup fail, so nothing leaves the machine.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.outbox.conftest import allow_outbound, make_executor, tenant_t  # noqa: F401 - the outbox's fixtures

INTERNAL_SECRET = b"internal-service-secret: root password is hunter2"
PUBLIC_LOOKING = "hooks.acme-payments.com"  # mapped to 127.0.0.1 by the stub resolver, never looked up


@dataclass
class Target:
    """A local server an attacker wants to reach; ``connections`` counts every TCP connection it accepted."""

    port: int
    connections: list[tuple[str, int]] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)  # TLS targets: the name each handshake asked for
    close: Callable[[], None] = lambda: None

    def url(self, path: str = "/", host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def _http_target(
    answer: Callable[[BaseHTTPRequestHandler], tuple[int, dict, bytes]] | None = None,
    tls: ssl.SSLContext | None = None,
) -> Target:
    target = Target(port=0)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            return None

        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            target.requests.append({"path": self.path, "host": self.headers.get("Host"), "method": self.command})
            status, headers, body = answer(self) if answer else (200, {}, INTERNAL_SECRET)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self):
            conn, addr = super().get_request()
            target.connections.append(addr)
            return (tls.wrap_socket(conn, server_side=True) if tls else conn), addr

        def handle_error(self, request, client_address):
            return None  # a client that gave up mid-handshake is what some tests do

    if tls is not None:
        tls.sni_callback = lambda sock, name, ctx: target.sni.append(name)
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    target.port = server.server_address[1]

    def close():
        server.shutdown()
        server.server_close()

    target.close = close
    return target


@pytest.fixture
def internal_service():
    """An HTTP service on 127.0.0.1 (not allowlisted) whose every answer is a secret."""
    target = _http_target()
    yield target
    target.close()


@pytest.fixture
def http_target_factory():
    """``make(answer)``: HTTP servers on 127.0.0.1 answering ``answer(handler) -> (status, headers, body)``."""
    made: list[Target] = []

    def make(answer=None) -> Target:
        made.append(_http_target(answer))
        return made[-1]

    yield make
    for target in made:
        target.close()


@pytest.fixture
def plaintext_port():
    """A TCP port that accepts connections and writes a line that is not TLS (an SSH or SMTP banner)."""
    listener = socket.create_server(("127.0.0.1", 0))
    target = Target(port=listener.getsockname()[1])
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            target.connections.append(addr)
            try:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2 internal\r\n")
                conn.settimeout(1)
                conn.recv(4096)
            except OSError:
                pass
            finally:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield target
    stop.set()
    listener.close()
    thread.join(2)


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Certificate:
    cert: Path
    key: Path
    hostname: str

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this certificate."""
        return ssl.create_default_context(cafile=str(self.cert))


@pytest.fixture(scope="session")
def certificate(tmp_path_factory) -> Certificate:
    """A self-signed certificate for :data:`PUBLIC_LOOKING` (made with the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            f"/CN={PUBLIC_LOOKING}",
            "-addext",
            f"subjectAltName=DNS:{PUBLIC_LOOKING}",
        ],
        check=True,
        capture_output=True,
    )
    return Certificate(cert, key, PUBLIC_LOOKING)


@pytest.fixture
def tls_target(certificate):
    """An HTTPS server on 127.0.0.1 with :func:`certificate`; ``sni`` records each handshake's server name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(certificate.cert), str(certificate.key))
    target = _http_target(lambda handler: (200, {}, b"ok"), tls=context)
    yield target
    target.close()


class Resolutions:
    """The stub resolver's log: every ``(host, port)`` it was asked for."""

    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.table[host])


_real_getaddrinfo = socket.getaddrinfo


def _local_only_getaddrinfo(host, *args, **kwargs):
    """The guard: numeric hosts and ``localhost`` resolve as usual; any other name fails here."""
    name = host.decode() if isinstance(host, bytes) else host
    if name is None or name in ("localhost", "localhost.localdomain"):
        return _real_getaddrinfo(host, *args, **kwargs)
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in str(name) else socket.AF_INET, str(name).split("%")[0])
    except OSError:
        raise socket.gaierror(socket.EAI_NONAME, f"lookups of {name!r} are refused in these tests") from None
    return _real_getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def no_dns(monkeypatch):
    """No name leaves the machine: only numeric addresses and ``localhost`` resolve (through /etc/hosts)."""
    monkeypatch.setattr(socket, "getaddrinfo", _local_only_getaddrinfo)


@pytest.fixture
def stub_dns(monkeypatch):
    """``stub_dns({name: [addresses]})``: the outbound policy's resolver answers from the table."""
    from hardcount import outbound

    def install(table: dict[str, list[str]]) -> Resolutions:
        resolutions = Resolutions(table)
        monkeypatch.setattr(outbound, "resolve", resolutions)
        return resolutions

    return install


@pytest.fixture
def allow(settings):
    """``allow("127.0.0.1:port")``: put a target on the outbound allowlist for this test."""
    added: list[str] = []

    def add(entry: str) -> None:
        allow_outbound(entry)
        added.append(entry)

    yield add
    for entry in added:
        allow_outbound(entry, allowed=False)
