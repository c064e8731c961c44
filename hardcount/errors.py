"""The API's error body and the status each class of error gets (docs/reference/api.md, decision 0001).

Every error the API returns has the body ``{"error": {"type", "code", "message", "param"}}``:

====== ========================= ==========================================================
status type                      when
====== ========================= ==========================================================
400    invalid_request_error     the body cannot be read as a JSON object (syntax, encoding,
                                 nesting, a top-level array); a bad ``Content-Length``
401    authentication_error      no key, an unknown key, a revoked key
404    invalid_request_error     no such object *for this key*: unknown ids, another
                                 tenant's or mode's ids (never revealed), unknown /v1 paths
405    invalid_request_error     a method the path does not support
409    invalid_request_error     the request conflicts with the object's state (cancelling a
                                 canceled subscription) or an ``Idempotency-Key`` in flight
413    invalid_request_error     a body over ``HARDCOUNT_MAX_BODY_BYTES`` (1 MiB)
415    invalid_request_error     a body that is not ``application/json``
422    invalid_request_error     a readable JSON object or query whose values are invalid:
                                 wrong types, unknown fields, out-of-range amounts, unknown
                                 currencies, a reused ``Idempotency-Key`` with another body
500    api_error                 a bug; the body never carries internals
====== ========================= ==========================================================

Views raise :class:`ApiError` subclasses (or DRF's own exceptions, which are mapped
here); :func:`exception_handler` renders them, so a view never builds an error body.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
API_ERROR = "api_error"


def clean_text(value: Any) -> str:
    """``value`` as text safe to render as JSON and to store in ``jsonb``.

    Error messages may quote the client's input: lone surrogates (invalid UTF-8) and NUL
    characters (refused by PostgreSQL's ``jsonb``) are escaped rather than echoed.
    """
    text = str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")


def storable_text(value: str) -> bool:
    """False for text PostgreSQL cannot store in ``text`` or ``jsonb``: a NUL character, or a lone surrogate
    (which has no UTF-8 form); validators refuse such input with a 4xx rather than let the insert fail."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def error_body(type_: str, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The docs/reference/api.md error body as a dict."""
    return {
        "error": {
            "type": type_,
            "code": code,
            "message": clean_text(message),
            "param": None if param is None else clean_text(param),
        }
    }


class ApiError(exceptions.APIException):
    """Base of the API's own errors: an HTTP status plus the API's error fields (docs/reference/api.md).

    Raise a subclass from a view or a service-calling helper; :func:`exception_handler`
    renders it. ``param`` names the offending field (dotted for nested fields) or header.
    """

    status_code = status.HTTP_400_BAD_REQUEST
    error_type = INVALID_REQUEST
    default_code = "invalid_request"
    default_detail = "The request is invalid."

    def __init__(self, message: str | None = None, *, code: str | None = None, param: str | None = None):
        super().__init__(detail=message or self.default_detail, code=code or self.default_code)
        self.message = message or self.default_detail
        self.code = code or self.default_code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.error_type, self.code, self.message, self.param)


class MalformedRequest(ApiError):
    """400: the body is not a readable JSON object."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "malformed_json"
    default_detail = "The request body is not valid JSON."


class Unauthenticated(ApiError):
    """401: missing, unknown or revoked API key."""

    status_code = status.HTTP_401_UNAUTHORIZED
    error_type = AUTHENTICATION
    default_code = "invalid_api_key"
    default_detail = "Provide a valid API key: Authorization: Bearer hc_test_… or hc_live_…"


class ResourceMissing(ApiError):
    """404: the object does not exist for the caller's tenant and mode (never says whether it exists elsewhere)."""

    status_code = status.HTTP_404_NOT_FOUND
    default_code = "resource_missing"
    default_detail = "No such object."


class Conflict(ApiError):
    """409: the request conflicts with the current state of the object."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "state_conflict"
    default_detail = "The request conflicts with the current state of the object."


class PayloadTooLarge(ApiError):
    """413: the body is over the configured limit."""

    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "body_too_large"
    default_detail = "The request body is too large."


class InvalidParameters(ApiError):
    """422: a readable request whose values are invalid (the first offending ``param`` is named)."""

    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "parameter_invalid"
    default_detail = "A parameter is invalid."


class ServiceError(Exception):
    """Base of errors raised by business operations (``*/services``), free of any HTTP framework.

    Each subclass carries the status the API answers with; :func:`exception_handler`
    renders them like :class:`ApiError`. ``param`` names the input at fault, if any.
    Services of every app raise these (or subclasses) so views need no mapping code.
    """

    status_code = 422
    default_code = "parameter_invalid"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(INVALID_REQUEST, self.code, self.message, self.param)


_BUSINESS_RULE_CODES: set[str] = set()


def business_rule_codes(*codes: str) -> frozenset[str]:
    """Register error codes of 422s for rules the OpenAPI document can state only in prose.

    A business rule is cross-field, relative to "now" or dependent on another object's state
    (a currency mismatch, an anchor too far ahead); the request is schema-valid yet refused.
    Services declare theirs at import time (``MY_CODES = business_rule_codes("a", "b")``);
    the fuzz test accepts a 422 to schema-valid data only with a registered code (decision 0003).
    """
    _BUSINESS_RULE_CODES.update(codes)
    return frozenset(codes)


def registered_business_rule_codes() -> frozenset[str]:
    """Every code registered with :func:`business_rule_codes` so far."""
    return frozenset(_BUSINESS_RULE_CODES)


class InvalidRequestError(ServiceError):
    """422: the input breaks a business rule (currency mismatch, anchor out of range, ...)."""

    status_code = 422
    default_code = "parameter_invalid"


class NotFoundError(ServiceError):
    """404: a referenced object does not exist in the caller's tenant and mode."""

    status_code = 404
    default_code = "resource_missing"


