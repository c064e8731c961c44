"""The development stack's moving parts: localstripe, the strict dev Stripe, gunicorn, and a webhook receiver.

``python manage.py serve`` (and so ``make run``) uses these to run Hardcount on one
machine with nothing but Python. Nothing here imports Django, so the localstripe child
process does not load the settings (which would start the embedded database).

- :class:`ChildProcess` starts a child in its own process group (a terminal's Ctrl-C reaches
  only ``serve``, which then stops its children in order) that is sent SIGTERM if ``serve``
  dies without stopping it (Linux ``PR_SET_PDEATHSIG``).
- :func:`start_localstripe` runs ``localstripe`` on a port the parent has already bound
  (no race for a "free" port), with the gateway's fixes (``devstack.devstripe``), and keeps
  its store in a file of our choosing: upstream localstripe pickles every write to
  ``/tmp/localstripe.pickle``, a file every instance on the machine would share.
- :func:`start_strict_stripe` runs :mod:`devstack.strict_stripe` in front of it (Stripe's
  idempotency layer, which localstripe lacks), its keys kept in a file beside localstripe's store
  (docs/decisions/0124-strict-dev-stripe.md), and Stripe's webhook sender: its PaymentIntent
  events go, signed, to the product's ``/stripe/webhooks/platform`` (docs/decisions/0135).
- :func:`start_gunicorn` runs the web process with ``hardcount/gunicorn.conf.py``;
  :class:`SchedulerLogView` is what ``serve`` prints of its lines.
- :class:`WebhookReceiver` is a local HTTP endpoint that logs the webhooks it receives (each one,
  or a sample while they arrive faster than it can show) and whether their ``Hardcount-Signature``
  verifies (docs/reference/webhooks.md, with :mod:`outbox.signing`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from devstack.strict_stripe import WEBHOOK_SECRET_ENV

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: die with SIGTERM when the parent dies (Linux), even if it was SIGKILLed."""

    def setup() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(1)

    return setup


class ChildProcess:
    """A child process of the dev stack, started in its own process group.

    ``stop()`` sends SIGTERM to the child, waits ``timeout_s`` seconds, then SIGKILLs its
    whole process group (a gunicorn arbiter's workers included).
    """

    def __init__(self, name: str, args: list[str], *, env: dict[str, str], cwd: Path | None = None, **popen):
        self.name = name
        self.process = subprocess.Popen(  # noqa: S603 (our own interpreter and arguments)
            args,
            env=env,
            cwd=cwd,
            process_group=0,
            preexec_fn=_child_setup(os.getpid()),  # noqa: PLW1509 (spawned before any thread starts)
            **popen,
        )
        # The thread reading the child's output when it goes to a pipe (start_gunicorn's ``output``).
        self.output_thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The exit code, or None while the child runs."""
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL the child's whole process group now."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to ``timeout_s`` seconds, then SIGKILL the group. Returns the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
        self.kill()  # whatever is left in the group (a worker that outlived its arbiter) goes too
        return self.process.wait()


def bind_local_port(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port). Raises ``OSError`` if taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` can be bound right now."""
    try:
        bind_local_port(port, host).close()
    except OSError:
        return False
    return True


def wait_for_http(url: str, *, timeout_s: float, alive: Callable[[], bool] = lambda: True, headers=None) -> int:
    """Poll ``url`` until it answers any HTTP status; returns the status.

    Raises ``TimeoutError`` after ``timeout_s`` seconds, or ``RuntimeError`` as soon as
    ``alive()`` turns False (the process that should answer has exited).
    """
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 (http to localhost)
    while True:
        if not alive():
            raise RuntimeError(f"the process serving {url} exited before it answered")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.2)


# --- localstripe --------------------------------------------------------------------------------------------------


class LocalStripe:
    """A running localstripe child: ``api_base`` (``http://127.0.0.1:<port>``) and its store file."""

    def __init__(self, child: ChildProcess, port: int, store_path: Path):
        self.child = child
        self.port = port
        self.store_path = store_path
        self.api_base = f"http://127.0.0.1:{port}"

    def stop(self, timeout_s: float = 5.0) -> int:
        """Stop it (it flushes its store on SIGTERM). Returns the exit code."""
        return self.child.stop(timeout_s)


