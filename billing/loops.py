"""Billing's scheduler roles: ``billing`` (the drain; ``billing:<shard>`` per shard) and ``dunning`` (the dunning pass).

:class:`BillingRole` (docs/reference/roles-and-leases.md, docs/reference/billing.md): a tick,
under the ``billing`` lease, drains live mode, then the test-mode pass, then the reconcilers of
both modes (invoices whose tax is pending, payments whose outcome is unknown); between the two,
it resumes test-clock advances and manual runs whose process died. The tick's fence
guards every write of the drain; its liveness stamp is written after every page, so a drain
longer than the interval never looks stale. A lost lease or a stop request ends the tick at the
drain's next safe point (``fence.alive()``). With ``HARDCOUNT_BILLING_SHARDS`` > 1 there is one
such role per shard (``billing:0`` …, :mod:`billing.shards`), each draining its tenants under its
own lease and fence; shard 0 alone runs the resumes, the reconcilers and the pruning of the meter events'
identifier guard past its retention (:func:`billing.services.usage.prune_identifiers`).

:class:`DunningRole` (docs/reference/dunning.md): retries of declined invoices, one replica at a
time. A tick, under the ``dunning`` lease: the live-mode pass, then the test-mode pass, over
wall-clock runs (a test clock's runs are due by its advance). Each pass claims due runs
``FOR UPDATE SKIP LOCKED`` and retries or settles them (:mod:`billing.services.dunning_pass`);
every write is checked against ``ctx.fence``, and a lost lease or a stop request ends the tick
at the next safe point (before the next page or run). The liveness stamp is written after every
page. The role lives here, beside billing's, because the pass is billing's (dunning imports
nothing of billing, docs/decisions/0120); its name and cadence are dunning's own.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from billing.models import BillingRun
from billing.services.clocks import resume_stalled_advances
from billing.services.drain import drain_due, reconcile
from billing.services.dunning_pass import process_due
from billing.services.manual_runs import resume_stalled_manual_runs
from billing.services.usage import prune_identifiers
from billing.shards import FAMILY, Shard, configured_count
from hardcount.scheduler import TickContext, TickFailed

MODES = ((True, "live"), (False, "test"))


class BillingRole:
    """Scheduler role of billing shard ``shard`` of ``shards``, every ``HARDCOUNT_BILLING_INTERVAL_S`` seconds (1 h).

    Its name is the shard's lease role (:func:`billing.shards.lease_role`): ``billing`` for a single
    shard, ``billing:<shard>`` (family ``billing``) otherwise. ``shards`` defaults to
    ``HARDCOUNT_BILLING_SHARDS``. As a settings entry it is a role group (:meth:`roles`): one role per shard.
    """

    def __init__(self, shard: int = 0, shards: int | None = None) -> None:
        self.shard = Shard(shard, configured_count() if shards is None else shards)
        self.name = self.shard.lease_role
        self.family = FAMILY if self.shard.count > 1 else None

    @property
    def interval_s(self) -> float:
        return settings.HARDCOUNT_BILLING_INTERVAL_S

    def roles(self) -> list[BillingRole]:
        """The role of every shard: this one alone when there is one shard."""
        count = self.shard.count
        return [self] if count == 1 else [BillingRole(index, count) for index in range(count)]

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """Drain the shard's live, then test subscriptions; shard 0 then also runs the unsharded steps (the resumes of
        stalled test-clock advances and manual runs, and the reconcilers of both modes). Returns counts per mode for
        the log line.

        Raises :class:`TickFailed` when a drain was ended by a database error (after the
        other mode and the reconcilers had their turn), so the tick is retried soon.
        """
        counts: dict[str, Any] = {}
        failed_runs = []
        for livemode, mode in MODES:
            if not ctx.fence.alive():
                return counts
            run = drain_due(
                livemode=livemode,
                trigger=BillingRun.Trigger.SCHEDULER,
                fence=ctx.fence,
                on_page=ctx.stamp,
                shard=self.shard,
            )
            if run.status == BillingRun.FAILED:
                failed_runs.append(f"{run.id} ({mode}): {run.error}")
            counts[f"{mode}_run"] = run.id
            counts[f"{mode}_attempted"] = run.attempted
            counts[f"{mode}_billed"] = run.billed
            counts[f"{mode}_failed"] = run.failed
        # The unsharded steps are shard 0's (docs/decisions/0194-billing-shards.md).
        if self.shard.runs_singletons and not self._singletons(ctx, counts):
            return counts
        if failed_runs:
            # Not a completed tick: the ticker retries in min(interval, 30 s), not an hour later.
            raise TickFailed("billing drain ended by a database error: " + "; ".join(failed_runs))
        ctx.stamp()
        return counts

    @staticmethod
    def _singletons(ctx: TickContext, counts: dict[str, Any]) -> bool:
        """Resume stalled test-clock advances and manual runs, then reconcile both modes; False when stopped at a safe
        point."""
        # Test-clock advances whose process died resume in the background (billing/services/clocks.py).
        counts["test_clocks_resumed"] = len(resume_stalled_advances(livemode=False))
        # So do manual runs whose process died (billing/services/manual_runs.py), of both modes.
        counts["manual_runs_resumed"] = len(resume_stalled_manual_runs())
        for livemode, mode in MODES:
            if not ctx.fence.alive():
                return False
            reconciled = reconcile(livemode=livemode, fence=ctx.fence) or {}
            for key, value in reconciled.items():
                counts[f"{mode}_reconcile_{key}"] = value
        # The meter events' identifier guard past its retention (docs/decisions/0219): one indexed range, small.
        counts["meter_identifiers_pruned"] = prune_identifiers(fence=ctx.fence, on_batch=ctx.stamp)
        return True


class DunningRole:
    """Scheduler role ``dunning``, every ``HARDCOUNT_DUNNING_INTERVAL_S`` seconds (default 60)."""

    name = "dunning"

    @property
    def interval_s(self) -> float:
        return settings.HARDCOUNT_DUNNING_INTERVAL_S

    def tick(self, ctx: TickContext) -> dict[str, Any]:
        """One pass per mode; returns the number of runs acted on per mode, for the log line."""
        counts: dict[str, Any] = {}
        for livemode, mode in MODES:
            counts[f"{mode}_runs"] = process_due(livemode=livemode, fence=ctx.fence, on_page=ctx.stamp)
            ctx.stamp()
        return counts
