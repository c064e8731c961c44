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


def test_both_ways_of_sending_the_key_are_documented_on_every_v1_operation(document):
    schemes = document["components"]["securitySchemes"]
    assert {name: (s["type"], s["scheme"]) for name, s in schemes.items()} == {
        "ApiKey": ("http", "bearer"),
        "ApiKeyBasic": ("http", "basic"),
    }
    for path, item in document["paths"].items():
        if path.startswith("/v1/") and path != "/v1/openapi.json":
            for method, operation in item.items():
                assert {"ApiKey": []} in operation["security"], (method, path)
                assert {"ApiKeyBasic": []} in operation["security"], (method, path)


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


CORRECTIONS_OPERATIONS = {
    "coupons_create": ("post", "/v1/coupons"),
    "coupons_list": ("get", "/v1/coupons"),
    "coupons_retrieve": ("get", "/v1/coupons/{id}"),
    "coupons_delete": ("delete", "/v1/coupons/{id}"),
    "customers_delete_discount": ("delete", "/v1/customers/{id}/discount"),
    "subscriptions_delete_discount": ("delete", "/v1/subscriptions/{id}/discount"),
    "credit_notes_create": ("post", "/v1/credit_notes"),
    "credit_notes_list": ("get", "/v1/credit_notes"),
    "credit_notes_preview": ("get", "/v1/credit_notes/preview"),
    "credit_notes_retrieve": ("get", "/v1/credit_notes/{id}"),
    "credit_notes_void": ("post", "/v1/credit_notes/{id}/void"),
    "credit_notes_pdf": ("get", "/v1/credit_notes/{id}/pdf"),
    "invoices_pdf": ("get", "/v1/invoices/{id}/pdf"),
    "invoices_rotate_hosted_url": ("post", "/v1/invoices/{id}/rotate_hosted_url"),
}


def test_the_fuzzed_document_has_every_coupon_discount_credit_note_refund_and_document_operation(document):
    """What the schemathesis passes (test_fuzz_api.py, test_fuzz_stateful.py) generate requests for: each of these
    operations is in the document they load, with the bodies that apply or remove a discount and the refund's
    fields, so a 500 from any of them fails the fuzz."""
    import schemathesis

    from hardcount.wsgi import application

    found = {
        op["operationId"]: (method, path)
        for path, item in document["paths"].items()
        for method, op in item.items()
        if isinstance(op, dict) and "operationId" in op
    }
    assert {name: found.get(name) for name in CORRECTIONS_OPERATIONS} == CORRECTIONS_OPERATIONS
    fuzzed = {
        (result.ok().method.lower(), result.ok().path)
        for result in schemathesis.openapi.from_wsgi("/v1/openapi.json", application).get_all_operations()
    }
    assert set(CORRECTIONS_OPERATIONS.values()) <= fuzzed

    def body_fields(method: str, path: str) -> set[str]:
        schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        while "$ref" in schema:
            schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
        return set(schema["properties"])

    for path in ("/v1/customers", "/v1/customers/{id}", "/v1/subscriptions", "/v1/subscriptions/{id}"):
        assert {"coupon", "discounts"} <= body_fields("post", path), path
    assert {"refund_amount", "credit_amount", "out_of_band_amount", "lines", "amount"} <= body_fields(
        "post", "/v1/credit_notes"
    )
    for name in ("invoices_pdf", "credit_notes_pdf"):
        method, path = CORRECTIONS_OPERATIONS[name]
        assert "application/pdf" in document["paths"][path][method]["responses"]["200"]["content"], name
