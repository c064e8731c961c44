"""The outbox API's input serializers (strict) and output schemas.

Output serializers document the JSON of :mod:`outbox.representations` (the single source
of the shape); they are never used to render.
"""

from __future__ import annotations

from rest_framework import serializers

from hardcount.api import (
    ListQuery,
    QueryCharField,
    StrictBooleanField,
    StrictCharField,
    StrictChoiceField,
    StrictSerializer,
    object_field,
)
from outbox.services import MAX_ENABLED_EVENTS, MAX_URL_LENGTH, event_type_patterns

DELIVERY_STATUSES = ["pending", "retrying", "succeeded", "failed"]
ATTEMPT_OUTCOMES = ["succeeded", "failed", "retryable", "lease_lost", "canceled"]

_URL_HELP = (
    "Absolute http(s) URL that receives the events; https in live mode. An invalid URL is a 422 "
    "`url_invalid`, an http URL in live mode a 422 `url_insecure`, a host that is this machine or a "
    "non-public IP address a 422 `url_not_public`. Names are resolved when each delivery is sent: one "
    "resolving to a non-public address gets no request (attempt error `connection_refused_by_policy`)."
)
_EVENTS_HELP = (
    "Event types to receive: `*` for all, a prefix wildcard such as `invoice.*`, or exact types. "
    "Unknown names are refused (422)."
)


def _enabled_events(required: bool) -> serializers.ListField:
    return serializers.ListField(
        child=StrictChoiceField(choices=event_type_patterns()),
        allow_empty=False,
        min_length=1,
        max_length=MAX_ENABLED_EVENTS,
        required=required,
        help_text=_EVENTS_HELP,
    )


# ---------------------------------------------------------------------------------------
# Input


class WebhookEndpointCreateBody(StrictSerializer):
    url = StrictCharField(max_length=MAX_URL_LENGTH, help_text=_URL_HELP)
    enabled_events = _enabled_events(required=True)
    description = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class WebhookEndpointUpdateBody(StrictSerializer):
    url = StrictCharField(max_length=MAX_URL_LENGTH, required=False, help_text=_URL_HELP)
    enabled_events = _enabled_events(required=False)
    description = StrictCharField(max_length=500, required=False, allow_blank=True)
    enabled = StrictBooleanField(
        required=False, help_text="false stops deliveries; true re-enables (closing the circuit breaker)."
    )


class ReplayBody(StrictSerializer):
    pass


class WebhookEndpointListQuery(ListQuery):
    pass


class EventListQuery(ListQuery):
    type = QueryCharField(max_length=100, help_text="Only events of this exact type.")


class DeliveryListQuery(ListQuery):
    event = QueryCharField(help_text="Only deliveries of this event (`evt_…`).")
    webhook_endpoint = QueryCharField(help_text="Only deliveries to this endpoint (`we_…`).")
    status = StrictChoiceField(choices=DELIVERY_STATUSES, required=False)


# ---------------------------------------------------------------------------------------
# Output (documentation of outbox.representations)


class WebhookEndpoint(serializers.Serializer):
    """A URL that receives the tenant's events, signed with the endpoint's secret."""

    id = serializers.CharField()
    object = object_field("webhook_endpoint")
    livemode = serializers.BooleanField()
    url = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    enabled_events = serializers.ListField(child=serializers.CharField())
    status = serializers.ChoiceField(choices=["enabled", "disabled"])
    disabled_reason = serializers.CharField(allow_null=True)
    consecutive_failures = serializers.IntegerField(help_text="Failed attempts in a row (the circuit breaker's count).")
    circuit_open_until = serializers.DateTimeField(
        allow_null=True, help_text="While set, deliveries wait until then without spending attempts."
    )
    created = serializers.DateTimeField()


class WebhookEndpointWithSecret(WebhookEndpoint):
    """The creation response: the endpoint plus its signing secret, shown this once."""

    secret = serializers.CharField(help_text="`whsec_…`: verify `Hardcount-Signature` with it. Never shown again.")


class DeletedWebhookEndpoint(serializers.Serializer):
    id = serializers.CharField()
    object = object_field("webhook_endpoint")
    deleted = serializers.BooleanField()


class Event(serializers.Serializer):
    """Something that happened; also the exact body of a webhook delivery."""

    id = serializers.CharField(help_text="Stable across retries and replays: de-duplicate on it.")
    object = object_field("event")
    type = serializers.CharField()
    created = serializers.DateTimeField()
    livemode = serializers.BooleanField()
    sequence = serializers.IntegerField(help_text="Increases with every event; orders one tenant's events.")
    data = serializers.DictField(help_text="The object as the API shows it, at the time of the event.")


class DeliveryAttempt(serializers.Serializer):
    id = serializers.CharField()
    object = object_field("webhook_delivery_attempt")
    number = serializers.IntegerField(min_value=1, max_value=8)
    outcome = serializers.ChoiceField(choices=ATTEMPT_OUTCOMES)
    status_code = serializers.IntegerField(allow_null=True)
    latency_ms = serializers.IntegerField(allow_null=True)
    error = serializers.CharField(
        allow_null=True,
        help_text="Why the attempt did not succeed: `HTTP <status>`, `timed out after <n> s`, `connection_failed` "
        "(no answer: name, connection or TLS failure), `connection_refused_by_policy` (the target is not public).",
    )
    response_excerpt = serializers.CharField(
        allow_null=True, help_text="The first 1 KiB of the response body; none when no answer came."
    )
    created = serializers.DateTimeField()


class WebhookDelivery(serializers.Serializer):
    """One event sent to one endpoint, with the evidence of each attempt (at most 8)."""

    id = serializers.CharField()
    object = object_field("webhook_delivery")
    livemode = serializers.BooleanField()
    event = serializers.CharField()
    event_type = serializers.CharField()
    webhook_endpoint = serializers.CharField()
    status = serializers.ChoiceField(choices=DELIVERY_STATUSES)
    attempt_count = serializers.IntegerField()
    next_attempt_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField(allow_null=True)
    replay_of = serializers.CharField(allow_null=True)
    created = serializers.DateTimeField()
    completed_at = serializers.DateTimeField(allow_null=True)
    attempts = DeliveryAttempt(many=True)
