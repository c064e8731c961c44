"""Test-only scheduler roles for the process-level tests, configured through the environment.

``ScratchRole`` (role ``scratch``) and ``SecondScratchRole`` (role ``scratch-2``): each tick
writes ``SCRATCH_PAGES`` rows ("pages") to the ``system_scratch`` table, one fenced
transaction per page, stamping liveness after each and spending ``SCRATCH_PAGE_S`` seconds
on each page's "work". ``SCRATCH_INTERVAL_S`` is the interval. With ``SCRATCH_FENCE=raw``
the role skips the safe-point test (``fence.alive()``; it still honours a stop request) and
checks only the database half of the fence, as a holder whose own abandon logic failed would: then a refused write shows
PostgreSQL itself turning the deposed token away (logged as ``scratch_write_refused``).
"""

from __future__ import annotations

import logging
import os
import time

from django.db import connection, transaction

from hardcount.fencing import LeaseLost
from hardcount.logfmt import logfmt
from hardcount.scheduler import TickContext
from leases.services import check_fence

logger = logging.getLogger("tests.system.roles")

CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS system_scratch (
    id bigserial PRIMARY KEY,
    role text NOT NULL,
    holder text NOT NULL,
    token bigint NOT NULL,
    page int NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


class ScratchRole:
    """See the module docstring."""

    name = "scratch"

    @property
    def interval_s(self) -> float:
        return float(os.environ.get("SCRATCH_INTERVAL_S", "1"))

    def tick(self, ctx: TickContext) -> dict:
        pages = int(os.environ.get("SCRATCH_PAGES", "1"))
        page_s = float(os.environ.get("SCRATCH_PAGE_S", "0"))
        raw = os.environ.get("SCRATCH_FENCE") == "raw"
        written = 0
        for page in range(pages):
            if ctx.fence.stop_requested if raw else not ctx.fence.alive():
                break
            try:
                with transaction.atomic():
                    if raw:
                        check_fence(self.name, ctx.holder, ctx.token)
                    else:
                        ctx.fence.check()
                    with connection.cursor() as cursor:
                        cursor.execute(
                            "INSERT INTO system_scratch (role, holder, token, page) VALUES (%s, %s, %s, %s)",
                            [self.name, ctx.holder, ctx.token, page],
                        )
            except LeaseLost:
                logger.warning(logfmt("scratch_write_refused", role=self.name, token=ctx.token, page=page))
                raise
            written += 1
            ctx.stamp()
            if page_s:
                time.sleep(page_s)
        return {"pages": written}


class SecondScratchRole(ScratchRole):
    """The same, as role ``scratch-2``: roles are leased independently."""

    name = "scratch-2"
