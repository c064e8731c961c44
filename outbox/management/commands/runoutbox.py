"""``python manage.py runoutbox``: run the webhook delivery executor on its own, until SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading

from django.core.management.base import BaseCommand

from outbox.executor import Executor, ExecutorConfig


class Command(BaseCommand):
    help = "Run the leaderless webhook delivery executor (HARDCOUNT_OUTBOX_WORKERS workers) until SIGTERM/SIGINT."

    def add_arguments(self, parser):
        parser.add_argument("--workers", type=int, default=None, help="Workers (default HARDCOUNT_OUTBOX_WORKERS).")

    def handle(self, *args, **options):
        overrides = {"workers": options["workers"]} if options["workers"] else {}
        executor = Executor(ExecutorConfig.from_settings(**overrides))
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        executor.start()
        self.stdout.write(f"outbox executor {executor.executor_id} running with {executor.config.workers} workers")
        self.stdout.flush()
        while not stop.wait(1.0):
            if not executor.running:
                self.stderr.write("outbox executor thread ended unexpectedly")
                raise SystemExit(1)
        executor.stop()
        self.stdout.write(f"outbox executor stopped: {dict(executor.stats.counts)}")
