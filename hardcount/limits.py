"""Request limits answered with the API's JSON error body, by the application and by gunicorn.

Two layers (docs/security.md):

- :class:`RequestLimitsMiddleware`, first in Django's middleware, enforces the product's own
  limits: the request target (path and query) at most ``HARDCOUNT_MAX_REQUEST_TARGET_BYTES``
  (4096) → 414, each header field (name and value) at most ``HARDCOUNT_MAX_HEADER_BYTES``
  (8192) and at most ``HARDCOUNT_MAX_HEADERS`` (100) fields → 431, a control character in a
  header value → 400.
- gunicorn's own limits (``hardcount/gunicorn.conf.py``) sit above those, so the middleware
  answers first; what gunicorn still refuses while parsing (a request line or header beyond
  its limits, a byte that HTTP forbids) is answered by :class:`JsonErrorWorker`, gunicorn's
  threaded worker with its HTML error page replaced by the same JSON body.
"""

from __future__ import annotations

import json
import re
from datetime import datetime

from django.conf import settings
from gunicorn import util
from gunicorn.http import errors as gerrors
from gunicorn.http.wsgi import Response, default_environ
from gunicorn.workers.gthread import ThreadWorker

INVALID_REQUEST = "invalid_request_error"
# RFC 9110 §5.5: a field value never holds these (tab is allowed); gunicorn refuses them too.
_FORBIDDEN_IN_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_REASONS = {400: "Bad Request", 403: "Forbidden", 414: "URI Too Long", 417: "Expectation Failed"}
_REASONS |= {431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented"}


def _error_body(type_: str, code: str, message: str, param: str | None) -> dict:
    from hardcount.errors import error_body

    return error_body(type_, code, message, param)


def _header_name(meta_key: str) -> str:
    """``HTTP_IDEMPOTENCY_KEY`` → ``Idempotency-Key`` (the name as a client would write it)."""
    name = meta_key.removeprefix("HTTP_")
    return "-".join(part.capitalize() for part in name.split("_"))


class RequestLimitsMiddleware:
    """Refuse requests beyond the product's limits with the API's JSON error, before anything reads them.

    414 ``uri_too_long`` (request target over ``HARDCOUNT_MAX_REQUEST_TARGET_BYTES``); 431
    ``request_header_fields_too_large`` (a header field over ``HARDCOUNT_MAX_HEADER_BYTES``,
    ``param`` naming it, or more than ``HARDCOUNT_MAX_HEADERS`` fields); 400 ``invalid_header``
    (a control character in a header value, ``param`` naming the header). Fields are counted
    as the server hands them over (repeated fields may arrive joined into one). A path holding a
    NUL (``%00``) names nothing stored (no column can hold one): 404 ``resource_missing``, before
    a view puts it in a query (the admin's object pages would fail there with a 500).
    """

    def __init__(self, get_response):
        self.get_response = get_response
        self.max_target = settings.HARDCOUNT_MAX_REQUEST_TARGET_BYTES
        self.max_header = settings.HARDCOUNT_MAX_HEADER_BYTES
        self.max_headers = settings.HARDCOUNT_MAX_HEADERS
        from hardcount.middleware import error_response

        self._respond = error_response

    def __call__(self, request):
        refusal = self.refusal(request.META, request.get_full_path)
        if refusal is not None:
            return self._respond(*refusal)
        if "\x00" in request.path_info:
            return self._respond(404, INVALID_REQUEST, "resource_missing", "No such resource.", None)
        return self.get_response(request)

    def refusal(self, meta, full_path) -> tuple[int, str, str, str, str | None] | None:
        """``(status, type, code, message, param)`` for a request over a limit, or None."""
        target = meta.get("RAW_URI") or full_path()
        if len(target) > self.max_target:
            return 414, INVALID_REQUEST, "uri_too_long", f"The request target exceeds {self.max_target} bytes.", None
        fields = [(k, v) for k, v in meta.items() if k.startswith("HTTP_") or k in ("CONTENT_TYPE", "CONTENT_LENGTH")]
        if len(fields) > self.max_headers:
            message = f"The request has more than {self.max_headers} header fields."
            return 431, INVALID_REQUEST, "request_header_fields_too_large", message, None
        for key, value in fields:
            name = _header_name(key)
            text = value if isinstance(value, str) else str(value)
            if len(name) + 2 + len(text) > self.max_header:
                message = f"The {name} header exceeds {self.max_header} bytes."
                return 431, INVALID_REQUEST, "request_header_fields_too_large", message, name
            if _FORBIDDEN_IN_VALUE.search(text):
                message = f"The {name} header holds a control character, which HTTP does not allow."
                return 400, INVALID_REQUEST, "invalid_header", message, name
        return None


def gunicorn_error(exc: BaseException) -> tuple[int, str, str, str, str | None]:
    """``(status, type, code, message, param)`` for an exception gunicorn raised while reading a request.

    Client errors keep gunicorn's status (400, 403, 414, 417, 431, 501); anything else is a
    500 ``api_error``. Messages are fixed: nothing of the request is echoed back.
    """
    if isinstance(exc, gerrors.InvalidResponseHeader | gerrors.InvalidResponseHeaderName):
        return 500, "api_error", "internal_error", "An internal error occurred.", None
    if isinstance(exc, gerrors.LimitRequestLine):
        return 414, INVALID_REQUEST, "uri_too_long", "The request line is too long.", None
    if isinstance(exc, gerrors.LimitRequestHeaders):
        message = "The request's header fields are too large or too many."
        return 431, INVALID_REQUEST, "request_header_fields_too_large", message, None
    if isinstance(exc, gerrors.InvalidHeader | gerrors.InvalidHeaderName | gerrors.ObsoleteFolding):
        hdr = getattr(exc, "hdr", None)
        param = None
        if isinstance(hdr, str) and _TOKEN.fullmatch(hdr):
            param = "-".join(part.capitalize() for part in hdr.split("-"))
        message = f"The {param} header is not valid HTTP." if param else "A header field is not valid HTTP."
        return 400, INVALID_REQUEST, "invalid_header", message, param
    if isinstance(exc, gerrors.InvalidRequestLine | gerrors.InvalidRequestMethod | gerrors.InvalidHTTPVersion):
        return 400, INVALID_REQUEST, "invalid_request_line", "The request line is not valid HTTP.", None
    if isinstance(exc, gerrors.UnsupportedTransferCoding):
        return 501, INVALID_REQUEST, "transfer_coding_unsupported", "The transfer coding is not supported.", None
    if isinstance(exc, gerrors.ExpectationFailed):
        return 417, INVALID_REQUEST, "expectation_failed", "The Expect header cannot be met.", None
    if isinstance(exc, gerrors.ForbiddenProxyRequest):
        return 403, INVALID_REQUEST, "forbidden", "Request forbidden.", None
    if isinstance(exc, gerrors.ConfigurationProblem):
        return 500, "api_error", "internal_error", "An internal error occurred.", None
    if isinstance(exc, gerrors.ParseException):
        return 400, INVALID_REQUEST, "bad_request", "The request is not valid HTTP.", None
    return 500, "api_error", "internal_error", "An internal error occurred.", None


def json_error_response(status: int, type_: str, code: str, message: str, param: str | None) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying the API's JSON error body."""
    body = json.dumps(_error_body(type_, code, message, param)).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class JsonErrorWorker(ThreadWorker):
    """gunicorn's ``gthread`` worker whose answers to unreadable requests are the API's JSON error.

    Logging is gunicorn's: a warning for a client's error, the traceback for anything else,
    and the access-log line.
    """

    def handle_error(self, req, client, addr, exc):
        """Answer the request gunicorn could not read (or the app crashed on) with a JSON error."""
        request_start = datetime.now()
        addr = addr or ("", -1)
        status, type_, code, message, param = gunicorn_error(exc)
        if status < 500:
            if req is None and getattr(exc, "req", None) is not None:
                req = exc.req
            self.log.warning("Invalid request from ip=%s: %s", addr[0], exc)
        elif hasattr(req, "uri"):
            self.log.exception("Error handling request %s", req.uri)
        else:
            self.log.exception("Error handling request (no URI read)")
        payload = json_error_response(status, type_, code, message, param)
        if req is not None and hasattr(req, "headers"):
            try:
                environ = default_environ(req, client, self.cfg)
                environ["REMOTE_ADDR"] = addr[0]
                environ["REMOTE_PORT"] = str(addr[1])
                resp = Response(req, client, self.cfg)
                resp.status = f"{status} {_REASONS.get(status, 'Error')}"
                resp.response_length = len(payload)
                self.log.access(resp, req, environ, datetime.now() - request_start)
            except Exception:
                self.log.debug("Failed to log the refused request.")
        try:
            util.write_nonblock(client, payload)
        except Exception:
            self.log.debug("Failed to send error message.")


__all__ = ["JsonErrorWorker", "RequestLimitsMiddleware", "gunicorn_error", "json_error_response"]
