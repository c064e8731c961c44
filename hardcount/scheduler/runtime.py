"""The scheduler runtime: a ticker thread per role and the leaderless services, started and stopped together.

``python manage.py runscheduler`` runs one in the foreground; with
``HARDCOUNT_RUN_SCHEDULER=1`` each gunicorn worker runs one too (see
``hardcount/gunicorn.conf.py``, which calls :func:`start_process_runtime` and
:func:`stop_process_runtime`). Every runtime has its own holder id
(``hostname:pid:random``), so two runtimes — two processes, or two in one test process —
compete for leases like two replicas. The leases come from the registered lease store
(:mod:`hardcount.scheduler.leadership`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

from hardcount.logfmt import logfmt
from hardcount.scheduler.leadership import lease_store
from hardcount.scheduler.registry import Role, Service, configured_roles, configured_services
from hardcount.scheduler.ticker import Family, Ticker

logger = logging.getLogger("hardcount.scheduler")

_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()
_process_runtime: Runtime | None = None
_process_lock = threading.Lock()


class Runtime:
    """Ticker threads for ``roles`` (default: the configured ones) and the given ``services``.

    ``start()`` returns at once; ``stop(timeout_s)`` asks every ticker to stop at its next
    safe point, stops the services, releases the leases and waits up to ``timeout_s`` for
    the threads; it returns True when every thread has ended.
    """

    def __init__(
        self,
        roles: Sequence[Role] | None = None,
        services: Sequence[Service] | None = None,
        *,
        holder: str | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.holder = holder or lease_store().new_holder_id()
        self.roles = list(configured_roles() if roles is None else roles)
        self.services = list(configured_services() if services is None else services)
        families: dict[str, Family] = {}
        self.tickers = []
        for role in self.roles:
            name = getattr(role, "family", None)
            family = families.setdefault(name, Family(name)) if name else None
            self.tickers.append(Ticker(role, self.holder, poll_s=poll_s, family=family))
        self._started_services: list[Service] = []
        self._started = False

    def start(self) -> None:
        """Start the services, then one ticker thread per role."""
        if self._started:
            return
        self._started = True
        _runtimes.add(self)
        logger.info(
            logfmt(
                "runtime_started",
                holder=self.holder,
                roles=",".join(r.name for r in self.roles) or "-",
                services=",".join(s.name for s in self.services) or "-",
            )
        )
        for service in self.services:
            service.start()
            self._started_services.append(service)
            logger.info(logfmt("service_started", service=service.name))
        for ticker in self.tickers:
            ticker.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop at the next safe points, release leases, stop services; True if all threads ended in time."""
        deadline = time.monotonic() + timeout_s
        for ticker in self.tickers:
            ticker.request_stop()
        for service in reversed(self._started_services):
            try:
                service.stop()
            except Exception:
                logger.exception(logfmt("service_stop_failed", service=service.name))
            else:
                logger.info(logfmt("service_stopped", service=service.name))
        self._started_services.clear()
        ended = all(ticker.join(max(0.0, deadline - time.monotonic())) for ticker in self.tickers)
        _runtimes.discard(self)
        logger.info(logfmt("runtime_stopped", holder=self.holder, clean=ended))
        return ended

    def leadership(self) -> dict[str, bool]:
        """Role name → whether this runtime holds its lease now."""
        return {ticker.role.name: ticker.is_leader for ticker in self.tickers}


def process_leadership(role_names: Iterable[str] = ()) -> dict[str, bool]:
    """Role name → whether any runtime of this process holds it (``role_names`` are included as False)."""
    result = dict.fromkeys(role_names, False)
    for runtime in list(_runtimes):
        for name, leading in runtime.leadership().items():
            result[name] = result.get(name, False) or leading
    return result


def start_process_runtime() -> Runtime:
    """Start this process's runtime (once; later calls return it). Used by the gunicorn worker hook."""
    global _process_runtime  # noqa: PLW0603 - one runtime per process, by design
    with _process_lock:
        if _process_runtime is None:
            _process_runtime = Runtime()
            _process_runtime.start()
        return _process_runtime


def stop_process_runtime(timeout_s: float = 10.0) -> bool:
    """Stop the runtime :func:`start_process_runtime` started, if any; True when it stopped cleanly."""
    global _process_runtime
    with _process_lock:
        runtime, _process_runtime = _process_runtime, None
    return True if runtime is None else runtime.stop(timeout_s)
