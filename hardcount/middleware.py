"""Request-level guards that run before any view or parser."""

from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse


def error_response(status: int, type_: str, code: str, message: str, param: str | None = None) -> JsonResponse:
    """The SPEC §7 error body ``{"error": {"type", "code", "message", "param"}}``."""
    return JsonResponse({"error": {"type": type_, "code": code, "message": message, "param": param}}, status=status)


class BodySizeLimitMiddleware:
    """Refuse API request bodies over ``HARDCOUNT_MAX_BODY_BYTES`` (default 1 MiB) with a 413.

    Checked on the declared ``Content-Length`` before the body is read, and on the bytes
    actually read for chunked bodies, so an oversized body is never parsed.
    """

    def __init__(self, get_response):
        self.get_response = get_response
        self.limit = settings.HARDCOUNT_MAX_BODY_BYTES

    def __call__(self, request):
        if request.path.startswith("/v1/"):
            try:
                declared = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return error_response(
                    400, "invalid_request_error", "invalid_content_length", "Content-Length is not a number."
                )
            if declared > self.limit:
                return error_response(
                    413,
                    "invalid_request_error",
                    "body_too_large",
                    f"Request body exceeds {self.limit} bytes.",
                )
        return self.get_response(request)
