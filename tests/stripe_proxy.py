"""A fault-injecting, idempotency-honouring HTTP proxy in front of localstripe.

localstripe ignores ``Idempotency-Key`` and never fails on demand. Every gateway test talks to
localstripe through this proxy, which behaves as Stripe's idempotency layer does
(https://docs.stripe.com/api/idempotent_requests):

- the first response forwarded for a key is stored and replayed (with ``Idempotent-Replayed:
  true``) for every later request with the same key and the same method, path and body;
- a different method, path or body under a used key is answered ``400`` with an
  ``idempotency_error``; a second request while the first with that key is still in flight is
  answered ``409`` with an ``idempotency_error``;
- an injected ``500``/``429`` is answered *before* forwarding and is not stored (a front-end
  failure: the endpoint never ran, so Stripe saves nothing and a same-key retry runs it).

Faults are armed from the test through :meth:`StripeProxy.fail_next`:

- ``"timeout"``: hold the request without forwarding it, then drop the connection (the
  client times out; nothing happened upstream);
- ``"timeout_after_forward"``: forward it (the charge happens, the response is stored under
  its key), then hold the answer until the client times out;
- ``"reset"``: forward it, store the response, then reset the connection (the charge
  happened, the response is lost);
- ``"500"`` / ``"429"``: answer that status with a Stripe-shaped error body;
- ``"delay"``: forward it after ``delay_s`` (to widen race windows).

Each fault applies to the next ``times`` requests that ``match`` (a callable on
:class:`ProxyRequest`, or a substring of ``"METHOD /path"``). :attr:`StripeProxy.log` lists
every request with what the proxy did, so tests can count what reached localstripe.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

FAULT_KINDS = ("timeout", "timeout_after_forward", "reset", "500", "429", "delay")


@dataclass(frozen=True)
class ProxyRequest:
    """One request as the proxy saw it."""

    method: str
    path: str
    body: bytes
    idempotency_key: str | None

    @property
    def params(self) -> dict[str, str]:
        """The form-encoded body as a dict (Stripe's v1 encoding)."""
        return dict(parse_qsl(self.body.decode(), keep_blank_values=True))

    @property
    def line(self) -> str:
        return f"{self.method} {urlsplit(self.path).path}"


@dataclass
class _Fault:
    kind: str
    times: int
    match: Callable[[ProxyRequest], bool]
    hold_s: float
    delay_s: float


@dataclass
class LogEntry:
    """What the proxy did with one request: ``action`` is ``forwarded``, ``replayed``,
    ``conflict``, ``in_flight``, ``truncated`` (the body never fully arrived: dropped unforwarded)
    or a fault kind; ``status`` what the client got (None: nothing)."""

    request: ProxyRequest
    action: str
    status: int | None
    response: dict | None = field(default=None, repr=False)


@dataclass
class _Stored:
    fingerprint: str
    status: int
    body: bytes
    content_type: str


def _fingerprint(req: ProxyRequest) -> str:
    # Stripe compares parameters, not bytes: sort the form pairs.
    pairs = sorted(parse_qsl(req.body.decode(), keep_blank_values=True))
    return hashlib.sha256(json.dumps([req.method, urlsplit(req.path).path, pairs]).encode()).hexdigest()


def _error_body(status: int, type_: str, message: str, code: str | None = None) -> bytes:
    error = {"type": type_, "message": message}
    if code:
        error["code"] = code
    return json.dumps({"error": error}).encode()


class StripeProxy:
    """The proxy: ``StripeProxy(upstream).start()``; ``api_base`` is its URL; ``stop()`` ends it."""

    def __init__(self, upstream_base: str, *, upstream_timeout_s: float = 30.0):
        parts = urlsplit(upstream_base)
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port
        self._upstream_timeout_s = upstream_timeout_s
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._stored: dict[str, _Stored] = {}
        self._in_flight: set[str] = set()
        self.log: list[LogEntry] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- control, from the test --------------------------------------------------------------------------------

    @property
    def api_base(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail_next(
        self,
        kind: str,
        *,
        times: int = 1,
        match: str | Callable[[ProxyRequest], bool] | None = None,
        hold_s: float = 3.0,
        delay_s: float = 0.5,
    ) -> None:
        """Arm ``kind`` (one of :data:`FAULT_KINDS`) for the next ``times`` matching requests.

        ``match``: None (every request), a substring of ``"METHOD /path"`` such as
        ``"POST /v1/payment_intents"``, or a predicate. ``hold_s`` is how long a timeout holds
        the connection (make it longer than the client's timeout).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        if match is None:
            predicate = lambda r: True  # noqa: E731
        elif isinstance(match, str):
            predicate = lambda r, s=match: s in r.line  # noqa: E731
        else:
            predicate = match
        with self._lock:
            self._faults.append(_Fault(kind, times, predicate, hold_s, delay_s))

    def clear(self) -> None:
        """Disarm every fault and forget the log (stored idempotent responses are kept, as in Stripe)."""
        with self._lock:
            self._faults.clear()
            self.log.clear()

    def entries(self, line: str | None = None, action: str | None = None) -> list[LogEntry]:
        """Log entries whose ``"METHOD /path"`` contains ``line`` and whose action is ``action``."""
        with self._lock:
            return [
                e
                for e in self.log
                if (line is None or line in e.request.line) and (action is None or e.action == action)
            ]

    def start(self) -> StripeProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add 40 ms to every answer

            def log_message(self, format, *args):  # quiet
                return

            def do_GET(self):
                proxy._handle(self)

            def do_POST(self):
                proxy._handle(self)

            def do_DELETE(self):
                proxy._handle(self)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # aborted connections are the point
                return

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="stripe-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # --- request handling ---------------------------------------------------------------------------------------

    def _take_fault(self, req: ProxyRequest) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.match(req):
                    fault.times -= 1
                    return fault
        return None

    def _record(self, entry: LogEntry) -> None:
        with self._lock:
            self.log.append(entry)

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        key = handler.headers.get("Idempotency-Key")
        req = ProxyRequest(handler.command, handler.path, body, key if handler.command == "POST" else None)
        if len(body) < length:
            # The client died while sending (e.g. SIGKILLed between headers and body): like any
            # HTTP server, Stripe never runs a request whose body did not arrive, and stores
            # nothing under its key.
            self._record(LogEntry(req, "truncated", None))
            handler.close_connection = True
            return

        fault = self._take_fault(req)
        if fault and fault.kind in ("500", "429"):
            status = int(fault.kind)
            type_ = "api_error" if status == 500 else "invalid_request_error"
            code = None if status == 500 else "rate_limit"
            self._record(LogEntry(req, fault.kind, status))
            self._send(handler, status, _error_body(status, type_, f"injected {status}", code), "application/json")
            return
        if fault and fault.kind == "timeout":
            self._record(LogEntry(req, "timeout", None))
            time.sleep(fault.hold_s)
            self._abort(handler)
            return
        if fault and fault.kind == "delay":
            time.sleep(fault.delay_s)

        if req.idempotency_key:
            replay = self._idempotent(req)
            if replay is not None:
                action, status, payload, ctype = replay
                self._record(LogEntry(req, action, status, _json(payload)))
                self._send(handler, status, payload, ctype, replayed=action == "replayed")
                return

        try:
            status, payload, ctype = self._forward(handler, req)
        except OSError as exc:
            if req.idempotency_key:
                with self._lock:
                    self._in_flight.discard(req.idempotency_key)
            self._record(LogEntry(req, "upstream_error", 502))
            self._send(handler, 502, _error_body(502, "api_error", f"upstream unreachable: {exc}"), "application/json")
            return
        if req.idempotency_key:
            with self._lock:
                self._stored[req.idempotency_key] = _Stored(_fingerprint(req), status, payload, ctype)
                self._in_flight.discard(req.idempotency_key)

        if fault and fault.kind == "timeout_after_forward":
            self._record(LogEntry(req, "timeout_after_forward", None, _json(payload)))
            time.sleep(fault.hold_s)
            self._abort(handler)
            return
        if fault and fault.kind == "reset":
            self._record(LogEntry(req, "reset", None, _json(payload)))
            self._abort(handler)
            return
        self._record(LogEntry(req, "forwarded", status, _json(payload)))
        self._send(handler, status, payload, ctype)

    def _idempotent(self, req: ProxyRequest) -> tuple[str, int, bytes, str] | None:
        """A replay/conflict answer for a used key, or None after marking the key in flight."""
        assert req.idempotency_key is not None
        with self._lock:
            stored = self._stored.get(req.idempotency_key)
            if stored is not None:
                if stored.fingerprint != _fingerprint(req):
                    msg = (
                        "Keys for idempotent requests can only be used with the same parameters "
                        "they were first used with."
                    )
                    return "conflict", 400, _error_body(400, "idempotency_error", msg), "application/json"
                return "replayed", stored.status, stored.body, stored.content_type
            if req.idempotency_key in self._in_flight:
                msg = "There is currently another in-progress request using this Idempotent Key."
                return "in_flight", 409, _error_body(409, "idempotency_error", msg), "application/json"
            self._in_flight.add(req.idempotency_key)
        return None

    def _forward(self, handler: BaseHTTPRequestHandler, req: ProxyRequest) -> tuple[int, bytes, str]:
        conn = http.client.HTTPConnection(self._upstream_host, self._upstream_port, timeout=self._upstream_timeout_s)
        try:
            headers = {
                k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection", "content-length")
            }
            headers["Content-Length"] = str(len(req.body))
            conn.request(req.method, req.path, body=req.body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, payload, resp.getheader("Content-Type", "application/json")
        finally:
            conn.close()

    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler, status: int, payload: bytes, ctype: str, *, replayed: bool = False
    ) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", ctype)
        handler.send_header("Content-Length", str(len(payload)))
        handler.send_header("Request-Id", "req_proxy")
        if replayed:
            handler.send_header("Idempotent-Replayed", "true")
        handler.end_headers()
        handler.wfile.write(payload)
        handler.wfile.flush()

    @staticmethod
    def _abort(handler: BaseHTTPRequestHandler) -> None:
        """Reset the connection: SO_LINGER 0 makes close() send RST, so the client sees a reset."""
        try:
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        handler.close_connection = True
        try:
            handler.connection.close()
        except OSError:
            pass


def _json(payload: bytes) -> dict | None:
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None
