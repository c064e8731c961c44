"""A credit note with a refund to the card, issued in its own process, which may be SIGKILLed mid-refund.

``python -m tests.system.refund_once --tenant T --invoice I --amount 300 [--kill-at POINT]`` sets Django up
(``DATABASE_URL`` names the test database, ``STRIPE_API_BASE`` the strict dev Stripe), acts for the tenant
(test mode, as an API request does), prints ``ready``, waits for one line on stdin (the start signal), issues
``{"amount": N, "refund_amount": N}`` on the invoice through
:func:`billing.services.credit_notes.create_credit_note`, then prints one JSON line
``{"credit_note": …, "refund_outcome": …}``. With ``--api-key K --idempotency-key I`` it sends the same body as
``POST /v1/credit_notes`` (Django's test client, the tenant's key, that ``Idempotency-Key``) instead, as a web
worker would serve it.

``--kill-at`` SIGKILLs the process (no ``finally``, no rollback by Python), logging
``fault_point_reached point=…`` first:

- ``after_commit``: the credit note and its refund (outcome ``unknown``, its key ``hc:{credit_note}:refund``)
  have committed; the refund has not been sent;
- ``after_refund``: the gateway answered the refund (it ran), nothing of the answer is recorded.

The points wrap the module globals the service calls (``credit_notes.send_refund``,
``credit_notes.record_refund``), so the service carries no seam for them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

KILL_POINTS = ("after_commit", "after_refund")


def _die(point: str) -> None:
    print(f"event=fault_point_reached point={point} pid={os.getpid()}", flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    from billing.services import credit_notes

    if point == "after_commit":
        credit_notes.send_refund = lambda *args, **kwargs: _die(point)
    else:
        credit_notes.record_refund = lambda *args, **kwargs: _die(point)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--invoice", required=True)
    parser.add_argument("--amount", type=int, required=True)
    parser.add_argument("--kill-at", choices=KILL_POINTS)
    parser.add_argument("--api-key")
    parser.add_argument("--idempotency-key")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
    import django

    django.setup()
    from django.db import connection

    from billing.models import Refund
    from billing.services.credit_notes import create_credit_note
    from hardcount import tenancy

    connection.ensure_connection()
    if args.kill_at:
        _arm(args.kill_at)
    print("ready", flush=True)
    sys.stdin.readline()
    if args.api_key:
        from django.test import Client

        response = Client().post(
            "/v1/credit_notes",
            data=json.dumps({"invoice": args.invoice, "amount": args.amount, "refund_amount": args.amount}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {args.api_key}",
            HTTP_IDEMPOTENCY_KEY=args.idempotency_key,
        )
        body = response.json()
        print(json.dumps({"credit_note": body.get("id"), "refund_outcome": (body.get("refund") or {}).get("outcome")}))
        return
    tenancy.enter(args.tenant, False)
    note = create_credit_note(
        args.invoice, tenant_id=args.tenant, livemode=False, amount=args.amount, refund_amount=args.amount
    )
    outcome = Refund.objects.get(credit_note=note).outcome
    print(json.dumps({"credit_note": note.id, "refund_outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
