"""The OpenAPI document: served without a key, valid, and in step with billing.representations."""

import pytest
from drf_spectacular.validation import validate_schema

from billing import representations
from billing import serializers as out
from tests.api.conftest import Api, create_catalog, create_invoice


@pytest.fixture
def document(db):
    response = Api(None).client.get("/v1/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_document_is_valid_openapi_31(document):
    assert document["openapi"].startswith("3.1")
    validate_schema(document)


def test_every_operation_documents_401_and_every_post_its_errors_and_idempotency(document):
    for path, item in document["paths"].items():
        if not path.startswith("/v1/"):
            continue  # Stripe's webhook endpoint: no API key, no Idempotency-Key (the next test)
        for method, operation in item.items():
            responses = operation["responses"]
            assert "401" in responses, (method, path)
            if method == "post":
                assert {"400", "409", "413", "415", "422"} <= set(responses), (method, path)
                names = {p["name"] for p in operation.get("parameters", [])}
                assert "Idempotency-Key" in names, (method, path)
            if "{" in path:
                assert "404" in responses, (method, path)


def test_the_stripe_webhook_endpoint_documents_its_signature_and_errors(document):
    (path,) = [p for p in document["paths"] if not p.startswith("/v1/")]
    assert path == "/stripe/webhooks/{slug}"
    operation = document["paths"][path]["post"]
    assert {"200", "400", "404", "411", "413", "503"} <= set(operation["responses"])
    assert "401" not in operation["responses"]
    assert "Stripe-Signature" in {p["name"] for p in operation["parameters"]}


def test_request_bodies_refuse_unknown_fields_in_the_document(document):
    for name in ("CustomerCreateRequest", "PriceCreateRequest", "SubscriptionCreateRequest"):
        assert document["components"]["schemas"][name]["additionalProperties"] is False


def test_output_schemas_match_the_representations(api):
    catalog = create_catalog(api)
    invoice = create_invoice(catalog["subscription"]["id"])
    from billing.models import Customer, Price, Subscription
    from billing.services import usage

    tenant = Customer.objects.get(pk=catalog["customer"]["id"]).tenant_id
    meter = usage.create_meter(tenant_id=tenant, livemode=False, display_name="m", event_name="m", formula="sum")
    event = {
        "event_name": "m",
        "identifier": "i",
        "payload": "{}",
        "timestamp": invoice.created_at,
        "created_at": invoice.created_at,
    }
    pairs = [
        (out.Customer, representations.customer_data(Customer.objects.get(pk=catalog["customer"]["id"]))),
        (out.Price, representations.price_data(Price.objects.get(pk=catalog["price"]["id"]))),
        (
            out.Subscription,
            representations.subscription_data(Subscription.objects.get(pk=catalog["subscription"]["id"])),
        ),
        (out.Invoice, representations.invoice_data(invoice)),
        (out.LineItem, representations.invoice_data(invoice)["lines"][0]),
        (out.Meter, representations.meter_data(meter)),
        (out.MeterEvent, usage.meter_event_data(event, False)),
    ]
    for serializer, data in pairs:
        assert set(serializer().fields) == set(data), serializer.__name__
