"""Correctness under failure, experiment 6 (docs/reference/guarantees.md): PostgreSQL restarted mid-drain.

The shared embedded server (var/pgdata) serves every other suite, so this test starts its own
PostgreSQL (pgserver, in a temporary directory deleted afterwards), migrates a database on it,
points two real ``runscheduler`` replicas (leader and standby) and the test's own ``default``
connection at it, seeds a book of due subscriptions and — the moment the database shows the
k-th invoice committed — restarts the server with ``pg_ctl restart -m fast`` (every session is
terminated, in-flight transactions roll back). The runtime must reconnect on every thread (ticker,
lease heartbeat, the drain's close threads) and finish the drain, with nothing lost and nothing
billed twice; the payment attempts whose record step the restart cut off stay ``unknown`` until
the in-flight window passes, and the next tick re-sends them under their keys.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, connections

from billing.models import PaymentAttempt, Subscription
from tests.billing.conftest import Book
from tests.system.correctness import (
    ReportRow,
    assert_clean,
    assert_gateway_agrees,
    audit_book,
    billing_env,
    doctor_violations,
    invoices_of,
    record_row,
    seed_book,
    wait_until,
)
from tests.system.harness import BASE_DIR, database_url

pytestmark = [
    pytest.mark.system,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

BOOK_SIZE = 60
RESTART_AT = 20  # invoices committed when the restart is issued
DATABASE = "hardcount_restart"


class OwnServer:
    """A PostgreSQL of this test's own (pgserver in a short temporary directory), restartable."""

    def __init__(self) -> None:
        import pgserver
        from pgserver import postgres_server

        from hardcount.embedded_db import _socket_dir

        postgres_server.find_suitable_socket_dir = lambda pgdata, runtime_path: _socket_dir(pgdata)
        self.root = Path(tempfile.mkdtemp(prefix="hc-pgrestart-"))
        self.root.chmod(0o755)  # the server runs as the ``pgserver`` user when we are root
        self.pgdata = self.root / "pgdata"
        self.server = pgserver.get_server(self.pgdata, cleanup_mode="delete")
        self.server.psql(f"CREATE DATABASE {DATABASE};")
        self.socket_dir = str(self.server.get_postmaster_info().socket_dir)

    def postmaster_pid(self) -> int:
        return int((self.pgdata / "postmaster.pid").read_text().split()[0])

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every session is terminated and the server comes back on the same socket."""
        from pgserver._commands import pg_ctl

        pg_ctl(
            ["-w", "-m", "fast", "-l", str(self.server.log), "restart"],
            pgdata=self.pgdata,
            user=self.server.system_user,
            timeout=60,
        )

    def remove(self) -> None:
        from pgserver._commands import pg_ctl

        try:  # pgserver's own cleanup knows only the first postmaster's pid
            pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.pgdata, user=self.server.system_user, timeout=30)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        self.server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def default_connection_on(server: OwnServer):
    """Point the ``default`` alias at ``server``'s database for the block (restored after, for teardown)."""
    connections.close_all()
    settings_dict = connection.settings_dict
    saved = {key: settings_dict[key] for key in ("HOST", "NAME")}
    settings_dict.update(HOST=server.socket_dir, NAME=DATABASE)
    try:
        yield
    finally:
        connections.close_all()
        settings_dict.update(saved)


def retrying(read):
    """``read()``, or None when the database is unreachable (the restart); the next poll reconnects."""

    def poll():
        try:
            return read()
        except DatabaseError:
            connection.close()
            return None

    return poll


def test_postgresql_restarted_mid_drain_the_runtime_reconnects_and_bills_every_period_exactly_once(
    transactional_db, stripe_proxy, gateway, make_card, replicas
):
    started = time.monotonic()
    server = OwnServer()
    try:
        with default_connection_on(server):
            migrate = subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                cwd=BASE_DIR,
                env={**os.environ, "DATABASE_URL": database_url()},
                capture_output=True,
                check=False,
                text=True,
                timeout=180,
            )
            assert migrate.returncode == 0, migrate.stderr[-3000:]
            run_experiment(server, stripe_proxy, gateway, make_card, replicas, started)
    finally:
        server.remove()


