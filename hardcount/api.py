"""The API's shared machinery: the base view, strict input fields, pagination, schema helpers.

Every endpoint is an :class:`ApiView` (see ``docs/api-conventions.md``):

- authentication by bearer key (:mod:`hardcount.auth`) sets ``request.tenant`` and
  ``request.livemode``; :meth:`ApiView.scoped` filters any queryset to them and
  :meth:`ApiView.get_scoped` fetches one object by id or raises 404;
- input is strict: :meth:`ApiView.read_body` and :meth:`ApiView.read_query` validate with a
  :class:`StrictSerializer` (unknown fields refused; ints must be JSON integers, strings
  strings, booleans booleans) and raise 400/415/422 through :mod:`hardcount.errors`;
- lists take their filter parameters through :meth:`ApiView.filter_by_query` and go through
  :meth:`ApiView.paginate` (``limit`` 1–100, default 10; ``starting_after``; newest first);
- after authentication the request's queries run as the database role
  :data:`hardcount.tenancy.TENANT_ROLE` under row-level security for the key's tenant and mode
  (docs/decisions/0130-row-level-security.md), reset when the request ends;
- every POST honours ``Idempotency-Key`` (:mod:`hardcount.idempotency`) with no code in
  the view;
- every request takes a token from its key's rate-limit bucket first (:mod:`hardcount.ratelimit`;
  429 with ``Retry-After`` when empty);
- the OpenAPI document gets the standard error responses and the ``Idempotency-Key``
  header added by :class:`HardcountAutoSchema`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.validators import RegexValidator
from django.db.models import Model, QuerySet
from django.http import HttpResponse
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ParseError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from hardcount import idempotency, ratelimit, tenancy
from hardcount.auth import ApiKeyAuthentication
from hardcount.errors import InvalidParameters, MalformedRequest, PayloadTooLarge, ResourceMissing, storable_text
from hardcount.ids import PREFIXES

DEFAULT_LIMIT = 10
MAX_LIMIT = 100

# Ids are "<prefix>_" + 26 lower-case Crockford base32 characters (hardcount.ids).
_ID_BODY = "[0-9abcdefghjkmnpqrstvwxyz]{26}"


def id_pattern(kind: str) -> str:
    """The anchored regex of ids of ``kind`` (a key of :data:`hardcount.ids.PREFIXES`)."""
    return f"^{PREFIXES[kind]}_{_ID_BODY}$"


def is_id(kind: str, value: Any) -> bool:
    """True when ``value`` is shaped like an id of ``kind`` (says nothing about existence)."""
    return isinstance(value, str) and re.fullmatch(id_pattern(kind), value) is not None


# ---------------------------------------------------------------------------------------
# Parsing and rendering


class JsonParser(JSONParser):
    """DRF's strict JSON parser (no NaN/Infinity) that also turns absurd nesting into a 400."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError as exc:
            raise ParseError("JSON parse error - the body is nested too deeply.") from exc


class JsonOnlyNegotiation(BaseContentNegotiation):
    """Always JSON: the API has one representation, so ``Accept`` never yields a 406."""

    def select_parser(self, request, parsers):
        for parser in parsers:
            if request.content_type.split(";")[0].strip().lower() == parser.media_type:
                return parser
        return None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


# ---------------------------------------------------------------------------------------
# Strict input fields


def _check_text(field: serializers.Field, value: str) -> None:
    if not storable_text(value):
        message = "Must not contain NUL characters." if "\x00" in value else "Must be valid Unicode text."
        raise serializers.ValidationError(message, code="invalid")


# Documented on every free-text field: PostgreSQL text and jsonb cannot hold NUL characters.
NO_NUL = RegexValidator(r"^[^\x00]*$", "Must not contain NUL characters.")


class StrictCharField(serializers.CharField):
    """A string and only a string (DRF's ``CharField`` would turn ``12`` into ``"12"``); never NUL characters."""

    def __init__(self, **kwargs):
        # Kept as sent: trimming would turn a documented-valid " " into a refused blank.
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)
        # Appended last: drf-spectacular documents the first pattern, so a field's own pattern wins.
        self.validators.append(NO_NUL)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        _check_text(self, data)
        return super().to_internal_value(data)