class StateConflictError(ServiceError):
    """409: the operation is not allowed in the object's current state (e.g. cancelling a canceled subscription)."""

    status_code = 409
    default_code = "state_conflict"


def first_validation_error(detail: Any, path: str = "") -> tuple[str | None, str, str]:
    """Walk DRF's nested ``ValidationError.detail`` to its first leaf: ``(param, code, message)``."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            if key == "non_field_errors":
                return first_validation_error(value, path)
            return first_validation_error(value, f"{path}.{key}" if path else str(key))
    if isinstance(detail, list):
        if not detail:
            return path or None, "parameter_invalid", "A parameter is invalid."
        first = detail[0]
        if isinstance(first, (dict, list)):
            return first_validation_error(first, f"{path}.0" if path and isinstance(first, dict) else path)
        return first_validation_error(first, path)
    code = getattr(detail, "code", None) or "invalid"
    message = str(detail)
    param = path or None
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return param, _validation_code(code), message


# DRF's field error codes, mapped to the API's codes (Stripe-like names where one exists).
_VALIDATION_CODES = {
    "required": "parameter_missing",
    "null": "parameter_missing",
    "blank": "parameter_missing",
    "unknown_field": "parameter_unknown",
    "invalid": "parameter_invalid",
    "not_integer": "parameter_not_integer",
    "invalid_choice": "parameter_invalid",
    "max_value": "parameter_out_of_range",
    "min_value": "parameter_out_of_range",
    "max_length": "parameter_too_long",
    "min_length": "parameter_invalid",
}


def _validation_code(code: str) -> str:
    return _VALIDATION_CODES.get(code, code if code.startswith("parameter_") else "parameter_invalid")


def _render(status_code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    response = Response(body, status=status_code)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler: every exception a view raises becomes the API's error body (docs/reference/api.md).

    Returns None (so Django's 500 handler answers) only for unexpected exceptions.
    """
    if isinstance(exc, ServiceError):
        return _render(exc.status_code, exc.body())
    if isinstance(exc, ApiError):
        headers = {"WWW-Authenticate": 'Bearer realm="hardcount"'} if exc.status_code == 401 else None
        return _render(exc.status_code, exc.body(), headers)
    if isinstance(exc, exceptions.ValidationError):
        param, code, message = first_validation_error(exc.detail)
        return _render(422, error_body(INVALID_REQUEST, code, message, param))
    if isinstance(exc, exceptions.ParseError):
        return _render(400, error_body(INVALID_REQUEST, "malformed_json", str(exc.detail)))
    if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
        body = error_body(AUTHENTICATION, "invalid_api_key", str(exc.detail))
        return _render(401, body, {"WWW-Authenticate": 'Bearer realm="hardcount"'})
    if isinstance(exc, (exceptions.NotFound, Http404)):
        return _render(404, error_body(INVALID_REQUEST, "resource_missing", "No such object."))
    if isinstance(exc, (exceptions.PermissionDenied, DjangoPermissionDenied)):
        # No permission model beyond "a valid key": treat as not found, revealing nothing.
        return _render(404, error_body(INVALID_REQUEST, "resource_missing", "No such object."))
    if isinstance(exc, exceptions.MethodNotAllowed):
        return _render(405, error_body(INVALID_REQUEST, "method_not_allowed", str(exc.detail)))
    if isinstance(exc, exceptions.UnsupportedMediaType):
        message = "Send the body as JSON with Content-Type: application/json."
        return _render(415, error_body(INVALID_REQUEST, "unsupported_media_type", message))
    if isinstance(exc, exceptions.APIException):
        # Any other DRF exception (throttling, not acceptable): keep its status, the API's error body.
        return _render(exc.status_code, error_body(INVALID_REQUEST, str(exc.default_code), str(exc.detail)))
    return None


# Paths machines call (the API, and Stripe's webhooks): their errors are JSON.
API_PATH_PREFIXES = ("/v1/", "/stripe/")


def _is_api_path(request: HttpRequest) -> bool:
    return request.path.startswith(API_PATH_PREFIXES) or request.path == "/v1"


def handler404(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django-level 404: JSON under /v1 and /stripe, Django's page elsewhere (the admin)."""
    if _is_api_path(request):
        body = error_body(INVALID_REQUEST, "resource_missing", f"Unrecognized request URL ({request.method}).")
        return JsonResponse(body, status=404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def handler400(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django-level 400 (e.g. an unreadable request, a body over the limit): JSON under /v1 and /stripe."""
    if _is_api_path(request):
        if isinstance(exception, RequestDataTooBig):
            body = error_body(INVALID_REQUEST, "body_too_large", "The request body is too large.")
            return JsonResponse(body, status=413)
        return JsonResponse(error_body(INVALID_REQUEST, "bad_request", "The request could not be read."), status=400)
    from django.views.defaults import bad_request

    return bad_request(request, exception)


def handler500(request: HttpRequest) -> HttpResponse:
    """Django-level 500: JSON under /v1 with no internals; the traceback goes to the log only."""
    if _is_api_path(request):
        body = error_body(API_ERROR, "internal_error", "An internal error occurred; it has been logged.")
        return JsonResponse(body, status=500)
    from django.views.defaults import server_error

    return server_error(request)
