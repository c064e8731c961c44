"""Gunicorn settings for the web process (``gunicorn -c hardcount/gunicorn.conf.py``).

Everything is read from the environment:

- ``HARDCOUNT_BIND`` (default ``127.0.0.1:<HARDCOUNT_PORT>``, port default 8000);
- ``HARDCOUNT_WEB_WORKERS`` (default 2) worker processes, ``HARDCOUNT_WEB_THREADS`` (default 4)
  threads each;
- ``HARDCOUNT_GRACEFUL_TIMEOUT_S`` (default 15): how long SIGTERM waits for in-flight work
  (requests, a billing page) before workers are killed;
- ``HARDCOUNT_RUN_SCHEDULER=1``: every worker also runs the scheduler runtime (docs/reference/roles-and-leases.md: a
  single deployable). Each worker is then a replica of its own — its own holder id — and
  the leases make sure each role runs in one of them at a time. The runtime starts after
  the worker has loaded the application and stops (releasing its leases) when the worker
  exits, so a rolling restart hands the roles over at once.

Request limits (docs/security.md): the product's own limits are enforced by
:class:`hardcount.limits.RequestLimitsMiddleware` with the API's JSON errors. gunicorn's are set
above them — the request line at gunicorn's maximum (8190 bytes), header fields at 32 KiB each
and 500 in all (gunicorn buffers up to fields × field size before it refuses, so its own
maxima, 32768 fields of unbounded size, would let one request make a worker hold gigabytes).
Whatever gunicorn still refuses while parsing is answered with the same JSON error body by
:class:`hardcount.limits.JsonErrorWorker`, a ``gthread`` worker.

Metrics (docs/decisions/0126-metrics-one-truth-per-scrape.md): a scrape of ``/metrics`` is
answered by whichever worker takes it, so the process counters (django-prometheus's
``django_http_*`` and ``django_db_*``, the outbox's delivery attempts) are kept in
prometheus_client's multiprocess mode, and every worker serves their sum over all workers of
this run. Reading this file creates the run's directory, ``hardcount-metrics-<master pid>-*``
in the temporary directory (``TMPDIR``), and sets ``PROMETHEUS_MULTIPROC_DIR`` to it before any
worker imports prometheus_client; the master removes it on exit, and removes those of masters
that are gone (killed). A ``PROMETHEUS_MULTIPROC_DIR`` set in the environment is used as it
is (created if missing, never emptied or removed: empty it between runs).
"""

import glob
import os
import re
import shutil
import tempfile

wsgi_app = "hardcount.wsgi:application"
bind = os.environ.get("HARDCOUNT_BIND", f"127.0.0.1:{os.environ.get('HARDCOUNT_PORT', '8000')}")
workers = int(os.environ.get("HARDCOUNT_WEB_WORKERS", "2"))
worker_class = "hardcount.limits.JsonErrorWorker"
threads = int(os.environ.get("HARDCOUNT_WEB_THREADS", "4"))
graceful_timeout = int(os.environ.get("HARDCOUNT_GRACEFUL_TIMEOUT_S", "15"))
timeout = 60
accesslog = "-"
limit_request_line = 8190
limit_request_field_size = 32768
limit_request_fields = 500
errorlog = "-"

METRICS_DIR_PREFIX = "hardcount-metrics-"
# "<master pid>:<directory>" of the directory this configuration created. Reading the file again
# in the same master (SIGHUP) keeps the directory, so the counters go on; a new master (a USR2
# re-exec inherits the environment) makes its own.
_METRICS_DIR_OWNER = "HARDCOUNT_METRICS_DIR_OWNER"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_metrics_dirs(parent: str) -> None:
    for path in glob.glob(os.path.join(parent, METRICS_DIR_PREFIX + "*")):
        match = re.fullmatch(re.escape(METRICS_DIR_PREFIX) + r"(\d+)-.*", os.path.basename(path))
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def setup_metrics_dir() -> str | None:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` at this run's directory; the directory when this master owns it.

    None when the environment named the directory itself (it is then the operator's to empty).
    """
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    owner = os.environ.get(_METRICS_DIR_OWNER, "")
    if given and owner == f"{os.getpid()}:{given}":
        os.makedirs(given, exist_ok=True)
        return given
    if given and not owner:
        os.makedirs(given, exist_ok=True)
        return None
    parent = tempfile.gettempdir()
    _remove_stale_metrics_dirs(parent)
    path = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-", dir=parent)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    os.environ[_METRICS_DIR_OWNER] = f"{os.getpid()}:{path}"
    return path


_owned_metrics_dir = setup_metrics_dir()


def _scheduler_enabled() -> bool:
    from django.conf import settings

    return settings.HARDCOUNT_RUN_SCHEDULER


def post_worker_init(worker):
    """In each worker, once Django is set up: start the scheduler runtime if enabled."""
    if _scheduler_enabled():
        from hardcount.scheduler import start_process_runtime

        start_process_runtime()


def _stop_runtime():
    from hardcount.scheduler import stop_process_runtime

    # Within the graceful timeout: roles stop at their next safe point and release their leases.
    stop_process_runtime(timeout_s=max(1.0, graceful_timeout - 2.0))


def worker_int(worker):
    """SIGINT/SIGQUIT to a worker: release the leases before it goes."""
    _stop_runtime()


def worker_abort(worker):
    """SIGABRT (the worker timed out): best effort, release the leases."""
    _stop_runtime()


def worker_exit(server, worker):
    """The worker is exiting (graceful stop or restart): stop the runtime, releasing its leases."""
    _stop_runtime()


def child_exit(server, worker):
    """In the master, once a worker is gone: drop its live gauges; its counters stay in the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    """The master is exiting: remove the metrics directory it created."""
    if _owned_metrics_dir:
        shutil.rmtree(_owned_metrics_dir, ignore_errors=True)
