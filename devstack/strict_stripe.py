"""The strict dev Stripe: an HTTP proxy in front of localstripe with Stripe's idempotency layer, and faults.

localstripe ignores ``Idempotency-Key`` and never fails on demand. ``make run`` (``serve``) and
every gateway test talk to localstripe through this proxy, which behaves as Stripe's idempotency
layer does (https://docs.stripe.com/api/idempotent_requests; docs/decisions/0124-strict-dev-stripe.md):

- the first response forwarded for a key is stored and replayed (with ``Idempotent-Replayed:
  true``) for every later request with the same key and the same method, path and body, until
  the key is ``key_ttl_s`` old (Stripe prunes keys once they are 24 hours old, the default);
  after that the same key runs the request again, as at Stripe (a second PaymentIntent);
- a different method, path or body under a live key is answered ``400`` with an
  ``idempotency_error``; a second request while the first with that key is still in flight is
  answered ``409`` with an ``idempotency_error``;
- an injected ``500``/``429`` is answered *before* forwarding and is not stored (a front-end
  failure: the endpoint never ran, so Stripe saves nothing and a same-key retry runs it); a 429
  carries ``Retry-After`` (``retry_after_s``, default 1 s);
- objects belong to accounts, as at Stripe: the account of a request is its ``Stripe-Account``
  header (a Connect account), else its secret key (:attr:`ProxyRequest.account`); every object a
  forwarded POST answers with is recorded as created by that account (:meth:`StrictStripe.owner_of`),
  and a request from another account that names it (in the path, the query or the body) is
  answered ``404 resource_missing`` without forwarding, as Stripe answers for an object of
  another account; lists leave out other accounts' objects. Objects the proxy never saw created
  (payment methods a test makes straight at localstripe) belong to no account and are shared.
  The map is in memory: a restarted proxy forgets it;
- with ``store_path``, every stored response is appended to that file (one JSON line, with the
  time the key was first seen) before the client gets it, and the file is read back on start:
  a restarted dev stack still replays what its localstripe store remembers.

Faults are armed in-process through :meth:`StrictStripe.fail_next`:

- ``"timeout"``: hold the request without forwarding it, then drop the connection (the
  client times out; nothing happened upstream);
- ``"timeout_after_forward"``: forward it (the charge happens, the response is stored under
  its key), then hold the answer until the client times out;
- ``"reset"``: forward it, store the response, then reset the connection (the charge
  happened, the response is lost);
- ``"500"`` / ``"429"``: answer that status with a Stripe-shaped error body;
- ``"delay"``: forward it after ``delay_s`` (to widen race windows).

Each fault applies to the next ``times`` requests that ``match`` (a callable on
:class:`ProxyRequest`, or a substring of ``"METHOD /path"``). :attr:`StrictStripe.log` lists
every request with what the proxy did, so tests can count what reached localstripe.

Also in-process: :meth:`StrictStripe.expire_key` forgets one key now, as Stripe may once it is
24 hours old; :meth:`StrictStripe.hold_processing` makes a payment method's charges stay
``processing`` (as Stripe's asynchronous methods do) until :meth:`StrictStripe.settle` moves
the PaymentIntent to ``succeeded`` or fails it (through ``devstack.devstripe``'s control routes,
so localstripe must be served by ``python -m devstack.devstripe``).

It can also act as Stripe's webhook sender (:class:`WebhookSender`; :meth:`StrictStripe.send_webhooks_to`):
every PaymentIntent transition the proxy forwards (a create or confirmation's answer, a card
error's PaymentIntent, a settle or a customer's authentication through the control methods) is
posted to one URL as a Stripe event (``payment_intent.created``, ``payment_intent.succeeded``,
``payment_intent.payment_failed``, ``payment_intent.requires_action``, ``payment_intent.processing``,
``payment_intent.canceled``), and every refund (``refund.created`` and ``charge.refunded`` for a new one,
``refund.updated`` when :meth:`StrictStripe.set_refund_status` moves it), signed as Stripe signs
(``Stripe-Signature: t=…,v1=…``, HMAC-SHA256
of ``"{t}.{body}"`` with the ``whsec_`` secret; https://docs.stripe.com/webhooks#verify-manually),
and retried a few times while the receiver does not answer 2xx. :meth:`StrictStripe.complete_action`
plays the customer who completes (or fails) a ``requires_action`` PaymentIntent's authentication.

Run on its own (``serve`` starts it this way, through :func:`devstack.stack.start_strict_stripe`)::

    python -m devstack.strict_stripe --upstream http://127.0.0.1:8420 --port 8421 \\
        --key-ttl-s 86400 --store var/idempotency.jsonl \\
        --webhook-url http://127.0.0.1:8000/stripe/webhooks/platform   # secret: $HARDCOUNT_DEV_STRIPE_WEBHOOK_SECRET

Standard library only: this module must run without Django's settings.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import http.client
import json
import os
import queue
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

FAULT_KINDS = ("timeout", "timeout_after_forward", "reset", "500", "429", "delay")
# Stripe keeps a key for at least 24 hours, then may prune it.
DEFAULT_KEY_TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class ProxyRequest:
    """One request as the proxy saw it (``idempotency_key`` is None except on POST).

    ``account`` is the account it acts as: its ``Stripe-Account`` header (``acct_…``), else the
    secret key of its ``Authorization`` (``""``: none).
    """

    method: str
    path: str
    body: bytes
    idempotency_key: str | None
    account: str = ""

    @property
    def referenced_ids(self) -> list[str]:
        """Every path segment, query value and form value: the object ids the request may name."""
        parts = urlsplit(self.path)
        values = [seg for seg in parts.path.split("/") if seg]
        values += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
        if self.method == "POST":
            values += [v for _, v in parse_qsl(self.body.decode(errors="replace"), keep_blank_values=True)]
        return values

    @property
    def params(self) -> dict[str, str]:
        """The form-encoded body as a dict (Stripe's v1 encoding)."""
        return dict(parse_qsl(self.body.decode(), keep_blank_values=True))

    @property
    def line(self) -> str:
        """``"METHOD /path"`` without the query string."""
        return f"{self.method} {urlsplit(self.path).path}"


@dataclass
class _Fault:
    kind: str
    times: int
    match: Callable[[ProxyRequest], bool]
    hold_s: float
    delay_s: float
    retry_after_s: float | None = None


def account_of(headers) -> str:
    """The account a request acts as: ``Stripe-Account``, else the bearer (or basic-auth) key; ``""`` for none."""
    connect = (headers.get("Stripe-Account") or "").strip()
    if connect:
        return connect
    scheme, _, credential = (headers.get("Authorization") or "").partition(" ")
    if scheme == "Bearer":
        return credential.strip()
    if scheme == "Basic":
        try:
            return base64.b64decode(credential.strip()).decode().split(":", 1)[0]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


def _owned_objects(value) -> list[tuple[str, str]]:
    """``(id, object)`` of every Stripe object in a JSON answer, nested ones included (lists are not objects)."""
    found: list[tuple[str, str]] = []
    if isinstance(value, dict):
        if isinstance(value.get("id"), str) and isinstance(value.get("object"), str) and value["object"] != "list":
            found.append((value["id"], value["object"]))
        for item in value.values():
            found.extend(_owned_objects(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_owned_objects(item))
    return found


@dataclass
class LogEntry:
    """What the proxy did with one request: ``action`` is ``forwarded``, ``replayed``,
    ``conflict``, ``in_flight``, ``truncated`` (the body never fully arrived: dropped unforwarded),
    ``foreign`` (it named another account's object: 404, not forwarded), ``upstream_error`` or a
    fault kind; ``status`` what the client got (None: nothing)."""

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
    first_seen: float  # wall-clock seconds (time.time()): the key's age survives a restart

    def to_line(self, key: str) -> str:
        # latin-1 maps every byte to one code point: any body round-trips through JSON.
        return json.dumps(
            {
                "key": key,
                "first_seen": self.first_seen,
                "fingerprint": self.fingerprint,
                "status": self.status,
                "content_type": self.content_type,
                "body": self.body.decode("latin-1"),
            }
        )

    @staticmethod
    def from_line(line: str) -> tuple[str, _Stored]:
        d = json.loads(line)
        return d["key"], _Stored(
            d["fingerprint"], int(d["status"]), d["body"].encode("latin-1"), d["content_type"], float(d["first_seen"])
        )


def _fingerprint(req: ProxyRequest) -> str:
    # Stripe compares parameters, not bytes: sort the form pairs.
    pairs = sorted(parse_qsl(req.body.decode(), keep_blank_values=True))
    return hashlib.sha256(json.dumps([req.method, urlsplit(req.path).path, pairs]).encode()).hexdigest()


def _error_body(status: int, type_: str, message: str, code: str | None = None) -> bytes:
    error = {"type": type_, "message": message}
    if code:
        error["code"] = code
    return json.dumps({"error": error}).encode()


class KeyFile:
    """The key store on disk: one JSON line per stored response, appended; a later line for a key wins.

    :meth:`load` reads the live keys back (expired ones and a torn last line are dropped) and
    rewrites the file with only those, so it does not grow across restarts.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def load(self, *, now: float, ttl_s: float) -> dict[str, _Stored]:
        """The keys younger than ``ttl_s`` at ``now`` (seconds); compacts the file. Raises ``OSError``."""
        stored: dict[str, _Stored] = {}
        try:
            with open(self.path, encoding="ascii") as f:
                for line in f:
                    try:
                        key, entry = _Stored.from_line(line)
                    except (ValueError, KeyError, TypeError):
                        continue  # a line torn by a kill mid-append
                    stored[key] = entry
        except FileNotFoundError:
            pass
        live = {k: v for k, v in stored.items() if now - v.first_seen < ttl_s}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "w", encoding="ascii") as f:
            for key, entry in live.items():
                f.write(entry.to_line(key) + "\n")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="ascii")
        return live

    def append(self, key: str, entry: _Stored) -> None:
        """Write one entry through to the OS (a SIGKILL of this process loses nothing written)."""
        if self._file is not None:
            self._file.write(entry.to_line(key) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (appends after this are dropped)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class StrictStripe:
    """The proxy: ``StrictStripe(upstream).start()``; ``api_base`` is its URL; ``stop()`` ends it.

    ``key_ttl_s``: seconds a key is remembered after it was first seen (default 24 h).
    ``store_path``: the key file (None: memory only). ``keep_log``: keep :attr:`log` (tests);
    off, nothing is kept per request, so a long-running dev stack does not grow.
    ``access_log``: called with one line per request. ``clock``: wall-clock seconds, for the TTL.
    """

    def __init__(
        self,
        upstream_base: str,
        *,
        upstream_timeout_s: float = 30.0,
        key_ttl_s: float = DEFAULT_KEY_TTL_S,
        store_path: Path | None = None,
        keep_log: bool = True,
        access_log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if key_ttl_s <= 0:
            raise ValueError("key_ttl_s must be positive")
        parts = urlsplit(upstream_base)
        self.upstream_base = upstream_base
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port
        self._upstream_timeout_s = upstream_timeout_s
        self.key_ttl_s = key_ttl_s
        self._clock = clock
        self._keep_log = keep_log
        self._access_log = access_log
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._key_file = KeyFile(store_path) if store_path is not None else None
        self._stored: dict[str, _Stored] = {}
        self._in_flight: set[str] = set()
        # object id -> (account that created it, object type)
        self._owners: dict[str, tuple[str, str]] = {}
        self.log: list[LogEntry] = []
        self.webhooks: WebhookSender | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- control, from the test --------------------------------------------------------------------------------

    @property
    def api_base(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
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
        account: str | None = None,
        retry_after_s: float | None = 1.0,
    ) -> None:
        """Arm ``kind`` (one of :data:`FAULT_KINDS`) for the next ``times`` matching requests.

        ``match``: None (every request), a substring of ``"METHOD /path"`` such as
        ``"POST /v1/payment_intents"``, or a predicate. ``account``: only requests of that
        account (:attr:`ProxyRequest.account`, a key or an ``acct_…`` id). ``hold_s`` is how long
        a timeout holds the connection (make it longer than the client's timeout).
        ``retry_after_s``: the ``Retry-After`` of an injected 429 (None: no header). Raises
        ``ValueError`` for an unknown kind.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        if match is None:
            predicate = lambda r: True  # noqa: E731
        elif isinstance(match, str):
            predicate = lambda r, s=match: s in r.line  # noqa: E731
        else:
            predicate = match
        if account is not None:
            predicate = lambda r, p=predicate, a=account: r.account == a and p(r)  # noqa: E731
        with self._lock:
            self._faults.append(_Fault(kind, times, predicate, hold_s, delay_s, retry_after_s))

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

    def expire_key(self, key: str) -> bool:
        """Forget ``key`` now, as Stripe may once it is 24 hours old: its next request runs again.

        True when the key was remembered. With a key file, a line marking it expired is appended,
        so a restart does not bring it back.
        """
        with self._lock:
            entry = self._stored.pop(key, None)
            if entry is not None and self._key_file is not None:
                self._key_file.append(
                    key, _Stored(entry.fingerprint, entry.status, entry.body, entry.content_type, 0.0)
                )
        return entry is not None

    def hold_processing(self, payment_method: str) -> dict:
        """Make every later charge of ``payment_method`` stay pending: its PaymentIntent answers ``processing``.

        Returns the payment method (as localstripe exports it). Raises ``RuntimeError`` if the
        upstream refuses (an unknown payment method, or a localstripe without the control routes).
        """
        return self._control(f"/_hardcount/payment_methods/{payment_method}/processing", {})

    def settle(self, payment_intent: str, outcome: str = "succeeded", *, decline_code: str = "") -> dict:
        """Settle a ``processing`` PaymentIntent: ``outcome`` ``succeeded``, or ``failed`` (``decline_code``,
        default ``generic_decline``). Returns the PaymentIntent. Raises ``RuntimeError`` if the upstream refuses
        (not processing, an unknown outcome)."""
        params = {"outcome": outcome, **({"decline_code": decline_code} if decline_code else {})}
        return self._control(f"/_hardcount/payment_intents/{payment_intent}/settle", params)

    def complete_action(self, payment_intent: str, outcome: str = "succeeded") -> dict:
        """Play the customer who authenticates a ``requires_action`` PaymentIntent (3-D Secure) with its client secret.

        ``outcome`` ``succeeded``: the charge runs (the PaymentIntent ``succeeded``, or ``processing``
        for a held payment method); ``failed``: authentication fails and the PaymentIntent is
        ``requires_payment_method`` with ``last_payment_error.code``
        ``payment_intent_authentication_failure``, as at Stripe. Returns the PaymentIntent. Raises
        ``ValueError`` for another outcome, ``RuntimeError`` if the upstream refuses (not requiring action).
        """
        if outcome not in ("succeeded", "failed"):
            raise ValueError("outcome must be succeeded or failed")
        intent = self._control(f"/v1/payment_intents/{payment_intent}", None)
        params = {"client_secret": intent.get("client_secret") or "", "success": str(outcome == "succeeded").lower()}
        return self._control(f"/v1/payment_intents/{payment_intent}/_authenticate", params)

    def send_webhooks_to(self, url: str, secret: str, **options) -> WebhookSender:
        """Send the PaymentIntent transitions forwarded from now on to ``url`` as signed Stripe events
        (:class:`WebhookSender`, ``options`` its own). A sender already set is stopped first."""
        self.stop_webhooks()
        self.webhooks = WebhookSender(url, secret, **options)
        return self.webhooks

    def stop_webhooks(self) -> None:
        """Send no more events (those still queued are dropped)."""
        sender, self.webhooks = self.webhooks, None
        if sender is not None:
            sender.stop()

    def set_refund_status(self, refund: str, status: str) -> dict:
        """Move a refund to ``status`` (``failed``, ``canceled``, ``pending``, ``succeeded``), as Stripe moves a
        refund later on its own, with the ``refund.updated`` event it sends. Returns the refund. Raises
        ``RuntimeError`` if the upstream refuses (an unknown refund or status)."""
        return self._control(f"/_hardcount/refunds/{refund}/status", {"status": status})

    def _observe(self, payload: bytes, idempotency_key: str | None = None) -> None:
        sender = self.webhooks
        if sender is None:
            return
        for intent in _payment_intents_in(payload):
            sender.observe(intent, request_idempotency_key=idempotency_key)
        body = _json(payload)
        if body is not None and body.get("object") == "refund" and isinstance(body.get("charge"), str):
            try:
                charge = self._control(f"/v1/charges/{body['charge']}", None)
            except (OSError, RuntimeError, ValueError):
                charge = None
            sender.observe_refund(body, charge, request_idempotency_key=idempotency_key)

    def _control(self, path: str, params: dict[str, str] | None) -> dict:
        """POST a control request straight to the upstream (not through the proxy, not logged); ``params`` None: GET."""
        body = urlencode(params or {}).encode()
        conn = http.client.HTTPConnection(self._upstream_host, self._upstream_port, timeout=self._upstream_timeout_s)
        try:
            conn.request(
                "GET" if params is None else "POST",
                path,
                body=body,
                headers={
                    "Authorization": "Bearer sk_test_strict_stripe_control",
                    "Content-Type": "application/x-www-form-urlencoded",
                    "Content-Length": str(len(body)),
                },
            )
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {payload[:500]!r}")
        if params is not None:
            self._observe(payload)
        return json.loads(payload)

    def owner_of(self, object_id: str) -> str | None:
        """The account (key or ``acct_…``) that created ``object_id`` through the proxy; None when none did."""
        with self._lock:
            owner = self._owners.get(object_id)
        return owner[0] if owner else None

    def objects_of(self, account: str) -> dict[str, str]:
        """The objects ``account`` created through the proxy: id -> object type."""
        with self._lock:
            return {oid: kind for oid, (owner, kind) in self._owners.items() if owner == account}

    def _foreign_reference(self, req: ProxyRequest) -> tuple[str, str] | None:
        """``(id, object)`` of the first object another account owns that ``req`` names, or None."""
        with self._lock:
            for value in req.referenced_ids:
                owner = self._owners.get(value)
                if owner is not None and owner[0] != req.account:
                    return value, owner[1]
        return None

    def _claim(self, req: ProxyRequest, payload: bytes) -> None:
        """Record the objects a forwarded POST answered with as ``req.account``'s (first creator wins)."""
        answer = _json(payload)
        if answer is None or not req.account:
            return
        with self._lock:
            for object_id, kind in _owned_objects(answer):
                self._owners.setdefault(object_id, (req.account, kind))

    def _own_list(self, req: ProxyRequest, payload: bytes) -> bytes:
        """A list answer without the objects of other accounts (others unchanged)."""
        answer = _json(payload)
        if answer is None or answer.get("object") != "list" or not isinstance(answer.get("data"), list):
            return payload
        with self._lock:
            kept = [
                item
                for item in answer["data"]
                if not (isinstance(item, dict) and self._owners.get(item.get("id"), (req.account,))[0] != req.account)
            ]
        if len(kept) == len(answer["data"]):
            return payload
        return json.dumps({**answer, "data": kept}).encode()

    def stored_keys(self) -> dict[str, float]:
        """Every remembered key with the wall-clock time it was first seen (expired ones included until used)."""
        with self._lock:
            return {key: entry.first_seen for key, entry in self._stored.items()}

    def start(self, *, port: int = 0, sock: socket.socket | None = None) -> StrictStripe:
        """Load the key file, then serve on ``127.0.0.1:port`` (0: a free one) or the listening ``sock``.

        Returns self. Raises ``OSError`` if the port is taken or the key file cannot be written.
        """
        if self._key_file is not None:
            self._stored = self._key_file.load(now=self._clock(), ttl_s=self.key_ttl_s)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add 40 ms to every answer

            def log_message(self, format, *args):  # quiet: the access log is ours
                return

            def do_GET(self):
                proxy._handle(self)

            def do_POST(self):
                proxy._handle(self)

            def do_DELETE(self):
                proxy._handle(self)

        class Server(ThreadingHTTPServer):
            # The drain sends a page's charges at once (docs/decisions/0186): listen for more than the default 5.
            request_queue_size = 256

            def handle_error(self, request, client_address):  # aborted connections are the point
                return

        if sock is None:
            self._server = Server(("127.0.0.1", port), Handler)
        else:
            self._server = Server(sock.getsockname(), Handler, bind_and_activate=False)
            self._server.socket.close()
            self._server.socket = sock
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="strict-stripe", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, drain_s: float = 5.0) -> None:
        """Stop serving, wait up to ``drain_s`` seconds for keyed requests being forwarded, close the key file."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        # A request localstripe is running now must still be stored, or its retry would charge again.
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._in_flight:
                    break
            time.sleep(0.05)
        if self._key_file is not None:
            with self._lock:
                self._key_file.close()
        self.stop_webhooks()

    # --- request handling ---------------------------------------------------------------------------------------

    def _take_fault(self, req: ProxyRequest) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.match(req):
                    fault.times -= 1
                    return fault
        return None

    def _record(self, entry: LogEntry, payload: bytes | None = None) -> None:
        if self._keep_log:
            if payload is not None:
                entry.response = _json(payload)
            with self._lock:
                self.log.append(entry)
        if self._access_log is not None:
            key = f" key={entry.request.idempotency_key}" if entry.request.idempotency_key else ""
            self._access_log(f"{entry.request.line}{key} {entry.action} {entry.status or '-'}")

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        key = handler.headers.get("Idempotency-Key")
        req = ProxyRequest(
            handler.command,
            handler.path,
            body,
            key if handler.command == "POST" else None,
            account_of(handler.headers),
        )
        if len(body) < length:
            # The client died while sending (e.g. SIGKILLed between headers and body): like any
            # HTTP server, Stripe never runs a request whose body did not arrive, and stores
            # nothing under its key.
            self._record(LogEntry(req, "truncated", None))
            handler.close_connection = True
            return
        seen_at = self._clock()

        fault = self._take_fault(req)
        if fault and fault.kind in ("500", "429"):
            status = int(fault.kind)
            type_ = "api_error" if status == 500 else "invalid_request_error"
            code = None if status == 500 else "rate_limit"
            self._record(LogEntry(req, fault.kind, status))
            headers = (
                {"Retry-After": f"{fault.retry_after_s:g}"} if status == 429 and fault.retry_after_s is not None else {}
            )
            body = _error_body(status, type_, f"injected {status}", code)
            self._send(handler, status, body, "application/json", headers=headers)
            return
        if fault and fault.kind == "timeout":
            self._record(LogEntry(req, "timeout", None))
            time.sleep(fault.hold_s)
            self._abort(handler)
            return
        if fault and fault.kind == "delay":
            time.sleep(fault.delay_s)

        foreign = self._foreign_reference(req)
        if foreign is not None:
            object_id, kind = foreign
            self._record(LogEntry(req, "foreign", 404))
            missing = _error_body(404, "invalid_request_error", f"No such {kind}: '{object_id}'", "resource_missing")
            self._send(handler, 404, missing, "application/json")
            return

        too_large = _amount_too_large(req)
        if too_large is not None:
            # Stripe refuses it while validating the parameters, before the request runs: nothing is stored
            # under its key (https://docs.stripe.com/api/idempotent_requests).
            self._record(LogEntry(req, "refused", 400))
            self._send(handler, 400, too_large, "application/json")
            return

        if req.idempotency_key:
            replay = self._idempotent(req)
            if replay is not None:
                action, status, payload, ctype = replay
                self._record(LogEntry(req, action, status), payload)
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
        if req.method == "POST":
            # A declined create answers 402 with the PaymentIntent it made inside the error: claimed too.
            self._claim(req, payload)
        elif req.method == "GET" and status == 200:
            payload = self._own_list(req, payload)
        if req.idempotency_key:
            entry = _Stored(_fingerprint(req), status, payload, ctype, seen_at)
            with self._lock:
                self._stored[req.idempotency_key] = entry
                # On disk before the client can hear of it: a restarted stack replays what it was told.
                if self._key_file is not None:
                    self._key_file.append(req.idempotency_key, entry)
                self._in_flight.discard(req.idempotency_key)

        if fault and fault.kind in ("timeout_after_forward", "reset") and req.method == "POST":
            self._observe(payload, req.idempotency_key)  # it ran upstream: Stripe tells of it
        if fault and fault.kind == "timeout_after_forward":
            self._record(LogEntry(req, "timeout_after_forward", None), payload)
            time.sleep(fault.hold_s)
            self._abort(handler)
            return
        if fault and fault.kind == "reset":
            self._record(LogEntry(req, "reset", None), payload)
            self._abort(handler)
            return
        self._record(LogEntry(req, "forwarded", status), payload)
        self._send(handler, status, payload, ctype)
        if req.method == "POST":
            self._observe(payload, req.idempotency_key)

    def _idempotent(self, req: ProxyRequest) -> tuple[str, int, bytes, str] | None:
        """A replay/conflict answer for a live key, or None after marking the key in flight."""
        assert req.idempotency_key is not None
        with self._lock:
            stored = self._stored.get(req.idempotency_key)
            if stored is not None and self._clock() - stored.first_seen >= self.key_ttl_s:
                # Pruned, as Stripe prunes a key once it is old enough: the request runs again.
                del self._stored[req.idempotency_key]
                stored = None
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
        handler: BaseHTTPRequestHandler,
        status: int,
        payload: bytes,
        ctype: str,
        *,
        replayed: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        try:
            handler.send_response(status)
            for name, value in (headers or {}).items():
                handler.send_header(name, value)
            handler.send_header("Content-Type", ctype)
            handler.send_header("Content-Length", str(len(payload)))
            handler.send_header("Request-Id", "req_proxy")
            if replayed:
                handler.send_header("Idempotent-Replayed", "true")
            handler.end_headers()
            handler.wfile.write(payload)
            handler.wfile.flush()
        except OSError:
            # The client is gone (killed mid-request): what ran upstream is already stored.
            handler.close_connection = True

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


# --- Stripe's webhook sender ---------------------------------------------------------------------------------------

# The env variable the command line reads the webhook signing secret from (never an argument: ps shows those).
WEBHOOK_SECRET_ENV = "HARDCOUNT_DEV_STRIPE_WEBHOOK_SECRET"  # noqa: S105 (a variable name)
# The API version the events claim (the one the ``stripe`` library pins is what Hardcount reads).
WEBHOOK_API_VERSION = "2024-06-20"


def generate_webhook_secret() -> str:
    """A new ``whsec_…`` signing secret, as Stripe shows for a webhook endpoint."""
    return "whsec_" + secrets.token_hex(24)


def stripe_signature(payload: bytes, secret: str, timestamp: int) -> str:
    """The ``Stripe-Signature`` header of ``payload`` sent at ``timestamp`` (Unix seconds), as Stripe computes it:
    ``t={timestamp},v1={hex HMAC-SHA256 of "{timestamp}.{payload}" keyed with the whole secret}``."""
    signed = f"{timestamp}.".encode() + payload
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def payment_intent_event_type(intent: dict) -> str | None:
    """The event Stripe sends when a PaymentIntent enters ``intent``'s status, or None (no event for that status)."""
    status = intent.get("status")
    if status == "requires_payment_method":
        return "payment_intent.payment_failed" if intent.get("last_payment_error") else None
    return {
        "succeeded": "payment_intent.succeeded",
        "processing": "payment_intent.processing",
        "requires_action": "payment_intent.requires_action",
        "canceled": "payment_intent.canceled",
    }.get(status)


@dataclass
class WebhookDelivery:
    """One event sent: ``statuses`` the receiver's answers in order (None: no answer), last one final."""

    event: dict
    statuses: list[int | None] = field(default_factory=list)

    @property
    def delivered(self) -> bool:
        """True once the receiver answered 2xx."""
        return bool(self.statuses) and self.statuses[-1] is not None and 200 <= self.statuses[-1] < 300


class WebhookSender:
    """Posts Stripe-format events to ``url``, signed with ``secret``, one at a time in the order made.

    :meth:`observe` is told every PaymentIntent the proxy sees; a PaymentIntent seen for the first
    time makes ``payment_intent.created``, and each change of status the event Stripe sends for
    the new one (:func:`payment_intent_event_type`). A delivery that gets no 2xx is tried again
    after ``retry_delays_s`` (Stripe keeps trying for days; a dev stack a few seconds), then
    given up. ``paused``: events queue until :meth:`resume` (a test's control of when they land).
    """

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        timeout_s: float = 10.0,
        retry_delays_s: tuple[float, ...] = (0.5, 2.0, 5.0),
        clock: Callable[[], float] = time.time,
        log: Callable[[str], None] | None = None,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"webhook url must be http(s)://host/…, not {url!r}")
        if not secret.startswith("whsec_"):
            raise ValueError("the webhook signing secret must be a whsec_… secret")
        self.url, self._secret, self._timeout_s = url, secret, timeout_s
        self._retry_delays_s, self._clock, self._log = retry_delays_s, clock, log
        self._lock = threading.Lock()
        self._statuses: dict[str, str] = {}
        self._queue: queue.Queue[WebhookDelivery | None] = queue.Queue()
        self._resumed = threading.Event()
        self._resumed.set()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self.deliveries: list[WebhookDelivery] = []
        self._thread = threading.Thread(target=self._run, name="strict-stripe-webhooks", daemon=True)
        self._thread.start()

    def observe(self, intent: dict, *, request_idempotency_key: str | None = None) -> None:
        """Note a PaymentIntent object the gateway answered with; queue the events its change of status makes."""
        intent_id = intent.get("id")
        if intent.get("object") != "payment_intent" or not isinstance(intent_id, str):
            return
        status = intent.get("status") or ""
        with self._lock:
            previous = self._statuses.get(intent_id)
            self._statuses[intent_id] = status
        if previous == status:
            return
        types = ([] if previous is not None else ["payment_intent.created"]) + [
            t for t in (payment_intent_event_type(intent),) if t
        ]
        for type_ in types:
            self.send(type_, intent, request_idempotency_key=request_idempotency_key)

    def observe_refund(self, refund: dict, charge: dict | None, *, request_idempotency_key: str | None = None) -> None:
        """Note a refund the gateway answered with: a new one makes ``refund.created`` and ``charge.refunded``
        (about ``charge``, its amounts after the refund), a change of status ``refund.updated``."""
        refund_id = refund.get("id")
        if not isinstance(refund_id, str):
            return
        status = refund.get("status") or ""
        with self._lock:
            previous = self._statuses.get(refund_id)
            self._statuses[refund_id] = status
        if previous is None:
            self.send("refund.created", refund, request_idempotency_key=request_idempotency_key)
            if charge is not None:
                self.send("charge.refunded", charge, request_idempotency_key=request_idempotency_key)
        elif previous != status:
            self.send("refund.updated", refund, request_idempotency_key=request_idempotency_key)

    def send(self, type_: str, obj: dict, *, request_idempotency_key: str | None = None) -> dict:
        """Queue one event of ``type_`` about ``obj`` (any Stripe object); returns the event."""
        event = {
            "id": "evt_" + secrets.token_hex(12),
            "object": "event",
            "api_version": WEBHOOK_API_VERSION,
            "created": int(self._clock()),
            "livemode": bool(obj.get("livemode", False)),
            "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": request_idempotency_key},
            "type": type_,
            "data": {"object": obj},
        }
        delivery = WebhookDelivery(event)
        with self._lock:
            self.deliveries.append(delivery)
            self._pending += 1
        self._queue.put(delivery)
        return event

    def pause(self) -> None:
        """Hold every event queued from now until :meth:`resume`."""
        self._resumed.clear()

    def resume(self) -> None:
        """Send what :meth:`pause` held, in order."""
        self._resumed.set()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued event was delivered or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self) -> None:
        """Stop sending (queued events are dropped)."""
        self._resumed.set()
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            delivery = self._queue.get()
            if delivery is None:
                return
            self._resumed.wait()
            try:
                self._deliver(delivery)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _deliver(self, delivery: WebhookDelivery) -> None:
        payload = json.dumps(delivery.event).encode()
        for delay in (0.0, *self._retry_delays_s):
            time.sleep(delay)
            status = self._post(payload)
            delivery.statuses.append(status)
            if self._log is not None:
                self._log(f"webhook {delivery.event['type']} {delivery.event['id']} -> {status or 'no answer'}")
            if delivery.delivered:
                return

    def _post(self, payload: bytes) -> int | None:
        parts = urlsplit(self.url)
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=self._timeout_s)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(
                "POST",
                path or "/",
                body=payload,
                headers={
                    "Content-Type": "application/json; charset=utf-8",
                    "Stripe-Signature": stripe_signature(payload, self._secret, int(self._clock())),
                    "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
                },
            )
            response = conn.getresponse()
            response.read()
            return response.status
        except OSError:
            return None
        finally:
            conn.close()


