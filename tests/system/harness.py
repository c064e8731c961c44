"""Real ``manage.py runscheduler`` processes against the test database, with their logfmt lines parsed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import bind_local_port
from hardcount.logfmt import parse_logfmt

BASE_DIR = Path(settings.BASE_DIR)


def database_url() -> str:
    """The test database as a DATABASE_URL a child process's settings parse (socket dir in ``host``)."""
    s = connection.settings_dict
    return f"postgresql://{s['USER']}@:{s['PORT']}/{s['NAME']}?host={s['HOST']}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SchedulerProcess:
    """One replica: ``python manage.py runscheduler`` with ``env`` on top of the test's environment.

    The services (the webhook executor) are off unless ``env`` sets ``HARDCOUNT_SERVICES``; a
    ``None`` value removes a variable, so the settings' default applies.

    With ``web``, the replica is the single deployable instead: ``gunicorn -c hardcount/gunicorn.conf.py``
    with ``HARDCOUNT_RUN_SCHEDULER=1`` on a free port (:attr:`port`), one worker (whose runtime is the
    replica) with two request threads unless ``env`` says otherwise, in a session of its own so
    :meth:`kill` takes the arbiter and its worker down together, as a crashed host would.
    """

    def __init__(
        self,
        name: str,
        env: dict[str, str | None],
        args: tuple[str, ...] = (),
        metrics: bool = False,
        *,
        web: bool = False,
    ) -> None:
        self.name = name
        self.metrics_port = free_port() if metrics else None
        self.port = free_port() if web else None
        web_env = {
            "HARDCOUNT_BIND": f"127.0.0.1:{self.port}",
            "HARDCOUNT_RUN_SCHEDULER": "1",
            "HARDCOUNT_WEB_WORKERS": "1",
            "HARDCOUNT_WEB_THREADS": "2",
            "HARDCOUNT_GRACEFUL_TIMEOUT_S": "5",
        }
        full_env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            "HARDCOUNT_LOG_LEVEL": "INFO",
            "HARDCOUNT_SERVICES": "",
            **(web_env if web else {}),
            **env,
        }
        full_env = {key: value for key, value in full_env.items() if value is not None}  # None: unset it
        if web:
            command = [sys.executable, "-m", "gunicorn", "-c", "hardcount/gunicorn.conf.py", "hardcount.wsgi", *args]
        else:
            command = [sys.executable, "manage.py", "runscheduler", *args]
        if self.metrics_port:
            command += ["--metrics-port", str(self.metrics_port)]
        self.web = web
        self.process = subprocess.Popen(
            command,
            cwd=BASE_DIR,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=web,
        )
        self.lines: list[str] = []
        self.events: list[dict[str, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.holder = self.wait_for("runtime_started", timeout_s=30)["holder"]

    def _read(self) -> None:
        for raw_line in self.process.stdout:
            line = raw_line.rstrip("\n")
            with self._changed:
                self.lines.append(line)
                if "event=" in line:
                    fields = parse_logfmt(line[line.index("event=") :])
                    fields["_t"] = time.monotonic()
                    self.events.append(fields)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def find(self, event: str, **fields: str) -> list[dict[str, str]]:
        """Every logged ``event`` whose fields include ``fields`` (values compared as strings)."""
        with self._changed:
            return [
                e for e in self.events if e["event"] == event and all(e.get(k) == str(v) for k, v in fields.items())
            ]

    def wait_for(self, event: str, timeout_s: float = 30, **fields: str) -> dict[str, str]:
        """The first matching event, waiting for it up to ``timeout_s``; fails with the log otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = self.find(event, **fields)
                if found:
                    return found[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: no {event} {fields} within {timeout_s}s. Log:\n{self.log()}")
                self._changed.wait(min(remaining, 0.5))

    def log(self) -> str:
        with self._changed:
            return "\n".join(self.lines[-80:])

    def send(self, sig: int) -> None:
        self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the replica now: a web replica's arbiter and worker together (its session), else the process."""
        if self.web:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        elif self.process.poll() is None:
            self.process.kill()

    def leadership(self) -> dict[str, float]:
        """Role → 1 when this replica's metrics port names it the holder now (``hardcount_leader_holder``), else 0."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        view = {sample.labels["role"]: 0.0 for sample in families["hardcount_leader_is_leader"].samples}
        holders = families.get("hardcount_leader_holder")
        for sample in holders.samples if holders else []:
            if sample.value == 1 and sample.labels["holder"] == self.holder:
                view[sample.labels["role"]] = 1.0
        return view

    def stop(self, timeout_s: float = 15) -> int:
        """SIGTERM (SIGCONT first, in case it is stopped) and wait; SIGKILL if it does not exit."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                self.process.wait(5)
        if self.web:
            self.kill()  # a worker that outlived its arbiter goes too
        self._reader.join(5)
        return self.process.returncode


class ServeProcess:
    """``manage.py serve`` as ``make run`` runs it, against the test database, its output collected line by line.

    ``var_dir`` is its own ``HARDCOUNT_VAR_DIR`` and the port a free one, so it touches neither the
    developer's database nor port 8000. It starts its own localstripe and strict dev Stripe (the
    test's ``STRIPE_API_BASE``/``STRIPE_API_KEY`` are dropped), one web worker and no demo book unless
    ``demo_subscriptions`` or ``env`` (applied last) say otherwise. With ``make``, it is ``make run`` itself
    (migrations and ``collectstatic`` first), in a session of its own as a terminal's foreground job would be:
    :attr:`process` is then ``make``.
    """

    READY_LINE = "Hardcount is running."

    def __init__(
        self, var_dir: Path, *, demo_subscriptions: int = 0, env: dict[str, str] | None = None, make: bool = False
    ):
        with bind_local_port() as sock:
            self.port = sock.getsockname()[1]
        full_env = {k: v for k, v in os.environ.items() if k not in ("STRIPE_API_BASE", "STRIPE_API_KEY")}
        full_env.update(
            DATABASE_URL=database_url(),
            HARDCOUNT_VAR_DIR=str(var_dir),
            HARDCOUNT_PORT=str(self.port),
            HARDCOUNT_WEB_WORKERS="1",
            HARDCOUNT_DEMO_SUBSCRIPTIONS=str(demo_subscriptions),
            HARDCOUNT_DEVSTACK="1",
        )
        full_env.update(env or {})
        if make:  # not an outer make's jobserver and flags (make test runs pytest)
            full_env = {k: v for k, v in full_env.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        self.env = full_env
        self.process = subprocess.Popen(
            ["make", "--no-print-directory", "run"] if make else [sys.executable, "manage.py", "serve"],
            cwd=BASE_DIR,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=make,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.READY_LINE in line:
                self.ready.set()

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines printed, access-log lines left out."""
        return "\n".join(line for line in self.lines[-n:] if '"GET /' not in line)

    def wait_ready(self, timeout_s: float = 90) -> None:
        """Wait for the banner; kill serve and fail the test with its output if it never comes."""
        if not self.ready.wait(timeout_s):
            self.process.kill()
            pytest.fail("serve never became ready:\n" + self.tail())

    def wait_for_line(self, text: str, timeout_s: float) -> bool:
        """True once a line containing ``text`` has been printed (polls the collected output)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.1)
        return False

    def banner_value(self, label: str) -> str:
        """The last word of the banner line that starts with ``label`` (a key, a URL)."""
        return next(line for line in self.lines if line.strip().startswith(label)).split()[-1]

    def descendants(self) -> list[psutil.Process]:
        """Every process serve started, and theirs: found by walking the tree while serve runs."""
        found = []
        for child in psutil.Process(self.process.pid).children():
            found.append(child)
            found.extend(child.children(recursive=True))
        return found

    def workers(self) -> dict[int, psutil.Process]:
        """This serve's gunicorn workers by pid (the arbiter's children)."""
        arbiters = [p for p in psutil.Process(self.process.pid).children() if "gunicorn" in " ".join(p.cmdline())]
        return {w.pid: w for a in arbiters for w in a.children()}

    def api(self, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:
        """(status, JSON body) of an API request with ``key`` as the bearer."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def get(self, path: str) -> int:
        """The status of an unauthenticated GET."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            return response.status

    def stop(self) -> None:
        """SIGTERM and wait (serve stops what it started); SIGKILL if it does not exit within a minute."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def scratch_rows(role: str = "scratch") -> list[tuple]:
    """(holder, token, page, written_at) of every scratch row of ``role``, in write order."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT holder, token, page, written_at FROM system_scratch WHERE role = %s ORDER BY id", [role])
        return cursor.fetchall()


def lease(role: str) -> dict | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT holder, token, expires_at > now() AS live, expires_at, acquired_at, last_stamp_at,"
            " EXTRACT(EPOCH FROM now() - last_stamp_at)::float8 AS stamp_age_s, clock_timestamp()"
            " FROM leases_leaderlease WHERE role = %s",
            [role],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    keys = ("holder", "token", "live", "expires_at", "acquired_at", "last_stamp_at", "stamp_age_s", "db_now")
    return dict(zip(keys, row, strict=True))


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