class StrictEmailField(serializers.EmailField):
    """An email address given as a string."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        _check_text(self, data)
        return super().to_internal_value(data)


class IdField(StrictCharField):
    """A reference to an object of ``kind`` (``"customer"``): a string shaped like its ids.

    A malformed id is a 422 (it breaks the documented pattern); a well-formed id that is
    not the caller's is resolved by the view or service to a 404.
    """

    def __init__(self, kind: str, **kwargs):
        self.kind = kind
        kwargs.setdefault("max_length", 64)
        validators = [RegexValidator(id_pattern(kind), f"Must be an id like {PREFIXES[kind]}_….")]
        super().__init__(validators=[*validators, *kwargs.pop("validators", [])], **kwargs)


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: strings, booleans and numbers written with a fraction or exponent are refused.

    Even ``1000.0`` is refused (code ``parameter_not_integer``), although JSON Schema calls it an
    integer: a float in an amount field is the mark of a client computing money in floating
    point (``19.99 * 100 == 1998.9999999999998``), which is better stopped than rounded.
    """

    default_error_messages = {
        "not_integer": "Must be a JSON integer (no quotes, booleans, fractions or exponents).",
    }

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("not_integer")
        return data


class StrictBooleanField(serializers.BooleanField):
    """A JSON ``true``/``false`` only (no ``"true"``, ``1`` or ``"yes"``)."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictChoiceField(serializers.ChoiceField):
    """One of ``choices``, given as a string."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid_choice", input=type(data).__name__)
        return super().to_internal_value(data)


class StrictDateTimeField(serializers.DateTimeField):
    """An ISO 8601 / RFC 3339 date-time string with an explicit offset (``Z`` or ``±hh:mm``), as UTC.

    Naive times are refused rather than guessed. How far from now a time may lie is a
    business rule, checked by the service that uses it.
    """

    default_error_messages = {
        "invalid": "Must be an ISO 8601 date-time with a time zone, e.g. 2027-01-31T09:30:00Z.",
    }

    def to_internal_value(self, value):
        if not isinstance(value, str) or not 10 <= len(value) <= 40:
            self.fail("invalid")
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            self.fail("invalid")
        if parsed.tzinfo is None or parsed.utcoffset() is None:
            self.fail("invalid")
        try:
            return parsed.astimezone(UTC)
        except OverflowError as exc:  # year 1 or 9999 shifted by its offset out of datetime's range
            raise InvalidParameters(
                f"{self.field_name}: the date is out of range.", code="date_out_of_range", param=self.field_name
            ) from exc


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": 500, "pattern": "^[^\\u0000]*$"},
        "propertyNames": {"minLength": 1, "maxLength": 40, "pattern": "^[^\\u0000]*$"},
        "maxProperties": 50,
        "description": "Up to 50 string keys (1–40 characters) with string values (up to 500 characters).",
    }
)
class MetadataField(serializers.Field):
    """Key-value metadata, Stripe's rules: up to 50 keys of 1–40 characters, string values up to 500."""

    MAX_KEYS = 50
    MAX_KEY_LENGTH = 40
    MAX_VALUE_LENGTH = 500

    default_error_messages = {
        "invalid": "Must be an object of string values.",
        "too_many": "At most 50 keys.",
        "key": "Keys must be 1 to 40 characters.",
        "value": "Values must be strings of at most 500 characters.",
    }

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        if len(data) > self.MAX_KEYS:
            self.fail("too_many")
        for key, value in data.items():
            if not 1 <= len(key) <= self.MAX_KEY_LENGTH:
                self.fail("key")
            if not isinstance(value, str) or len(value) > self.MAX_VALUE_LENGTH:
                self.fail("value")
            _check_text(self, key)
            _check_text(self, value)
        return dict(data)

    def to_representation(self, value):
        return value


