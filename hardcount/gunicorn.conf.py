"""Gunicorn settings for the web process (``gunicorn -c hardcount/gunicorn.conf.py``).

Minimal version written for ``make run`` (helper E); helper C owns this file and extends it
with the scheduler runtime's worker hooks. Everything is read from the environment:

- ``HARDCOUNT_BIND`` (default ``127.0.0.1:<HARDCOUNT_PORT>``, port default 8000);
- ``HARDCOUNT_WEB_WORKERS`` (default 2) worker processes, ``HARDCOUNT_WEB_THREADS`` (default 4)
  threads each;
- ``HARDCOUNT_GRACEFUL_TIMEOUT_S`` (default 15): how long SIGTERM waits for in-flight work
  (requests, a billing page) before workers are killed.
"""

import os

wsgi_app = "hardcount.wsgi:application"
bind = os.environ.get("HARDCOUNT_BIND", f"127.0.0.1:{os.environ.get('HARDCOUNT_PORT', '8000')}")
workers = int(os.environ.get("HARDCOUNT_WEB_WORKERS", "2"))
worker_class = "gthread"
threads = int(os.environ.get("HARDCOUNT_WEB_THREADS", "4"))
graceful_timeout = int(os.environ.get("HARDCOUNT_GRACEFUL_TIMEOUT_S", "15"))
timeout = 60
accesslog = "-"
errorlog = "-"