def run_experiment(server, stripe_proxy, failing_methods, make_card, replicas, started):
    """Seed, restart at the chosen point, wait for the runtime to finish, audit; records the report row."""
    book = Book(make_card)
    # A 1 s gateway timeout: a payment attempt the restart left ``unknown`` is in flight for 5 s.
    pool = replicas(billing_env(stripe_proxy, HARDCOUNT_GATEWAY_TIMEOUT_S="1"))
    leader = pool.start().result(timeout=60)
    leader.wait_for("lease_acquired", role="billing", timeout_s=30)
    standby = pool.start().result(timeout=60)
    first_pid = server.postmaster_pid()

    seeded = seed_book(book, failing_methods, BOOK_SIZE, name="Restart")
    tenant_id = seeded.tenant.id
    wait_until(lambda: invoices_of(tenant_id) >= RESTART_AT, timeout_s=60, what=f"{RESTART_AT} invoices")
    at_restart = invoices_of(tenant_id)
    connection.close()
    restart_began = time.monotonic()
    server.restart()
    restart_s = time.monotonic() - restart_began
    assert server.postmaster_pid() != first_pid, "the server was not restarted"
    assert at_restart < BOOK_SIZE, f"the drain had finished ({at_restart} invoices) before the restart"

    def settled():
        due = Subscription.objects.filter(tenant_id=tenant_id, next_billing_at__lte=_db_now()).exclude(
            next_billing_attempt_at__gt=_db_now()
        )
        unknown = PaymentAttempt.objects.filter(tenant_id=tenant_id, outcome=PaymentAttempt.UNKNOWN)
        return not due.exists() and not unknown.exists()

    wait_until(retrying(settled), timeout_s=45, what="the drain to finish after the restart", step_s=0.1)

    # Both replicas lived through it; at least one logged the outage and a completed tick after it.
    for replica in (leader, standby):
        assert replica.process.poll() is None, f"{replica.name} died:\n{replica.log()}"
    outage = [
        e
        for r in (leader, standby)
        for e in r.events
        if e["event"] in ("tick_failed", "leader_db_error", "heartbeat_failed", "acquire_failed")
    ]
    assert outage, f"no replica noticed the restart:\n{leader.log()}\n{standby.log()}"
    after = [
        e
        for r in (leader, standby)
        for e in r.events
        if e["event"] == "tick_completed" and e["_t"] > restart_began + restart_s
    ]
    assert after, f"no billing tick completed after the restart:\n{leader.log()}\n{standby.log()}"

    audit = audit_book(seeded, stripe_proxy)
    assert_clean(audit, f"restart at {at_restart} invoices", stripe_proxy)
    compared = assert_gateway_agrees()
    assert doctor_violations() == {}
    logged = Counter(e["event"] for e in outage)
    replayed = sum(1 for e in stripe_proxy.entries("POST /v1/payment_intents") if e.action == "replayed")
    holders = {e.get("token") for e in after}
    record_row(
        ReportRow(
            "PostgreSQL restarted mid-drain (pg_ctl restart -m fast), the runtime reconnects",
            runs=2,
            kill_points=f"1 restart at {at_restart} of {BOOK_SIZE} invoices",
            invoices=audit.invoices,
            duplicates=audit.duplicates,
            lost=audit.lost_periods,
            doctor_violations=0,
            wall_s=time.monotonic() - started,
            note=f"restart took {restart_s:.1f} s; replicas logged "
            f"{', '.join(f'{n} {event}' for event, n in sorted(logged.items()))}; {replayed} PaymentIntent(s) "
            f"re-sent under their keys (replayed); ticks completed after it under lease token(s) "
            f"{', '.join(sorted(t for t in holders if t))}; gateway: {compared}",
        )
    )


def _db_now():
    from hardcount.times import database_now

    return database_now()
