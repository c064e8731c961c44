"""A credit note with a refund in its own process, SIGKILLed mid-refund (tests/system/test_refund_processes.py).

``python -m tests.system.refund_once --tenant T --invoice I --amount N --kill-at POINT`` sets Django up
(``DATABASE_URL`` names the test database), acts for the tenant (test mode, as an API request does), prints
``ready``, waits for one line on stdin and issues a credit note of ``N`` refunded to the card through
:func:`billing.services.credit_notes.create_credit_note`, logging ``fault_point_reached point=…`` and
SIGKILLing itself (no ``finally``, no rollback by Python) at:

- ``after_refund_row``: the credit note and its refund row (outcome ``unknown``) have committed; the gateway has
  not been called;
- ``after_refund_sent``: the gateway answered the refund (it exists there); nothing of the answer is recorded.

With ``--api-key K --idempotency-key I`` the same body goes through ``POST /v1/credit_notes`` instead (Django's
test client, the tenant's key, that ``Idempotency-Key``), as a web worker serves it: the request's claim on the
key is left in flight by the kill.

The points wrap the module globals the service calls (``credit_notes.send_refund``, ``credit_notes.record_refund``),
so the service carries no seam for them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

KILL_POINTS = ("after_refund_row", "after_refund_sent")


def _die(point: str) -> None:
    print(f"event=fault_point_reached point={point} pid={os.getpid()}", flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    from billing.services import credit_notes

    if point == "after_refund_row":
        credit_notes.send_refund = lambda *args, **kwargs: _die(point)
    else:
        credit_notes.record_refund = lambda *args, **kwargs: _die(point)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--invoice", required=True)
    parser.add_argument("--amount", type=int, required=True)
    parser.add_argument("--kill-at", choices=KILL_POINTS, required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--idempotency-key")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
    import django

    django.setup()
    from django.db import connection

    from billing.services.credit_notes import create_credit_note
    from hardcount import tenancy

    connection.ensure_connection()
    _arm(args.kill_at)
    print("ready", flush=True)
    sys.stdin.readline()
    if args.api_key:
        from django.test import Client

        Client().post(
            "/v1/credit_notes",
            data=json.dumps({"invoice": args.invoice, "amount": args.amount, "refund_amount": args.amount}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {args.api_key}",
            HTTP_IDEMPOTENCY_KEY=args.idempotency_key,
        )
        print("not killed", flush=True)
        return
    tenancy.enter(args.tenant, False)
    create_credit_note(
        args.invoice, tenant_id=args.tenant, livemode=False, amount=args.amount, refund_amount=args.amount
    )
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
