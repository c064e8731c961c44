"""Every lock dunning takes on its own rows, written once (docs/decisions/0120).

Each function returns rows ``FOR UPDATE`` inside the caller's transaction (Django raises
``TransactionManagementError`` outside one). Inside billing's transactions they come after the
rows billing locked itself: dunning's state functions run last there. Several runs at once are
locked in one order, :data:`RUN_GROUP_ORDER`.

Unlike Saleor's ``lock_objects`` these take no ``of=("self",)``: the group locks filter through
the invoice, and a plain ``FOR UPDATE`` locks those joined ``billing_invoice`` rows too, which
is what they have always done; narrowing it would change which rows are locked.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import QuerySet

from dunning import queries
from dunning.models import DunningRun, DunningSettings

# Several runs (a customer's, a subscription's) are locked oldest first, so a payment-method change
# and an exhaustion that cancels a subscription take shared runs in the same order.
RUN_GROUP_ORDER = ("created_at", "id")


def run_qs_select_for_update() -> QuerySet[DunningRun]:
    """Dunning runs ``FOR UPDATE``, in primary-key order."""
    return DunningRun.objects.order_by("pk").select_for_update()


def settings_qs_select_for_update() -> QuerySet[DunningSettings]:
    """Tenants' dunning policy rows ``FOR UPDATE``, in primary-key order."""
    return DunningSettings.objects.order_by("pk").select_for_update()


def get_run_of_invoice_locked(invoice_id: str) -> DunningRun | None:
    """The invoice's run (any status), locked; None when the invoice has none."""
    return run_qs_select_for_update().filter(invoice_id=invoice_id).first()


def get_active_run_of_invoice_locked(invoice_id: str) -> DunningRun | None:
    """The invoice's run, locked, if it is ``active``; else None."""
    return run_qs_select_for_update().filter(invoice_id=invoice_id, status=DunningRun.ACTIVE).first()


def get_active_run_locked(run_id: str) -> DunningRun | None:
    """Run ``run_id``, locked, if it is still ``active``; else None."""
    return run_qs_select_for_update().filter(pk=run_id, status=DunningRun.ACTIVE).first()


def active_runs_of_customer_locked(customer_id: str) -> list[DunningRun]:
    """The active runs of the customer's invoices, locked in :data:`RUN_GROUP_ORDER` (their invoices too)."""
    return list(
        run_qs_select_for_update()
        .filter(invoice__customer_id=customer_id, status=DunningRun.ACTIVE)
        .order_by(*RUN_GROUP_ORDER)
    )


def active_runs_of_subscription_locked(subscription_id: str) -> list[DunningRun]:
    """The active runs of the subscription's invoices, locked in :data:`RUN_GROUP_ORDER` (their invoices too)."""
    return list(
        run_qs_select_for_update()
        .filter(invoice__subscription_id=subscription_id, status=DunningRun.ACTIVE)
        .order_by(*RUN_GROUP_ORDER)
    )


def due_runs_locked(
    *, livemode: bool, as_of: datetime, test_clock_id: str | None, exclude: list[str], limit: int
) -> list[DunningRun]:
    """Up to ``limit`` due runs, locked ``SKIP LOCKED`` (:data:`dunning.queries.CLAIM_DUE_RUNS`), oldest due first."""
    ids = queries.claim_due_runs(
        livemode=livemode, as_of=as_of, test_clock_id=test_clock_id, exclude=exclude, limit=limit
    )
    return list(DunningRun.objects.filter(pk__in=ids).order_by("next_attempt_at", "id"))


__all__ = [
    "RUN_GROUP_ORDER",
    "active_runs_of_customer_locked",
    "active_runs_of_subscription_locked",
    "due_runs_locked",
    "get_active_run_locked",
    "get_active_run_of_invoice_locked",
    "get_run_of_invoice_locked",
    "run_qs_select_for_update",
    "settings_qs_select_for_update",
]
