"""Log lines as text or one JSON object per line, with the request, tenant and scheduler role they belong to.

``HARDCOUNT_LOG_FORMAT`` picks the formatter in ``settings.LOGGING`` (:func:`logging_config`):
``text`` (the default, for a terminal) or ``json`` (production, for a log pipeline). A JSON line
carries ``timestamp`` (UTC, ISO 8601), ``level``, ``logger`` and ``message`` and, where known,
``request_id``, ``tenant``, ``livemode``, ``api_key`` (the key's id, never the key) and ``role``
(the scheduler role whose tick logged it), plus any ``extra=`` fields of the call. The
formatting is python-json-logger's. Record: docs/decisions/0138-structured-json-logs.md.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.core import signals
from django.core.exceptions import ImproperlyConfigured
from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")

# Fields bound to the current request or tick; ``"request"`` is the HttpRequest, read when a line is logged
# (authentication happens after the middleware has run).
_context: ContextVar[dict[str, Any] | None] = ContextVar("hardcount_log_context", default=None)

# A proxy's request id is kept when it is short printable ASCII; anything else could forge log lines.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Add ``fields`` to every line logged inside the ``with`` block (in this thread or task)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def current_fields() -> dict[str, Any]:
    """The context fields of a line logged now: request id, tenant, mode, key id, role — those known."""
    context = _context.get() or {}
    fields = {key: value for key, value in context.items() if key != "request"}
    request = context.get("request")
    api_key = getattr(request, "auth", None) if request is not None else None
    if api_key is not None and hasattr(api_key, "tenant_id"):
        fields.update(tenant=api_key.tenant_id, livemode=api_key.livemode, api_key=api_key.pk)
    return fields


class ContextFilter(logging.Filter):
    """Copies :func:`current_fields` onto each record (an ``extra=`` of the call wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in current_fields().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonLineFormatter(JsonFormatter):
    """One JSON object per line: ``timestamp`` (UTC), ``level``, ``logger``, ``message``, then the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("timestamp", True)
        kwargs.setdefault("rename_fields", {"levelname": "level", "name": "logger"})
        super().__init__("%(levelname)s %(name)s %(message)s", *args, **kwargs)


class RequestContextMiddleware:
    """Binds the request (and its ``X-Request-Id``, or a new one) to the lines it logs.

    Cleared on ``request_finished``, not when this middleware returns: Django logs a 4xx/5xx
    (``django.request``) after the whole middleware chain has answered.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        given = request.META.get("HTTP_X_REQUEST_ID", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        _context.set({"request_id": request_id, "request": request})
        return self.get_response(request)


def _clear(**_: Any) -> None:
    _context.set(None)


signals.request_finished.connect(_clear, dispatch_uid="hardcount.logs.clear")


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """``settings.LOGGING`` for ``log_format`` (``text`` or ``json``) at root ``level``.

    Raises :class:`ImproperlyConfigured` for any other format.
    """
    if log_format not in FORMATS:
        raise ImproperlyConfigured(f"HARDCOUNT_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {log_format!r}")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {
            "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
            "json": {"()": JsonLineFormatter},
        },
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": log_format, "filters": ["context"]},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django.db.backends": {"level": "WARNING"},
            # One INFO line per webhook POST and gateway call drowns the service's own log; the
            # executor and the gateway record every attempt in the database instead.
            "httpx": {"level": "WARNING"},
            "stripe": {"level": "WARNING"},
        },
    }
