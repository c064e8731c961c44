"""Kill points inside a billing close, armed from the test, for real ``runscheduler`` processes.

Load it into a child process as a scheduler service (``HARDCOUNT_SERVICES=tests.system.faults.FaultPoints``)
with ``HARDCOUNT_FAULT_FILE=<path>``. ``start()`` installs the close's test seams
(:data:`billing.services.close.hooks`); each time a close passes one, the seam reads the file: a JSON
object ``{"point": <name>, "subscription_id": <id>}`` arms that point for that subscription (an empty
or missing file arms nothing). When the armed close reaches the point, the process logs
``event=fault_point_reached point=… subscription=…`` and SIGKILLs itself: no ``finally``, no
rollback by Python, exactly as a machine losing power.

The points (``POINTS``):

- ``after_prepare``: step 1 (invoice materialised, finalised, payment attempt reserved) has
  committed; the gateway has not been called;
- ``after_charge``: the gateway answered (the charge, if any, happened), nothing recorded yet;
- ``during_record``: inside step 3's transaction, after its writes (invoice paid, period
  advanced …), before it commits: PostgreSQL rolls all of it back;
- ``after_usage``: inside step 1's transaction, once the close (or its page) has aggregated the
  period's usage and the subscription has usage lines to bill, before the invoice is written or
  committed: PostgreSQL rolls the page's step 1 back.

The file is re-read at every seam, so a test arms the next point for the next book while a
standby replica (which loaded this service at start) is already running, and disarms it (by
emptying the file) before a successor closes the same subscription again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from hardcount.logfmt import logfmt

logger = logging.getLogger("tests.system.faults")

POINTS = ("after_prepare", "after_charge", "during_record", "after_usage")


def arm(path: str, point: str | None, subscription_id: str | None = None) -> None:
    """Arm ``point`` for ``subscription_id`` in the fault file at ``path`` (None: disarm). Atomic (rename)."""
    if point is not None and point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"point": point, "subscription_id": subscription_id} if point else {}, f)
    os.replace(tmp, path)


def _armed() -> tuple[str | None, str | None]:
    path = os.environ.get("HARDCOUNT_FAULT_FILE")
    if not path:
        return None, None
    try:
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError):
        return None, None
    return plan.get("point"), plan.get("subscription_id")


def _reached(point: str, subscription_id: str | None) -> None:
    armed_point, armed_subscription = _armed()
    if armed_point != point or armed_subscription != subscription_id:
        return
    logger.warning(logfmt("fault_point_reached", point=point, subscription=subscription_id, pid=os.getpid()))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPoints:
    """Scheduler service (tests only) that installs the kill points of the module docstring."""

    name = "fault_points"

    def start(self) -> None:
        from billing.services import close

        close.hooks.after_prepare = lambda plan: _reached("after_prepare", plan.subscription_id)
        close.hooks.after_charge = lambda plan, result: _reached("after_charge", plan.subscription_id)
        close.hooks.during_record = lambda invoice, attempt, outcome: _reached("during_record", invoice.subscription_id)
        close.hooks.after_usage = lambda subscription_id, lines: lines and _reached("after_usage", subscription_id)
        logger.info(logfmt("fault_points_installed", points=",".join(POINTS)))

    def stop(self) -> None:
        from billing.services import close

        close.hooks.after_prepare = close.hooks.after_charge = close.hooks.during_record = None
        close.hooks.after_usage = None
