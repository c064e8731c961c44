"""Request-level guards that run before any view or parser."""

from __future__ import annotations

import re

from django.conf import settings
from django.http import JsonResponse

from hardcount.errors import API_PATH_PREFIXES, INVALID_REQUEST, error_body


def error_response(status: int, type_: str, code: str, message: str, param: str | None = None) -> JsonResponse:
    """The docs/reference/api.md error body ``{"error": {"type", "code", "message", "param"}}`` as a response."""
    return JsonResponse(error_body(type_, code, message, param), status=status)


class BodySizeLimitMiddleware:
    """Refuse API (and inbound Stripe webhook) request bodies over ``HARDCOUNT_MAX_BODY_BYTES`` (default 1 MiB)
    with a 413, and bodies without a ``Content-Length`` (chunked transfer encoding) with a 411.

    Checked on the declared ``Content-Length`` before anything reads the body. Django reads
    at most ``Content-Length`` bytes, and ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (set to the same
    limit) backs this check wherever the body is read (answered 413 by
    :func:`hardcount.errors.handler400` and the API's idempotency step).
    """

    def __init__(self, get_response):
        self.get_response = get_response
        self.limit = settings.HARDCOUNT_MAX_BODY_BYTES

    def __call__(self, request):
        if request.path.startswith(API_PATH_PREFIXES):
            if request.META.get("HTTP_TRANSFER_ENCODING") and not request.META.get("CONTENT_LENGTH"):
                # Django's WSGI request reads exactly Content-Length bytes: a chunked body would be
                # parsed as empty and, e.g., a cancel "at_period_end" would cancel at once. Refuse it.
                return error_response(
                    411,
                    INVALID_REQUEST,
                    "length_required",
                    "Send the body with a Content-Length header; chunked request bodies are not accepted.",
                )
            raw = request.META.get("CONTENT_LENGTH") or "0"
            if not re.fullmatch(r"[0-9]{1,18}", raw):
                return error_response(
                    400, INVALID_REQUEST, "invalid_content_length", "Content-Length is not a valid number."
                )
            if int(raw) > self.limit:
                return error_response(
                    413,
                    INVALID_REQUEST,
                    "body_too_large",
                    f"Request body exceeds {self.limit} bytes.",
                )
        return self.get_response(request)
