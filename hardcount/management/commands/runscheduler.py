"""``python manage.py runscheduler``: the scheduler runtime in the foreground (docs/reference/roles-and-leases.md).

Runs one ticker thread per role (each under its leader lease) and the leaderless services
until SIGTERM or SIGINT, then stops every role at its next safe point, releases the leases
(so another replica takes over at once) and exits. Log lines are logfmt
(``event=tick_completed role=billing token=3 duration_s=0.412 live_billed=12 …``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from hardcount.logfmt import logfmt
from hardcount.scheduler import Runtime, configured_roles

logger = logging.getLogger("hardcount.scheduler")


def bound_idle_transactions() -> None:
    """Make every connection this process opens end a transaction left idle too long.

    ``idle_in_transaction_session_timeout`` (``HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S``, 5 s) on
    the session: if this process is SIGSTOPped inside a transaction, PostgreSQL ends it, so
    its locks cannot hold back a successor's takeover. (Fenced transactions also set it
    locally, whichever process runs them.) Behind a transaction-pooling PgBouncer
    (``HARDCOUNT_DB_TRANSACTION_POOLING``) nothing is set: the pooler refuses the startup option,
    and its own ``idle_transaction_timeout`` ends such a transaction instead.
    """
    if settings.HARDCOUNT_DB_TRANSACTION_POOLING:
        return
    timeout_ms = max(1, round(settings.HARDCOUNT_LEASE_IDLE_TX_TIMEOUT_S * 1000))
    for alias in connections:
        options = connections.settings[alias].setdefault("OPTIONS", {})
        flag = f"-c idle_in_transaction_session_timeout={timeout_ms}"
        if flag not in options.get("options", ""):
            options["options"] = f"{options.get('options', '')} {flag}".strip()
    connections.close_all()


class Command(BaseCommand):
    help = "Run the scheduler runtime (every role under its leader lease, and the services) until SIGTERM/SIGINT."

    def add_arguments(self, parser):
        parser.add_argument(
            "--role",
            action="append",
            dest="roles",
            metavar="NAME",
            help="Run only this role, or every role of this family (billing: every billing shard; repeatable). "
            "Default: every configured role.",
        )
        parser.add_argument(
            "--no-services", action="store_true", help="Do not start the leaderless services (webhook delivery)."
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=int(os.environ.get("HARDCOUNT_SCHEDULER_METRICS_PORT", "0")),
            help="Serve this process's Prometheus metrics on this port (0: off; env HARDCOUNT_SCHEDULER_METRICS_PORT).",
        )
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=10.0,
            help="Seconds to wait for roles to reach a safe point on shutdown (default 10).",
        )

    def handle(self, *args, **options):
        bound_idle_transactions()
        try:
            roles = configured_roles(options["roles"])
        except Exception as exc:
            raise CommandError(str(exc)) from exc
        runtime = Runtime(roles, services=[] if options["no_services"] else None)

        stop = threading.Event()

        def request_stop(signum, _frame):
            logger.info(logfmt("shutdown_requested", signal=signal.Signals(signum).name, holder=runtime.holder))
            stop.set()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

        if options["metrics_port"]:
            from hardcount.metrics import serve_metrics

            serve_metrics(options["metrics_port"])
            logger.info(logfmt("metrics_serving", port=options["metrics_port"]))

        runtime.start()
        while not stop.wait(0.5):
            pass
        clean = runtime.stop(options["stop_timeout"])
        connections.close_all()
        if not clean:
            # Leases of roles that did not stop in time expire by their TTL.
            raise CommandError("some roles did not reach a safe point in time; exiting anyway")
