"""One manual billing drain in its own process, started on a signal: the racing drains of the failure suite.

``python -m tests.system.drain_once --tenant TENANT [--page-size 1] [--concurrency 1]`` sets Django up
(``DATABASE_URL`` names the test database), prints ``ready``, waits for one line on stdin (the start
signal, so every racer has finished booting before any claims a page), runs
``billing.services.drain.drain_due(livemode=False, trigger="manual", tenant_id=TENANT, …)`` and prints
one JSON line: ``{"run": id, "attempted", "billed", "failed", "pages", "skipped", "status"}``
(``skipped``: this run's attempts that found the period being closed by another drain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
    import django

    django.setup()
    from django.db import connection

    from billing.models import BillingAttempt
    from billing.services.drain import drain_due

    connection.ensure_connection()
    print("ready", flush=True)
    sys.stdin.readline()
    run = drain_due(
        livemode=False,
        trigger="manual",
        tenant_id=args.tenant,
        page_size=args.page_size,
        concurrency=args.concurrency,
    )
    skipped = BillingAttempt.objects.filter(run=run, outcome=BillingAttempt.SKIPPED).count()
    result = {
        "run": run.id,
        "attempted": run.attempted,
        "billed": run.billed,
        "failed": run.failed,
        "pages": run.pages,
        "skipped": skipped,
        "status": run.status,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