# Stripe's ceiling for an amount: eight digits in the currency's minor unit ($999,999.99;
# https://docs.stripe.com/currencies#minimum-and-maximum-charge-amounts).
MAX_AMOUNT = 99_999_999


def _amount_too_large(req: ProxyRequest) -> bytes | None:
    """Stripe's 400 ``amount_too_large`` for a PaymentIntent create or update over :data:`MAX_AMOUNT`, else None."""
    if req.method != "POST" or not req.path.split("?")[0].startswith("/v1/payment_intents"):
        return None
    try:
        amount = int(req.params.get("amount", "0"))
    except (UnicodeDecodeError, ValueError):
        return None
    if amount <= MAX_AMOUNT:
        return None
    body = json.loads(
        _error_body(400, "invalid_request_error", "Amount must be no more than 99,999,999.", "amount_too_large")
    )
    body["error"]["param"] = "amount"
    return json.dumps(body).encode()


def _payment_intents_in(payload: bytes) -> list[dict]:
    """The PaymentIntent objects an answer carries: itself, or a card error's ``payment_intent``."""
    body = _json(payload)
    if body is None:
        return []
    if body.get("object") == "payment_intent":
        return [body]
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("payment_intent"), dict):
        return [error["payment_intent"]]
    return []


def _json(payload: bytes) -> dict | None:
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def main(argv: list[str] | None = None) -> None:
    """Serve the strict dev Stripe in front of ``--upstream`` until SIGTERM or Ctrl-C (exit 0)."""
    parser = argparse.ArgumentParser(prog="python -m devstack.strict_stripe", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="localstripe's base URL, e.g. http://127.0.0.1:8420")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="port on 127.0.0.1 to listen on (0: a free one)")
    where.add_argument("--fd", type=int, help="an inherited listening socket to serve on")
    parser.add_argument(
        "--key-ttl-s",
        type=float,
        default=DEFAULT_KEY_TTL_S,
        help=f"seconds an idempotency key is remembered (default {DEFAULT_KEY_TTL_S:.0f}, Stripe's 24 h)",
    )
    parser.add_argument("--store", type=Path, default=None, help="key file (JSON lines); default: memory only")
    parser.add_argument("--quiet", action="store_true", help="no access log line per request")
    parser.add_argument(
        "--webhook-url",
        default=None,
        help=f"send signed Stripe events of PaymentIntent transitions here (secret: ${WEBHOOK_SECRET_ENV})",
    )
    args = parser.parse_args(argv)
    webhook_secret = os.environ.get(WEBHOOK_SECRET_ENV, "")
    if args.webhook_url and not webhook_secret.startswith("whsec_"):
        parser.error(f"--webhook-url needs a whsec_… secret in ${WEBHOOK_SECRET_ENV}")

    def write(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    proxy = StrictStripe(
        args.upstream,
        key_ttl_s=args.key_ttl_s,
        store_path=args.store,
        keep_log=False,
        access_log=None if args.quiet else write,
    )
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    proxy.start(port=args.port or 0, sock=sock)
    if args.webhook_url:
        proxy.send_webhooks_to(args.webhook_url, webhook_secret, log=None if args.quiet else write)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    write(
        f"strict dev Stripe on {proxy.api_base} in front of {args.upstream}: idempotency keys kept "
        f"{args.key_ttl_s:g} s, {len(proxy.stored_keys())} live, store {args.store or 'in memory'}"
        + (f"; webhooks to {args.webhook_url}" if args.webhook_url else "")
    )
    while not done.wait(1.0):
        pass
    proxy.stop()


if __name__ == "__main__":
    main()
