"""One batch of meter events recorded in its own process, started on a signal: the racing ingests of the usage suite.

``python -m tests.system.ingest_once --tenant TENANT --batch FILE`` sets Django up (``DATABASE_URL`` names the
test database), prints ``ready``, waits for one line on stdin (the start signal, so both racers have booted
before either inserts), calls ``billing.services.usage.record_meter_events`` with the events of ``FILE`` (a JSON
list) in test mode and prints one JSON line: the count of each status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--batch", required=True)
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
    import django

    django.setup()
    from django.db import connection

    from billing.services.usage import record_meter_events

    with open(args.batch) as f:
        events = json.load(f)
    connection.ensure_connection()
    print("ready", flush=True)
    sys.stdin.readline()
    results = record_meter_events(tenant_id=args.tenant, livemode=False, events=events)
    print(json.dumps(Counter(r.status for r in results)), flush=True)


if __name__ == "__main__":
    main()
