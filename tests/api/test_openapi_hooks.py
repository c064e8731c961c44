"""The document's postprocessing hooks (hardcount/openapi_hooks.py): links, and blank strings that stay valid."""

from __future__ import annotations

import jsonschema
import pytest
from django.test import Client

from hardcount.openapi_hooks import add_resource_links, blank_strings_any_of


@pytest.fixture
def document(db):
    return Client().get("/v1/openapi.json").json()


def _links(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation.get("responses", {}).items():
                for name, link in response.get("links", {}).items():
                    yield (method, path, status, name), link


def test_every_operation_that_takes_an_id_is_the_target_of_a_link(document):
    targets = {link["operationId"] for _, link in _links(document)}
    taking_an_id = {
        operation["operationId"]
        for path, item in document["paths"].items()
        if "{id}" in path
        for operation in item.values()
    }
    assert taking_an_id and taking_an_id <= targets, sorted(taking_an_id - targets)


def test_links_name_real_operations_and_the_expected_values(document):
    operation_ids = {op["operationId"] for item in document["paths"].values() for op in item.values()}
    links = dict(_links(document))
    assert all(link["operationId"] in operation_ids for link in links.values())
    create = links[("post", "/v1/customers", "201", "customers_retrieve")]
    assert create["parameters"] == {"path.id": "$response.body#/id"}
    listed = links[("get", "/v1/invoices", "200", "invoices_pay")]
    assert listed["parameters"] == {"path.id": "$response.body#/data/0/id"}
    named = links[("get", "/v1/invoices/{id}", "200", "subscriptions_cancel_of_subscription")]
    assert named["parameters"] == {"path.id": "$response.body#/subscription"}
    body = links[("post", "/v1/customers", "201", "subscriptions_create_with_customer")]
    assert body["requestBody"] == {"customer": "$response.body#/id"}
    # A GET never links to itself: it would read the same object again.
    assert ("get", "/v1/customers/{id}", "200", "customers_retrieve") not in links


def test_a_document_without_resources_gets_no_links():
    document = {"paths": {"/v1/ping": {"get": {"operationId": "ping", "responses": {"200": {}}}}}}
    assert add_resource_links(document, None, None, True) == document
    assert "links" not in document["paths"]["/v1/ping"]["get"]["responses"]["200"]


def test_a_blank_string_is_valid_where_the_api_accepts_one(document):
    schemas = document["components"]["schemas"]
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/CustomerUpdateRequest", "components": document["components"]}
    )
    assert not list(validator.iter_errors({"external_id": "", "name": ""}))
    assert list(validator.iter_errors({"external_id": "a\u0000b"}))  # the rule itself still holds
    assert "oneOf" not in schemas["CustomerUpdateRequest"]["properties"]["external_id"]


def test_negative_control_drf_spectaculars_one_of_refuses_the_blank_string():
    field = {
        "oneOf": [{"type": "string", "maxLength": 200, "pattern": "^[^\\u0000]*$"}, {"type": "string", "maxLength": 0}]
    }
    assert list(jsonschema.Draft202012Validator(field).iter_errors(""))
    fixed = blank_strings_any_of({"components": {"schemas": {"F": field}}}, None, None, True)
    assert not list(jsonschema.Draft202012Validator(fixed["components"]["schemas"]["F"]).iter_errors(""))
