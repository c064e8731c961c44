"""Prometheus metrics of docs/reference/metrics.md: one truth per scrape, whichever process answers.

``/metrics`` serves django-prometheus's metrics (requests, database calls) plus the
:class:`HardcountCollector`. Metrics that describe the database — lease holders and stamps, due
and failing subscriptions, billing runs and attempts, the delivery backlog — are computed by
SQL when Prometheus scrapes, so every replica and every worker reports the same, exact values
whatever process did the work, and they survive restarts (decision record 0021).

Counters of what a process does (django-prometheus's ``django_http_*`` and ``django_db_*``, the
outbox's delivery attempts) are prometheus_client metrics. Under gunicorn they are kept in
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set up by
``hardcount/gunicorn.conf.py``): :func:`metrics_registry` then serves their sum over every
worker of the run, dead ones included, so whichever worker answers a scrape the counters never
go down (docs/decisions/0126-metrics-one-truth-per-scrape.md). A single process
(``runscheduler --metrics-port``, ``runserver``, the tests) serves its own registry.

The kernel imports no app (decision record 0121). The lease metrics come from the lease
store the ``leases`` app registers (:func:`hardcount.scheduler.leadership.lease_store`); every
other database metric comes from a **provider** an app registers in its ``AppConfig.ready()``
with :func:`register_metrics` (``billing.metrics.BillingMetrics``,
``outbox.metrics.OutboxMetrics``). The collector runs every provider inside its one scrape
transaction, in registration order (the order of ``INSTALLED_APPS``).

Metrics of the kernel itself:

- ``hardcount_scheduler_last_run_timestamp_seconds{role}``: when the role's last tick completed (Unix s).
- ``hardcount_leader_last_tick_age_seconds{role}``: age of the role's liveness stamp (last tick or drain page).
- ``hardcount_leader_is_leader{role}``: 1 when the role's lease row has a holder whose lease has not
  expired by the database's ``now()``, else 0; the same in every process.
- ``hardcount_leader_holder{role,holder}``: 1 for the holder of that live lease (absent when none).
- ``hardcount_clock_skew_seconds``: this process's clock minus the database's (positive: the app is ahead).

The providers' metrics are listed in their modules (:mod:`billing.metrics`: due, oldest due,
failing, cycle durations, invoices by outcome; :mod:`outbox.metrics`: the delivery backlog and
the executor's delivery attempts counter).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection, transaction
from django.http import HttpResponse
from django.utils.module_loading import import_string
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from hardcount.logfmt import logfmt
from hardcount.scheduler import configured_roles
from hardcount.scheduler.leadership import LeaseStatus, lease_store

logger = logging.getLogger("hardcount.metrics")

DB_EPOCH = "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"


class MetricsProvider(Protocol):
    """An app's database metrics: what :func:`register_metrics` names.

    ``describe()`` returns the families empty (names, help, labels) and must not touch the
    database; ``collect()`` returns them filled, running its statements on the calling
    thread's connection inside the collector's scrape transaction (a 5 s statement timeout).
    A ``DatabaseError`` from ``collect()`` drops every database metric of that scrape.
    """

    def describe(self) -> Iterable[Metric]: ...

    def collect(self) -> Iterable[Metric]: ...


_providers_lock = threading.Lock()
_provider_paths: list[str] = []
_providers: dict[str, MetricsProvider] = {}


def register_metrics(path: str) -> None:
    """Add the provider at dotted ``path`` (a class, instantiated without arguments, or an object).

    Call from ``AppConfig.ready()``. The path is imported at the first scrape, not here, so a
    process that never serves metrics never imports the app's metrics module. Registering the
    same path again changes nothing.
    """
    with _providers_lock:
        if path not in _provider_paths:
            _provider_paths.append(path)


def metrics_providers() -> list[MetricsProvider]:
    """The registered providers, in registration order (imported on first use).

    Raises ``ImproperlyConfigured`` for a path that cannot be imported.
    """
    with _providers_lock:
        for path in _provider_paths:
            if path not in _providers:
                try:
                    obj = import_string(path)
                except ImportError as exc:
                    raise ImproperlyConfigured(f"cannot import metrics provider {path!r}: {exc}") from exc
                _providers[path] = obj() if isinstance(obj, type) else obj
        return [_providers[path] for path in _provider_paths]


def role_intervals() -> dict[str, float]:
    """Configured role name → interval in seconds; empty (and logged) when the configuration is broken."""
    try:
        return {role.name: float(role.interval_s) for role in configured_roles()}
    except ImproperlyConfigured as exc:
        logger.warning(logfmt("roles_misconfigured", error=str(exc)))
        return {}


def measure_clock_skew_s() -> float:
    """This process's ``time.time()`` minus the database's ``clock_timestamp()``, in seconds.

    The app's reading is the midpoint of the round trip, so network latency does not count as skew.
    """
    with connection.cursor() as cursor:
        before = time.time()
        cursor.execute(DB_EPOCH)
        db_now = cursor.fetchone()[0]
        after = time.time()
    return (before + after) / 2 - db_now


class HardcountCollector(Collector):
    """Yields the database metrics of docs/reference/metrics.md on each scrape (one short read-only transaction).

    Families come in a fixed order: the lease families, then each provider's, then the clock
    skew. With ``close_connection`` the thread's database connection is closed after each
    scrape (for the throwaway threads of :func:`serve_metrics`). A database error drops every
    family of this collector from that scrape and is logged; the scrape itself still succeeds,
    with the process counters.
    """

    def __init__(self, *, close_connection: bool = False) -> None:
        self.close_connection = close_connection

    def describe(self) -> Iterator[Metric]:
        # Names only: registration must not touch the database.
        families = self._families()
        provided = [family for provider in metrics_providers() for family in provider.describe()]
        yield from self._in_order(families, provided)

    def collect(self) -> Iterator[Metric]:
        providers = metrics_providers()
        families = self._families()
        try:
            provided = self._fill(families, providers)
        except DatabaseError as exc:
            logger.warning(logfmt("metrics_db_error", error=type(exc).__name__, detail=str(exc)[:200]))
            # Leadership is the lease table's too: without the database there is no value to report.
            families, provided = {}, []
        finally:
            if self.close_connection:
                connection.close()
        yield from self._in_order(families, provided)

    @staticmethod
    def _in_order(families: dict[str, Metric], provided: list[Metric]) -> Iterator[Metric]:
        for key in ("last_run", "tick_age", "is_leader", "holder"):
            if key in families:
                yield families[key]
        yield from provided
        if "skew" in families:
            yield families["skew"]

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {
            "last_run": GaugeMetricFamily(
                "hardcount_scheduler_last_run_timestamp_seconds",
                "When the role's last tick completed (Unix seconds, database clock).",
                labels=["role"],
            ),
            "tick_age": GaugeMetricFamily(
                "hardcount_leader_last_tick_age_seconds",
                "Age of the role's liveness stamp: its last completed tick or billing drain page.",
                labels=["role"],
            ),
            "is_leader": GaugeMetricFamily(
                "hardcount_leader_is_leader",
                "1 when the role's lease has a holder and has not expired (database clock), else 0.",
                labels=["role"],
            ),
            "holder": GaugeMetricFamily(
                "hardcount_leader_holder",
                "1 for the holder of the role's live lease; absent when nobody holds it.",
                labels=["role", "holder"],
            ),
            "skew": GaugeMetricFamily(
                "hardcount_clock_skew_seconds",
                "This process's clock minus the database's clock, in seconds (positive: the app is ahead).",
            ),
        }

    def _fill(self, families: dict[str, Metric], providers: list[MetricsProvider]) -> list[Metric]:
        intervals = role_intervals()
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = '5s'")
            leases = [lease for lease in lease_store().lease_statuses() if reported(lease, intervals)]
            provided = [family for provider in providers for family in provider.collect()]
        families["skew"].add_metric([], measure_clock_skew_s())

        for lease in leases:
            if lease.last_tick_at is not None:
                families["last_run"].add_metric([lease.role], lease.last_tick_at.timestamp())
            if lease.stamp_age_s is not None:
                families["tick_age"].add_metric([lease.role], lease.stamp_age_s)
        self._fill_leadership(families, intervals, leases)
        return provided

    @staticmethod
    def _fill_leadership(families: dict[str, Metric], intervals: dict[str, float], leases: list[LeaseStatus]) -> None:
        # ``held`` is the lease store's reading in the scrape's transaction: a holder, and
        # ``expires_at > now()`` by the database's clock, so every process reads the same.
        by_role = {lease.role: lease for lease in leases}
        for role in sorted({*intervals, *by_role}):
            lease = by_role.get(role)
            held = lease is not None and lease.held and lease.holder is not None
            families["is_leader"].add_metric([role], 1 if held else 0)
            if held:
                families["holder"].add_metric([role, lease.holder], 1)


def reported(lease: LeaseStatus, intervals: dict[str, float]) -> bool:
    """Whether ``/metrics`` and ``/health/ready`` show ``lease``: always for a configured role, else only while held.

    Leases that are not scheduler roles (a tenant's manual billing run takes one for as long as it
    drains) would otherwise leave a series per tenant behind, reading "no leader" for good once
    released, and fire every leader alert.
    """
    return lease.role in intervals or (lease.held and lease.holder is not None)


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory when this process runs in that mode (under gunicorn), else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None


_install_lock = threading.Lock()
_registry: CollectorRegistry | None = None


def metrics_registry(*, close_connection: bool = False) -> CollectorRegistry:
    """The registry ``/metrics`` serves, built once per process with :class:`HardcountCollector` in it.

    In multiprocess mode (:func:`multiprocess_dir`): a registry of its own with the
    :class:`~prometheus_client.multiprocess.MultiProcessCollector`, so the process counters are
    the sums over every worker of the run (prometheus_client's process and GC collectors are
    per process and left out). Otherwise prometheus_client's default registry.
    ``close_connection`` is passed to the collector the first call creates.
    """
    global _registry  # noqa: PLW0603 - one served registry per process
    with _install_lock:
        if _registry is None:
            # Imports the providers first, so the app metrics their modules define (the outbox's
            # delivery attempts counter) exist in this process before the first scrape.
            metrics_providers()
            collector = HardcountCollector(close_connection=close_connection)
            if multiprocess_dir():
                registry = CollectorRegistry()
                MultiProcessCollector(registry)
            else:
                registry = REGISTRY
            registry.register(collector)
            _registry = registry
        return _registry


@csrf_exempt  # as the health probes (hardcount.health): a POST is a 405, not the CSRF check's 403 page
@require_GET
def metrics_view(request):
    """``GET /metrics``: :func:`metrics_registry` in Prometheus's text format."""
    return HttpResponse(generate_latest(metrics_registry()), content_type=CONTENT_TYPE_LATEST)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - a metrics port is meant to be scraped
    """Serve :func:`metrics_registry` on ``addr:port`` from a background thread (``runscheduler --metrics-port``)."""
    start_http_server(port, addr=addr, registry=metrics_registry(close_connection=True))
