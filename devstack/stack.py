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
  (docs/decisions/0124-strict-dev-stripe.md).
- :func:`start_gunicorn` runs the web process with ``hardcount/gunicorn.conf.py``.
- :class:`WebhookReceiver` is a local HTTP endpoint that logs each webhook it receives and
  whether its ``Hardcount-Signature`` verifies (docs/reference/webhooks.md, with :mod:`outbox.signing`).
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
) -> StrictStripeProcess:
    """Start ``python -m devstack.strict_stripe`` on ``127.0.0.1:port`` (0: a free port) in front of ``upstream``.

    Idempotency keys are remembered ``key_ttl_s`` seconds and kept in ``store_path`` (None: in
    memory), so they survive a restart. Output (one line per request) goes to ``log_path``
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
    out = open(log_path, "ab") if log_path else None
    try:
        child = ChildProcess(
            "strict-stripe",
            args,
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


def start_gunicorn(*, base_dir: Path, bind: str, env: dict[str, str]) -> ChildProcess:
    """Start gunicorn with ``hardcount/gunicorn.conf.py`` bound to ``bind`` (``host:port``).

    Output is inherited (access and error logs on the terminal). SIGTERM (``stop``) is
    gunicorn's graceful shutdown: in-flight requests finish, workers stop their scheduler
    runtime and release their leases.
    """
    return ChildProcess(
        "gunicorn",
        [
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
            "hardcount.wsgi:application",
        ],
        env=env,
        cwd=base_dir,
    )


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
    """A local endpoint that logs every webhook POSTed to it and answers 200.

    Each delivery is logged as one line: event id, type, mode, and whether the signature
    verifies against one of ``secrets()`` (a callable, so secrets learned after the
    receiver started count). ``received`` keeps the last 1,000 parsed bodies, newest last
    (tests); ``count`` counts them all. With ``log_first`` set, only that many deliveries are
    logged one by one (a seeded demo book sends thousands).
    """

    def __init__(self, *, port: int = 0, secrets: Callable[[], Iterable[str]] = list, log=None):
        self.secrets = secrets
        self.received: collections.deque[dict] = collections.deque(maxlen=1000)
        self.count = 0
        self.log_first: int | None = None
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
        self.received.append(payload)
        self.count += 1
        if self.log_first is not None and self.count > self.log_first:
            if self.count == self.log_first + 1:
                self._log("webhook  … further deliveries are not logged one by one (see the progress line)")
            return
        verdict = signature_verdict(signature_header, body, self.secrets())
        mode = "live" if payload.get("livemode") else "test"
        self._log(f"webhook  {payload.get('id', '?')} {payload.get('type', '?')} ({mode}) {verdict}")

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