def start_localstripe(
    *, store_path: Path, log_path: Path | None = None, port: int = 0, api_key: str = "sk_test_devstack"
) -> LocalStripe:
    """Start localstripe on ``127.0.0.1:port`` (0: a free port), persisting to ``store_path``.

    The store (every customer, PaymentMethod and PaymentIntent) is loaded from
    ``store_path`` if it exists, so gateway ids the database refers to survive a restart.
    Output goes to ``log_path`` (default: inherited). Returns once localstripe answers an
    authenticated request; raises ``RuntimeError`` or ``TimeoutError`` if it does not.
    """
    store_path.parent.mkdir(parents=True, exist_ok=True)
    sock = bind_local_port(port)
    port = sock.getsockname()[1]
    out = open(log_path, "ab") if log_path else None
    try:
        child = ChildProcess(
            "localstripe",
            [
                sys.executable,
                "-m",
                "devstack.stack",
                "localstripe",
                "--fd",
                str(sock.fileno()),
                "--store",
                str(store_path),
            ],
            env=dict(os.environ),
            cwd=Path(__file__).resolve().parent.parent,
            pass_fds=(sock.fileno(),),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        sock.close()
        if out:
            out.close()
    stripe = LocalStripe(child, port, store_path)
    try:
        wait_for_http(
            f"{stripe.api_base}/v1/customers?limit=1",
            timeout_s=20,
            alive=lambda: child.poll() is None,
            headers={"Authorization": f"Bearer {api_key}"},
        )
    except Exception:
        stripe.stop()
        raise
    return stripe


def _run_localstripe(fd: int, store_path: Path) -> None:
    """Child side: serve localstripe's aiohttp app on the inherited socket ``fd``."""
    import pickle

    from aiohttp import web
    from localstripe import resources

    try:
        from devstack.devstripe import _index_store_by_type, apply_localstripe_fixes
    except ImportError:  # the gateway's localstripe fixes are optional here
        pass
    else:
        apply_localstripe_fixes()  # before the server module registers its routes
        # Lists by type without scanning the whole store: without it every charge gets slower as
        # the demo book is billed (each Charge renders its refunds through a list).
        _index_store_by_type()
    from localstripe.server import app

    dirty = threading.Event()

    def load(store) -> None:
        try:
            with open(store_path, "rb") as f:
                saved = pickle.load(f)  # noqa: S301 (our own file, written below)
        except FileNotFoundError:
            return
        store.clear()
        store.update(saved)

    last_dump = {"at": 0.0, "took": 0.0}

    def flush(*, force: bool = False) -> None:
        if not dirty.is_set():
            return
        # The dump blocks the event loop for as long as it takes (a second or more once a demo
        # book of 20,000 is billed): keep it under a tenth of localstripe's time.
        if not force and time.monotonic() - last_dump["at"] < 10 * last_dump["took"]:
            return
        dirty.clear()
        started = time.monotonic()
        tmp = store_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(dict(resources.store), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, store_path)
        last_dump["at"], last_dump["took"] = time.monotonic(), time.monotonic() - started

    # Upstream pickles the whole store to /tmp on every write; mark it dirty instead and write
    # our own file at most once a second (less often when a dump is slow), and on shutdown.
    resources.Store.try_load_from_disk = load
    resources.Store.dump_to_disk = lambda store: dirty.set()
    load(resources.store)

    async def flusher(_app):
        import asyncio

        async def loop():
            while True:
                await asyncio.sleep(1)
                flush()

        task = asyncio.ensure_future(loop())
        yield
        task.cancel()
        flush(force=True)

    app.cleanup_ctx.append(flusher)
    sock = socket.socket(fileno=fd)
    access = logging.getLogger("aiohttp.access")
    access.setLevel(logging.INFO)
    access.addHandler(logging.StreamHandler())
    web.run_app(app, sock=sock, access_log=access, print=None)


# --- the strict dev Stripe -----------------------------------------------------------------------------------------


class StrictStripeProcess:
    """A running strict dev Stripe child in front of localstripe: ``api_base`` and its key file."""

    def __init__(self, child: ChildProcess, port: int, upstream: str, store_path: Path | None, key_ttl_s: float):
        self.child = child
        self.port = port
        self.upstream = upstream
        self.store_path = store_path
        self.key_ttl_s = key_ttl_s
        self.api_base = f"http://127.0.0.1:{port}"

    def stop(self, timeout_s: float = 5.0) -> int:
        """Stop it (SIGTERM; every key is already on disk). Returns the exit code."""
        return self.child.stop(timeout_s)


def start_strict_stripe(
    *,
    upstream: str,
    store_path: Path | None,
    key_ttl_s: float,
    log_path: Path | None = None,
    port: int = 0,
    api_key: str = "sk_test_devstack",
    webhook_url: str | None = None,
    webhook_secret: str = "",
) -> StrictStripeProcess:
    """Start ``python -m devstack.strict_stripe`` on ``127.0.0.1:port`` (0: a free port) in front of ``upstream``.

    Idempotency keys are remembered ``key_ttl_s`` seconds and kept in ``store_path`` (None: in
    memory), so they survive a restart. ``webhook_url``: it posts its PaymentIntent events there,
    signed with ``webhook_secret`` (a ``whsec_`` secret, handed over in the child's environment,
    never on its command line). Output (one line per request) goes to ``log_path``
    (default: inherited). Returns once it answers an authenticated request through to
    ``upstream``; raises ``RuntimeError`` or ``TimeoutError`` if it does not.
    """
    sock = bind_local_port(port)
    port = sock.getsockname()[1]
    args = [
        sys.executable,
        "-m",
        "devstack.strict_stripe",
        "--upstream",
        upstream,
        "--fd",
        str(sock.fileno()),
        "--key-ttl-s",
        repr(float(key_ttl_s)),
    ]
    if store_path is not None:
        store_path.parent.mkdir(parents=True, exist_ok=True)
        args += ["--store", str(store_path)]
    env = dict(os.environ)
    if webhook_url:
        args += ["--webhook-url", webhook_url]
        env[WEBHOOK_SECRET_ENV] = webhook_secret
    out = open(log_path, "ab") if log_path else None
    try:
        child = ChildProcess(
            "strict-stripe",
            args,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            pass_fds=(sock.fileno(),),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        sock.close()
        if out:
            out.close()
    proxy = StrictStripeProcess(child, port, upstream, store_path, key_ttl_s)
    try:
        wait_for_http(
            f"{proxy.api_base}/v1/customers?limit=1",
            timeout_s=20,
            alive=lambda: child.poll() is None,
            headers={"Authorization": f"Bearer {api_key}"},
        )
    except Exception:
        proxy.stop()
        raise
    return proxy


# --- gunicorn -----------------------------------------------------------------------------------------------------


def start_gunicorn(
    *,
    base_dir: Path,
    bind: str,
    env: dict[str, str],
    access_log: bool = True,
    output: Callable[[str], None] | None = None,
) -> ChildProcess:
    """Start gunicorn with ``hardcount/gunicorn.conf.py`` bound to ``bind`` (``host:port``).

    ``access_log`` False sends gunicorn's access log to ``/dev/null`` (the command line wins over
    the config file). ``output``: called with each line gunicorn writes (stdout and stderr, one
    thread reads them until gunicorn closes its end); None: inherited (lines go to the terminal).
    SIGTERM (``stop``) is gunicorn's graceful shutdown: in-flight requests finish, workers stop
    their scheduler runtime and release their leases.
    """
    args = [
        sys.executable,
        "-m",
        "gunicorn",
        "--config",
        str(base_dir / "hardcount" / "gunicorn.conf.py"),
        "--bind",
        bind,
        # serve supervises gunicorn itself; the control socket would sit in XDG_RUNTIME_DIR
        # (var/run), too long a path for a Unix socket in a deep clone.
        "--no-control-socket",
    ]
    if not access_log:
        args += ["--access-logfile", os.devnull]
    args.append("hardcount.wsgi:application")
    if output is None:
        return ChildProcess("gunicorn", args, env=env, cwd=base_dir)
    child = ChildProcess(
        "gunicorn",
        args,
        env=env,
        cwd=base_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )

    def pump() -> None:
        for line in child.process.stdout:
            output(line.rstrip("\n"))

    child.output_thread = threading.Thread(target=pump, name="gunicorn-output", daemon=True)
    child.output_thread.start()
    return child


class SchedulerLogView:
    """What ``make run`` prints of gunicorn's lines: the scheduler's per-tick lines made short.

    The scheduler logs ``tick_started`` and a ``tick_completed`` line with every count of the
    tick (a billing tick's is ~580 characters, every 10 s in the dev stack). At INFO this view
    drops ``tick_started`` (and each role's and service's start-up line), shortens
    ``tick_completed`` to one line with the counts that are not zero (``scheduler  billing tick
    3.902 s: test_attempted=184 test_billed=182 test_failed=2``), and drops a tick that did
    nothing; every other line passes unchanged. ``detail`` True (serve:
    ``HARDCOUNT_LOG_LEVEL=DEBUG``) passes every line as it came.
    """

    # Said for every role and service of every worker at start, and before every tick: nothing to act on.
    _QUIET_EVENTS = {"tick_started", "ticker_started", "service_started"}
    # Keys of a tick line that are bookkeeping, not what the tick did.
    _NOT_COUNTS = {"event", "role", "token", "duration_s", "recorded"}

    def __init__(self, write: Callable[[str], None], *, detail: bool = False):
        self.write = write
        self.detail = detail

    def __call__(self, line: str) -> None:
        shown = line if self.detail else self.present(line)
        if shown is not None:
            self.write(shown)

    def present(self, line: str) -> str | None:
        """The line as shown at INFO, or None when it is not shown."""
        at = line.find("event=")
        if at < 0:
            return line
        from hardcount.logfmt import parse_logfmt

        fields = parse_logfmt(line[at:])
        event = fields.get("event")
        if event in self._QUIET_EVENTS:
            return None
        if event != "tick_completed":
            return line
        counts = [
            f"{key}={value}"
            for key, value in fields.items()
            if key not in self._NOT_COUNTS and not key.endswith("_run") and value not in ("0", "-", "", "False")
        ]
        if not counts:
            return None
        duration = fields.get("duration_s", "?")
        return f"scheduler  {fields.get('role', '?')} tick {duration} s: " + " ".join(counts)


# --- webhook receiver ---------------------------------------------------------------------------------------------


def signature_verdict(header: str, body: bytes, secrets: Iterable[str]) -> str:
    """``"signature ok"`` when ``header`` signs ``body`` with one of ``secrets``, else why not.

    Verification is :func:`outbox.signing.verify` (docs/reference/webhooks.md, with its 300 s tolerance), the
    helper Hardcount ships to receivers.
    """
    from outbox.signing import SignatureVerificationError, verify

    if not header:
        return "unsigned"
    reason = "no endpoint secret known"
    for secret in secrets:
        try:
            verify(body, header, secret)
        except SignatureVerificationError as exc:
            reason = str(exc)
        else:
            return "signature ok"
    return f"signature REJECTED ({reason})"


class WebhookReceiver:
    """A local endpoint that logs the webhooks POSTed to it and answers 200.

    A delivery is logged as one line: event id, type, mode, and whether the signature verifies
    against one of ``secrets()`` (a callable, so secrets learned after the receiver started
    count). Up to ``burst`` deliveries per ``window_s`` seconds are logged one by one; beyond
    that (a seeded demo book sends thousands in its first minutes) the receiver samples: it
    counts the rest and logs one summary line per window (how many, how many signatures were
    rejected) until a window sees no more than ``burst`` again. :meth:`flush` writes a pending
    summary once its window has passed (``serve`` calls it every second). ``received`` keeps the
    last 1,000 parsed bodies, newest last (tests); ``count`` counts them all.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        secrets: Callable[[], Iterable[str]] = list,
        log=None,
        burst: int = 25,
        window_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.secrets = secrets
        self.received: collections.deque[dict] = collections.deque(maxlen=1000)
        self.count = 0
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_started = clock()
        self._in_window = 0
        self._hidden = 0
        self._hidden_rejected = 0
        self._sampling = False
        self._log = log or (lambda line: logger.info("%s", line))
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                receiver._record(self.headers.get("Hardcount-Signature", ""), body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"received": true}')

            def log_message(self, format, *args):  # the one line from _record is enough
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/webhooks"
        self._thread: threading.Thread | None = None

    def _record(self, signature_header: str, body: bytes) -> None:
        try:
            payload = json.loads(body)
        except ValueError:
            self._log(f"webhook  (not JSON, {len(body)} bytes)")
            return
        if not isinstance(payload, dict):
            payload = {"data": payload}
        verdict = signature_verdict(signature_header, body, self.secrets())
        mode = "live" if payload.get("livemode") else "test"
        with self._lock:
            self.received.append(payload)
            self.count += 1
            summary = self._roll_window()
            self._in_window += 1
            if self._sampling or self._in_window > self.burst:
                self._sampling = True
                self._hidden += 1
                self._hidden_rejected += verdict != "signature ok"
                line = None
            else:
                line = f"webhook  {payload.get('id', '?')} {payload.get('type', '?')} ({mode}) {verdict}"
        for text in (summary, line):
            if text:
                self._log(text)

    def _roll_window(self) -> str | None:
        """Under the lock: start a new window once ``window_s`` has passed; the summary of the old one, if any."""
        now = self._clock()
        if now - self._window_started < self.window_s:
            return None
        summary = None
        if self._hidden:
            rejected = f"{self._hidden_rejected} signatures NOT verified" if self._hidden_rejected else "signatures ok"
            summary = (
                f"webhook  … {self._hidden} more deliveries in {now - self._window_started:.0f} s, sampled: "
                f"not logged one by one ({rejected}; {self.count} received in all)"
            )
        # Sampling goes on while the rate stays above the burst.
        self._sampling = self._in_window > self.burst
        self._window_started, self._in_window, self._hidden, self._hidden_rejected = now, 0, 0, 0
        return summary

    def flush(self) -> None:
        """Write the summary of a window that has passed with deliveries not logged one by one."""
        with self._lock:
            summary = self._roll_window() if self._hidden else None
        if summary:
            self._log(summary)

    def start(self) -> WebhookReceiver:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(5)
        self.server.server_close()


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m devstack.stack")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("localstripe", help="serve localstripe on an inherited socket")
    ls.add_argument("--fd", type=int, required=True)
    ls.add_argument("--store", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "localstripe":
        _run_localstripe(args.fd, args.store)


if __name__ == "__main__":
    _main(sys.argv[1:])
