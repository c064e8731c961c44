"""Subscription item changes in their own process: the change's kill points, and the changes racing a drain.

``python -m tests.system.change_once --tenant T --subscription S --quantity 5 --behavior always_invoice
[--kill-at POINT]`` sets Django up (``DATABASE_URL`` names the test database), acts for the tenant
(test mode, as an API request does), prints ``ready``, waits for one line on stdin (the start signal)
and applies each change (``--subscription`` may be repeated; ``--behavior`` cycles over them) through
:func:`billing.services.changes.change_subscription`, then prints one JSON line
``{"changed": [...], "invoices": [...], "errors": [...]}``.

``--api-key KEY --idempotency-key K`` makes each change as a request instead: ``POST /v1/subscriptions/{id}`` through
the whole API stack (Django's test client in this process: authentication, the ``Idempotency-Key`` claim, the view)
under that key; the JSON line then has ``responses`` too, ``[{"status": …, "body": …}]``.

``--billing-cycle-anchor now`` restarts each subscription's billing cycle with the change
(:func:`billing.services.changes.restart_cycle`); its ``invoices`` are the new periods' invoices.

``--kill-at`` SIGKILLs the process (no ``finally``, no rollback by Python) at a point of the first
change, logging ``fault_point_reached point=…`` first:

- ``after_invoice_commit``: the change's transaction (items, proration items, its invoice, finalised)
  has committed; ``pay_invoice`` has not been called;
- ``after_charge``: the gateway answered the change's charge (the PaymentIntent exists), nothing of
  the answer is recorded: the attempt stays ``unknown``;
- ``after_restart_commit``: a restart's transaction (items, the credit, the anchor, the new period's
  draft invoice) has committed; the close that charges it has not started;
- ``after_restart_charge``: the restart's close sent the charge and the gateway answered; nothing of the
  answer is recorded.

The points wrap the module globals the change calls (``changes.pay_invoice``, ``invoices.send``,
``changes.close_subscription_period``, ``close.send``), so the service carries no seam for them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

KILL_POINTS = ("after_invoice_commit", "after_charge", "after_restart_commit", "after_restart_charge")


def _die(point: str) -> None:
    print(f"event=fault_point_reached point={point} pid={os.getpid()}", flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    from billing.services import changes, close, invoices

    if point == "after_invoice_commit":
        changes.pay_invoice = lambda *args, **kwargs: _die(point)
    elif point == "after_restart_commit":
        changes.close_subscription_period = lambda *args, **kwargs: _die(point)
    elif point in ("after_charge", "after_restart_charge"):
        module = invoices if point == "after_charge" else close
        send = module.send

        def send_then_die(plan):
            send(plan)
            _die(point)

        module.send = send_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--subscription", action="append", required=True)
    parser.add_argument("--quantity", type=int, action="append", required=True)
    parser.add_argument("--behavior", action="append", required=True)
    parser.add_argument("--kill-at", choices=KILL_POINTS)
    parser.add_argument("--billing-cycle-anchor", choices=("unchanged", "now"), default="unchanged")
    parser.add_argument("--api-key")
    parser.add_argument("--idempotency-key")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hardcount.settings")
    import django

    django.setup()
    from django.db import connection

    from billing.models import SubscriptionItem
    from billing.services.changes import change_subscription
    from hardcount import tenancy
    from hardcount.errors import ServiceError

    connection.ensure_connection()
    tenancy.enter(args.tenant, False)
    if args.kill_at:
        _arm(args.kill_at)
    print("ready", flush=True)
    sys.stdin.readline()
    changed, invoices, errors, responses = [], [], [], []
    for index, subscription_id in enumerate(args.subscription):
        item = SubscriptionItem.objects.filter(subscription_id=subscription_id).order_by("created_at", "id").first()
        quantity = args.quantity[index % len(args.quantity)]
        behavior = args.behavior[index % len(args.behavior)]
        if args.api_key:
            responses.append(_request(args, subscription_id, item.id, quantity, behavior))
            continue
        try:
            _sub, invoice = change_subscription(
                tenant_id=args.tenant,
                livemode=False,
                subscription_id=subscription_id,
                items=[{"id": item.id, "quantity": quantity}],
                proration_behavior=behavior,
                billing_cycle_anchor=args.billing_cycle_anchor,
            )
        except ServiceError as exc:  # a refused change is an answer the test reads, not a crash
            errors.append({"subscription": subscription_id, "error": str(exc)})
            continue
        changed.append(subscription_id)
        if invoice is not None:
            invoices.append({"id": invoice.id, "status": invoice.status})
    out = {"changed": changed, "invoices": invoices, "errors": errors}
    if args.api_key:
        out["responses"] = responses
    print(json.dumps(out), flush=True)


def _request(args, subscription_id: str, item_id: str, quantity: int, behavior: str) -> dict:
    """One change as ``POST /v1/subscriptions/{id}`` through the API stack; its status and JSON body."""
    from django.test import Client

    from hardcount import tenancy

    tenancy.leave()  # the request enters the tenant itself, from its key
    headers = {"HTTP_AUTHORIZATION": f"Bearer {args.api_key}"}
    if args.idempotency_key:
        headers["HTTP_IDEMPOTENCY_KEY"] = args.idempotency_key
    body = {"items": [{"id": item_id, "quantity": quantity}], "proration_behavior": behavior}
    if args.billing_cycle_anchor != "unchanged":
        body["billing_cycle_anchor"] = args.billing_cycle_anchor
    response = Client().post(
        f"/v1/subscriptions/{subscription_id}", data=json.dumps(body), content_type="application/json", **headers
    )
    return {"status": response.status_code, "body": response.json()}


if __name__ == "__main__":
    main()
