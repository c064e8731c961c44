"""PgBouncer in transaction pooling mode between test replicas and the test database (tests/system/test_pgbouncer.py).

:class:`PgBouncer` runs Debian's ``pgbouncer`` from an ini of its own in a temporary directory:
``pool_mode = transaction``, ``default_pool_size`` = ``max_db_connections`` = the pool, trust
authentication of the test database's user (the embedded PostgreSQL trusts its Unix socket), the
server reached through that socket. :class:`PooledReplicas` are the failure-correctness replicas
(:class:`tests.system.correctness.Replicas`) with ``DATABASE_URL`` pointing at it.
:class:`SessionSampler` watches both sides of it while a test runs, and :func:`assert_within_pool`
checks what it saw (the ``bouncer``, ``pooled`` and ``sampler`` fixtures are in tests/system/conftest.py).

:func:`server_sessions` counts what PostgreSQL itself sees: the client backends of the test
database other than this test process's own, which connect directly under the application name
:data:`DIRECT`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from django.db import connection, connections

from tests.system.correctness import Replicas, wait_until
from tests.system.harness import free_port

# This test process's own sessions: direct, not through the pooler, and left out of the count.
DIRECT = "hc-test-direct"
# Server connections the tests' pooler opens at most.
POOL = 6


def pgbouncer_binary() -> str:
    """The pgbouncer executable; skips the test when it is not installed (``make pgbouncer`` installs it)."""
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None)
    if found is None:
        pytest.skip("Debian's pgbouncer is not installed (make test installs it: apt-get install -y pgbouncer)")
    return found


def mark_direct_sessions() -> Callable[[], None]:
    """Make every later connection of this process carry :data:`DIRECT` (the threads' too: one settings
    dict); returns the function that takes the mark off again."""
    connections.close_all()
    options = connection.settings_dict.setdefault("OPTIONS", {})
    options["application_name"] = DIRECT

    def restore() -> None:
        options.pop("application_name", None)
        connections.close_all()

    return restore


def server_sessions() -> int:
    """PostgreSQL's client backends of the test database, this process's direct ones left out."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND application_name <> %s",
            [DIRECT],
        )
        return cursor.fetchone()[0]


class PgBouncer:
    """A running ``pgbouncer`` in transaction mode with ``pool`` server connections at most."""

    def __init__(self, *, pool: int = POOL):
        # Its own directory right under the temporary root: pytest's tmp_path sits below a root-only
        # directory, which the unprivileged user pgbouncer runs as (when we are root) could not enter.
        directory = Path(tempfile.mkdtemp(prefix="hc-pgbouncer-"))
        self.directory = directory
        self.pool = pool
        self.port = free_port()
        s = connection.settings_dict
        self.user, self.database = s["USER"], s["NAME"]
        (directory / "users.txt").write_text(f'"{self.user}" ""\n')
        (directory / "pgbouncer.ini").write_text(
            f"""[databases]
{self.database} = host={s["HOST"]} port={s["PORT"] or 5432} dbname={self.database}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "users.txt"}
admin_users = {self.user}
pool_mode = transaction
default_pool_size = {pool}
max_db_connections = {pool}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 1000
; a transaction idle this long (its process stopped) is ended: the scheduler's own -c option cannot pass
idle_transaction_timeout = 30
query_wait_timeout = 60
server_idle_timeout = 60
logfile = {directory / "pgbouncer.log"}
pidfile = {directory / "pgbouncer.pid"}
"""
        )
        self.log = directory / "pgbouncer.log"
        command = [pgbouncer_binary(), str(directory / "pgbouncer.ini")]
        if os.geteuid() == 0:
            # pgbouncer refuses to run as root: it runs as the embedded server's system user.
            owner = pwd.getpwuid(Path(s["HOST"]).stat().st_uid).pw_name
            shutil.chown(directory, user=owner)
            for path in directory.iterdir():
                shutil.chown(path, user=owner)
            directory.chmod(0o755)
            command[1:1] = ["-u", owner]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._output: list[str] = []
        threading.Thread(target=lambda: self._output.extend(self.process.stdout), daemon=True).start()
        wait_until(self._listening, timeout_s=20, what="pgbouncer to listen", step_s=0.05)

    def _listening(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"pgbouncer exited: {''.join(self._output)}{self.tail()}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    @property
    def url(self) -> str:
        """``DATABASE_URL`` through the pooler (a query string, so an ``&application_name=`` can follow)."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}?sslmode=disable"

    def admin(self, command: str) -> list[dict]:
        """One admin-console command (``SHOW POOLS``); its rows as dicts (the console speaks the simple protocol)."""
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            dbname="pgbouncer",
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,
        ) as admin:
            cursor = admin.execute(command)
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def clients(self) -> int:
        """Client connections to the test database now (what the replicas hold open)."""
        return sum(1 for row in self.admin("SHOW CLIENTS") if row["database"] == self.database)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        shutil.rmtree(self.directory, ignore_errors=True)


class PooledReplicas(Replicas):
    """:class:`Replicas` whose processes reach the database through ``bouncer`` (transaction pooling on)."""

    def __init__(self, env: dict[str, str], bouncer: PgBouncer, *, web: bool = False):
        super().__init__({**env, "HARDCOUNT_DB_TRANSACTION_POOLING": "1"}, web=web)
        self._url = bouncer.url
        self.bouncer = bouncer

    def kill(self, process, *, timeout_s: float = 15) -> None:
        """SIGKILL ``process`` and reap it. PostgreSQL's sessions are the pooler's and outlive it; the pooler
        ends the server side of a transaction the process left open when it sees the client gone."""
        process.kill()
        process.process.wait(timeout_s)
        time.sleep(0.2)  # the pooler reads the closed sockets


class SessionSampler:
    """On a thread: PostgreSQL's sessions of the test database every 10 ms, the pooler's client
    connections every 200 ms; the peak of each."""

    def __init__(self, bouncer: PgBouncer):
        self.bouncer = bouncer
        self.peak = self.peak_clients = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, server_sessions())
                if self.samples % 20 == 0:
                    self.peak_clients = max(self.peak_clients, self.bouncer.clients())
                self.samples += 1
        finally:
            connections.close_all()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def assert_within_pool(sampler: SessionSampler, *, more_clients: bool = False) -> None:
    """PostgreSQL never saw more than the pool; with ``more_clients``, the replicas also held more client
    connections than that (so the pool was needed, not merely big enough). Stops the sampler."""
    sampler.stop()
    pool = sampler.bouncer.pool
    assert sampler.samples > 10, "the sampler did not run"
    peak, clients = sampler.peak, sampler.peak_clients
    assert 1 <= peak <= pool, f"PostgreSQL saw {peak} sessions through a pool of {pool}:\n{sampler.bouncer.tail()}"
    if more_clients:
        assert clients > pool, f"at most {clients} client connections: nothing to pool"
    print(f"through PgBouncer: up to {clients} client connections, at most {peak} server sessions (pool {pool})")
