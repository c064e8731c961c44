"""Dunning's entry points for other apps (billing calls these inside its own transactions).

Minimal first version, written with the billing drain (issue 3): it only opens and closes the
:class:`~dunning.models.DunningRun` row of a declined invoice. The dunning issue fills in the
schedule (retry 1, 3, 5, 7 days after the decline), hard declines, end states and events.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection

from dunning.models import DunningRun


def start_dunning(invoice, *, declined_at: datetime, decline_code: str) -> DunningRun:
    """Open the dunning run of a declined ``invoice`` (a ``billing.Invoice``), or return the open one.

    Must run inside the transaction that records the decline (raises ``RuntimeError``
    otherwise), so the run exists exactly when the decline does. Idempotent per invoice.
    ``declined_at`` is the billing time of the decline (a test clock's time where one applies).
    """
    if not connection.in_atomic_block:
        raise RuntimeError("start_dunning must run inside the transaction that records the decline")
    run, created = DunningRun.objects.get_or_create(
        invoice_id=invoice.id,
        defaults={
            "tenant_id": invoice.tenant_id,
            "livemode": invoice.livemode,
            "first_declined_at": declined_at,
            "last_decline_code": decline_code or "",
            "created_at": declined_at,
        },
    )
    if not created and decline_code and run.last_decline_code != decline_code:
        run.last_decline_code = decline_code
        run.save(update_fields=["last_decline_code"])
    return run


def stop_dunning(invoice, *, ended_at: datetime, recovered: bool = False) -> None:
    """End the active dunning run of ``invoice``, if any: ``recovered`` when it was paid, else ``ended`` (voided).

    Runs inside the caller's transaction (the one that pays or voids the invoice).
    """
    DunningRun.objects.filter(invoice_id=invoice.id, status=DunningRun.ACTIVE).update(
        status=DunningRun.RECOVERED if recovered else DunningRun.ENDED, ended_at=ended_at, next_attempt_at=None
    )