class StrictSerializer(serializers.Serializer):
    """Input serializer that refuses unknown fields (422 ``parameter_unknown``) and non-object bodies."""

    def to_internal_value(self, data):
        if not isinstance(data, Mapping):
            raise serializers.ValidationError({"non_field_errors": ["The body must be a JSON object."]}, code="invalid")
        unknown = sorted(set(data) - {name for name, f in self.fields.items() if not f.read_only})
        if unknown:
            raise serializers.ValidationError(
                {unknown[0]: [serializers.ErrorDetail("Unknown parameter.", code="unknown_field")]}
            )
        return super().to_internal_value(data)


class StrictSerializerSchema(OpenApiSerializerExtension):
    """Documents every :class:`StrictSerializer` with ``additionalProperties: false`` (unknown fields are a 422)."""

    target_class = "hardcount.api.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_basic_serializer(self.target, direction)
        schema["additionalProperties"] = False
        return schema


class QueryIntegerField(serializers.IntegerField):
    """An integer query parameter: decimal digits only (no sign, no spaces, no exponent)."""

    def to_internal_value(self, data):
        if not isinstance(data, str) or not re.fullmatch(r"[0-9]{1,9}", data):
            self.fail("invalid")
        return int(data)


class QueryCharField(StrictCharField):
    """A string query parameter (max 255 characters unless told)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", 255)
        kwargs.setdefault("required", False)
        super().__init__(**kwargs)


STARTING_AFTER_HELP = "An object id from the previous page: the list continues after it (older objects)."


class QueryIdField(IdField):
    """An id in the query string (a filter or ``starting_after``): optional, shaped like ids of ``kind``."""

    def __init__(self, kind: str, **kwargs):
        kwargs.setdefault("required", False)
        super().__init__(kind, **kwargs)


class ListQuery(StrictSerializer):
    """Query parameters of every list: ``limit`` (1–100, default 10) and ``starting_after`` (an id of the list)."""

    limit = QueryIntegerField(required=False, min_value=1, max_value=MAX_LIMIT, default=DEFAULT_LIMIT)
    # Subclasses redeclare this as QueryIdField("<kind>", help_text=STARTING_AFTER_HELP) to document the id shape.
    starting_after = QueryCharField(help_text=STARTING_AFTER_HELP)


# ---------------------------------------------------------------------------------------
# Schema helpers


def object_field(name: str) -> serializers.Field:
    """The ``object`` field of an output schema: the constant string ``name`` (documented as a one-value enum)."""
    field_class = extend_schema_field({"type": "string", "enum": [name]})(
        type(f"{name.title().replace('_', '')}ObjectField", (serializers.CharField,), {})
    )
    return field_class()


class ErrorDetailSerializer(serializers.Serializer):
    type = serializers.ChoiceField(
        choices=["invalid_request_error", "authentication_error", "rate_limit_error", "api_error"]
    )
    code = serializers.CharField(help_text="Machine-readable code, e.g. `parameter_invalid`, `resource_missing`.")
    message = serializers.CharField(help_text="Human-readable explanation.")
    param = serializers.CharField(allow_null=True, help_text="The parameter or header at fault, if one is.")


class ErrorSerializer(serializers.Serializer):
    """The error body of every 4xx/5xx response."""

    error = ErrorDetailSerializer()


ERROR = ErrorSerializer

_LIST_CACHE: dict[str, type[serializers.Serializer]] = {}


def list_of(item: type[serializers.Serializer], name: str) -> type[serializers.Serializer]:
    """A schema-only serializer for ``{"object": "list", "data": [item…], "has_more": bool}``, named ``name``."""
    if name not in _LIST_CACHE:
        _LIST_CACHE[name] = type(
            name,
            (serializers.Serializer,),
            {
                "object": object_field("list"),
                "data": item(many=True),
                "has_more": serializers.BooleanField(),
                "__doc__": f"A page of objects, newest first. `has_more` is true when `starting_after` the last "
                f"one gives more. ({name})",
            },
        )
    return _LIST_CACHE[name]


def id_path_parameter(kind: str, name: str = "id") -> OpenApiParameter:
    """The path parameter ``{id}`` of an object of ``kind``, documented with the id pattern."""
    return OpenApiParameter(
        name, str, OpenApiParameter.PATH, pattern=id_pattern(kind), description=f"The {kind.replace('_', ' ')}'s id."
    )


IDEMPOTENCY_PARAMETER = OpenApiParameter(
    name=idempotency.HEADER,
    type=str,
    location=OpenApiParameter.HEADER,
    required=False,
    pattern=r"^[\x20-\x7e]{1,255}$",
    description="Any unique string up to 255 printable ASCII characters. The same key with the same request "
    "replays the first response (header `Idempotent-Replayed: true`); with a different request it is a 422; "
    "while the first request is still executing it is a 409. Keys are kept 24 hours.",
)


class HardcountAutoSchema(AutoSchema):
    """drf-spectacular schema that documents what every endpoint can answer, besides its own responses.

    Adds the view's ``<method>_query`` serializer as query parameters; 401 and 429 everywhere; for
    POST the ``Idempotency-Key`` header and 400, 409, 413, 415, 422; 404 where the path has
    an id or the list takes ``starting_after``; 422 where there are query parameters.
    """

    def get_description(self):
        # Only docstrings written on the endpoint itself, never the base view's.
        method = getattr(self.view, self.method.lower(), None)
        return (method.__doc__ if method is not None else None) or self.view.__class__.__dict__.get("__doc__") or ""

    def _query_serializer(self):
        return getattr(self.view, f"{self.method.lower()}_query", None)

    def get_override_parameters(self):
        params = list(super().get_override_parameters())
        query = self._query_serializer()
        if query is not None:
            params.append(query)
        if self.method == "POST":
            params.append(IDEMPOTENCY_PARAMETER)
        return params

    def _error_codes(self) -> set[int]:
        codes = {401, 429}
        query = self._query_serializer()
        if self.method == "POST":
            codes |= {400, 409, 413, 415, 422}
        if "{" in self.path:
            codes.add(404)
        if query is not None and query().fields:
            codes.add(422)
            if "starting_after" in query().fields:
                codes.add(404)
        return codes

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        for code in sorted(self._error_codes()):
            responses.setdefault(str(code), self._get_response_for_code(ERROR, str(code), direction=direction))
        return dict(sorted(responses.items()))


# ---------------------------------------------------------------------------------------
# The base view


class _Replayed(Exception):
    """Raised from :meth:`ApiView.initial` to answer with a stored idempotent response."""

    def __init__(self, response: HttpResponse):
        super().__init__("idempotent replay")
        self.response = response


class ApiView(APIView):
    """Base of every /v1 endpoint: auth by key, tenant+mode scoping, strict JSON, idempotent POSTs.

    Subclasses implement ``get``/``post``; declare ``<method>_query`` (a :class:`ListQuery`
    or :class:`StrictSerializer` subclass) to have query parameters validated and
    documented. Inside a handler use ``self.tenant``, ``self.livemode``, :meth:`scoped`,
    :meth:`get_scoped`, :meth:`read_body`, :meth:`read_query`, :meth:`filter_by_query` and
    :meth:`paginate`. A view whose POST answers with a secret shown once names that field in
    ``response_secrets`` (docs/decisions/0125-secrets-in-idempotency-records.md).
    """

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [IsAuthenticated]
    parser_classes = [JsonParser]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = JsonOnlyNegotiation
    schema = HardcountAutoSchema()

    # Statuses whose response is stored under an Idempotency-Key: the request executed.
    # Anything else (validation errors, 404s, 5xx) releases the key, as Stripe does.
    _IDEMPOTENT_STORED = frozenset({402, 409})
    # Top-level fields of a POST response that carry a secret shown once, each with where an idempotent
    # replay reads it again (hardcount.idempotency.SecretSource); records store a marker instead.
    response_secrets: Mapping[str, idempotency.SecretSource] = {}

    @property
    def tenant(self):
        """The :class:`~hardcount.models.Tenant` of the request's API key."""
        return self.request.tenant

    @property
    def livemode(self) -> bool:
        """True for a live key, False for a test key."""
        return self.request.livemode

    # -- scoping ---------------------------------------------------------------------

    def scoped(self, queryset: QuerySet | type[Model]) -> QuerySet:
        """``queryset`` restricted to the caller's tenant and mode. Every query of a view goes through this."""
        if isinstance(queryset, type):
            queryset = queryset.objects.all()
        return queryset.filter(tenant_id=self.tenant.pk, livemode=self.livemode)

    def get_scoped(self, queryset: QuerySet | type[Model], object_id: Any, *, kind: str, param: str | None = None):
        """The object ``object_id`` of the caller's tenant and mode, or 404 ``resource_missing``.

        ``kind`` is the id kind (``"customer"``) used to check the id's shape and name the
        object in the message; ``param`` names the body or query field the id came from.
        Another tenant's or mode's id gives exactly the answer of an id that never existed.
        """
        noun = kind.replace("_", " ")
        if not is_id(kind, object_id):
            raise ResourceMissing(f"No such {noun}: '{object_id}'.", param=param)
        obj = self.scoped(queryset).filter(pk=object_id).first()
        if obj is None:
            raise ResourceMissing(f"No such {noun}: '{object_id}'.", param=param)
        return obj

    # -- input -----------------------------------------------------------------------

    def read_body(self, serializer_class: type[serializers.Serializer], **context) -> dict[str, Any]:
        """Parse the JSON body and validate it with ``serializer_class``; returns ``validated_data``.

        An empty body is ``{}``. Raises 400 (unreadable JSON, not an object), 415 (not
        ``application/json``) or 422 (invalid or unknown fields).
        """
        data = self.request.data
        if not isinstance(data, Mapping):
            raise MalformedRequest("The request body must be a JSON object.", code="body_not_object")
        serializer = serializer_class(data=data, context={"view": self, "request": self.request, **context})
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    def read_query(self, serializer_class: type[serializers.Serializer] | None = None) -> dict[str, Any]:
        """Validate the query string with ``serializer_class`` (default ``<method>_query``); 422 on bad input.

        Unknown query parameters are refused, like unknown body fields.
        """
        # HEAD is GET without a body (RFC 9110 §9.3.2): it takes GET's query parameters.
        method = "get" if self.request.method == "HEAD" else self.request.method.lower()
        serializer_class = serializer_class or getattr(self, f"{method}_query")
        for key, values in self.request.query_params.lists():
            if len(values) > 1:
                raise InvalidParameters(f"{key}: given more than once.", code="parameter_repeated", param=key)
        raw = {key: self.request.query_params.get(key) for key in self.request.query_params}
        serializer = serializer_class(data=raw)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    # -- lists -----------------------------------------------------------------------

    def filter_by_query(self, queryset: QuerySet, query: Mapping[str, Any], **lookups: str) -> QuerySet:
        """``queryset`` narrowed by each filter parameter the caller gave, in ``lookups``' order.

        ``lookups`` maps a query parameter to the field lookup it filters on:
        ``customer="customer_id"`` adds ``.filter(customer_id=query["customer"])``. A parameter
        absent or empty in the validated ``query`` adds nothing.
        """
        for param, lookup in lookups.items():
            if query.get(param):
                queryset = queryset.filter(**{lookup: query[param]})
        return queryset

    def paginate(
        self,
        queryset: QuerySet,
        render: Callable[[Any], dict[str, Any]],
        query: Mapping[str, Any],
        *,
        kind: str,
        cursor_scope: QuerySet | None = None,
    ) -> Response:
        """Render one page of ``queryset`` (already scoped and filtered) newest first.

        ``query`` is the validated :class:`ListQuery`. ``starting_after`` must be the id of
        an object of ``cursor_scope`` (default: the same model, scoped to the caller), else
        404 with ``param`` ``starting_after``. A ``cursor_scope`` given is used as it is: it
        must already hold only what the caller may see (a list of objects without tenant
        columns, or one that includes shared rows, scopes itself). Ids sort by creation
        time (ULID layout), so ``id < cursor`` in descending id order is a stable keyset page.
        """
        limit = query.get("limit") or DEFAULT_LIMIT
        cursor = query.get("starting_after")
        if cursor:
            if cursor_scope is None:
                self.get_scoped(queryset.model, cursor, kind=kind, param="starting_after")
            elif not is_id(kind, cursor) or not cursor_scope.filter(pk=cursor).exists():
                raise ResourceMissing(f"No such {kind.replace('_', ' ')}: '{cursor}'.", param="starting_after")
            queryset = queryset.filter(pk__lt=cursor)
        rows = list(queryset.order_by("-pk")[: limit + 1])
        return Response(
            {"object": "list", "data": [render(row) for row in rows[:limit]], "has_more": len(rows) > limit}
        )

    # -- tenancy and idempotency -----------------------------------------------------

    def dispatch(self, request, *args, **kwargs):
        try:
            return super().dispatch(request, *args, **kwargs)
        finally:
            # Also after an unhandled exception: a connection kept across requests goes back clean.
            if getattr(self, "_tenancy_entered", False):
                self._tenancy_entered = False
                tenancy.leave()

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        self._idempotency_claim = None
        # The request's validated Idempotency-Key (None without one): a service may bind what it creates to it.
        self.idempotency_key: str | None = None
        # After authentication, before anything is written: a refused request claims no Idempotency-Key.
        # The buckets are the service's rows, not the tenant's: taken before the switch below.
        ratelimit.check(request)
        # Authenticated: from here on the database enforces the key's tenant and mode too (row-level security).
        tenancy.enter(self.tenant.pk, self.livemode)
        self._tenancy_entered = True
        if request.method != "POST":
            return
        key = idempotency.validate_key(request.headers.get(idempotency.HEADER))
        if key is None:
            return
        self.idempotency_key = key
        try:
            body = request._request.body
        except RequestDataTooBig as exc:
            raise PayloadTooLarge(f"Request body exceeds {settings.HARDCOUNT_MAX_BODY_BYTES} bytes.") from exc
        result = idempotency.begin(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            key=key,
            request_fingerprint=idempotency.fingerprint(request.method, request.path, body),
            secrets=self.response_secrets,
        )
        if isinstance(result, idempotency.Replay):
            response = HttpResponse(result.content, status=result.status, content_type="application/json")
            response["Idempotent-Replayed"] = "true"
            raise _Replayed(response)
        self._idempotency_claim = result

    def handle_exception(self, exc):
        if isinstance(exc, _Replayed):
            return exc.response
        try:
            response = super().handle_exception(exc)
        except Exception:
            claim = getattr(self, "_idempotency_claim", None)
            if claim is not None:
                self._idempotency_claim = None
                idempotency.abandon(claim)
            raise
        if isinstance(exc, ratelimit.RateLimited):
            response["Retry-After"] = str(exc.retry_after_s)
        return response

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        claim = getattr(self, "_idempotency_claim", None)
        if claim is not None:
            self._idempotency_claim = None
            status_code = response.status_code
            if status_code < 400 or status_code in self._IDEMPOTENT_STORED:
                response.render()
                idempotency.complete(claim, status=status_code, content=response.content, secrets=self.response_secrets)
            else:
                idempotency.abandon(claim)
        return response


__all__ = [
    "DEFAULT_LIMIT",
    "ERROR",
    "IDEMPOTENCY_PARAMETER",
    "MAX_LIMIT",
    "NO_NUL",
    "STARTING_AFTER_HELP",
    "ApiView",
    "ErrorSerializer",
    "HardcountAutoSchema",
    "IdField",
    "JsonOnlyNegotiation",
    "JsonParser",
    "ListQuery",
    "MetadataField",
    "QueryCharField",
    "QueryIdField",
    "QueryIntegerField",
    "StrictBooleanField",
    "StrictCharField",
    "StrictChoiceField",
    "StrictDateTimeField",
    "StrictEmailField",
    "StrictIntegerField",
    "StrictSerializer",
    "id_path_parameter",
    "id_pattern",
    "is_id",
    "list_of",
    "object_field",
]
