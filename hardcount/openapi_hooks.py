"""drf-spectacular postprocessing hooks for the /v1 document (``SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]``).

:func:`blank_strings_any_of` keeps ``""`` valid where the API accepts it; :func:`add_resource_links`
adds the OpenAPI links: which response gives the ``{id}`` of which operations.

For the links, a resource is named by its ``object`` value (``"customer"``) and lives at the
path that ends in ``/{id}`` and whose GET answers that object (``/v1/customers/{id}``). Every
operation whose success response is that object (a create, an update, an action such as ``pay``)
links to each operation under the resource's path with ``$response.body#/id``; every list of it
links there with ``$response.body#/data/0/id``. A field named after another resource (an
invoice's ``subscription``) links to that resource's operations, and a created resource links to
the POSTs whose request body names it (a customer to ``POST /v1/subscriptions`` with
``{"customer": <id>}``). Clients may follow the links; the stateful fuzz
(tests/api/test_fuzz_stateful.py) chains its calls along them. Links: OpenAPI 3.1 §4.8.20,
https://spec.openapis.org/oas/v3.1.0#link-object.
"""

from __future__ import annotations

from typing import Any

_METHODS = ("get", "post", "put", "patch", "delete")


def _resolve(document: dict[str, Any], schema: dict[str, Any] | None) -> dict[str, Any]:
    while isinstance(schema, dict) and "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = document.get("components", {}).get("schemas", {}).get(name)
    return schema if isinstance(schema, dict) else {}


def _object_name(document: dict[str, Any], schema: dict[str, Any] | None) -> str | None:
    """The single ``object`` value a schema declares (``enum`` of one or ``const``), else ``None``."""
    prop = _resolve(document, _resolve(document, schema).get("properties", {}).get("object"))
    if "const" in prop:
        return prop["const"]
    enum = prop.get("enum") or []
    return enum[0] if len(enum) == 1 else None


def _success(operation: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    for status in sorted(operation.get("responses", {})):
        if status.startswith("2"):
            response = operation["responses"][status]
            return status, response.get("content", {}).get("application/json", {}).get("schema") or {}
    return None


_BLANK = {"type": "string", "maxLength": 0}


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def blank_strings_any_of(result: dict[str, Any], generator, request, public) -> dict[str, Any]:
    """Turn drf-spectacular's ``oneOf: [<string rule>, {"maxLength": 0}]`` for a blank-allowed string into ``anyOf``.

    ``oneOf`` means exactly one branch: when the rule's pattern also matches ``""`` (``^[^\\u0000]*$``),
    ``""`` matches both and the document would call invalid a value the API accepts. Returns the
    document, changed in place.
    """
    for node in _walk(result):
        branches = node.get("oneOf")
        if isinstance(branches, list) and len(branches) == 2 and branches[1] == _BLANK:
            node["anyOf"] = node.pop("oneOf")
    return result


def add_resource_links(result: dict[str, Any], generator, request, public) -> dict[str, Any]:
    """Add ``links`` to each 2xx response that names a resource; returns the document (changed in place)."""
    paths: dict[str, dict[str, Any]] = result.get("paths", {})
    # object name -> the resource's path ("/v1/customers/{id}")
    homes: dict[str, str] = {}
    for path, item in paths.items():
        if path.endswith("/{id}") and "get" in item:
            found = _success(item["get"])
            name = found and _object_name(result, found[1])
            if name:
                homes[name] = path

    targets: dict[str, list[str]] = {
        name: [
            item[method]["operationId"]
            for path, item in paths.items()
            if path == home or path.startswith(home + "/")
            for method in _METHODS
            if method in item and "operationId" in item[method]
        ]
        for name, home in homes.items()
    }

    # POST operations whose request body names a resource by its id ({"customer": "cus_…"})
    body_refs: dict[str, list[str]] = {}
    for item in paths.values():
        operation = item.get("post") or {}
        body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        for prop in _resolve(result, body).get("properties", {}):
            if prop in homes and "operationId" in operation:
                body_refs.setdefault(prop, []).append(operation["operationId"])

    for item in paths.values():
        for method in _METHODS:
            operation = item.get(method)
            found = operation and _success(operation)
            if not found:
                continue
            status, schema = found
            own = operation.get("operationId")
            links: dict[str, Any] = {}
            properties = _resolve(result, schema).get("properties", {})
            name, expression = _object_name(result, schema), "$response.body#/id"
            listed = _object_name(result, properties.get("data", {}).get("items"))
            if name not in targets and listed in targets:
                name, expression = listed, "$response.body#/data/0/id"
            for target in targets.get(name, []):
                if not (target == own and method == "get"):
                    links[target] = _link(target, f"The {name} of this response.", path_id=expression)
            if name and expression == "$response.body#/id":
                # An id of another resource in this one ("subscription": "sub_…"), and creations that take it.
                for prop in properties:
                    if prop != name and prop in targets:
                        for target in targets[prop]:
                            links[f"{target}_of_{prop}"] = _link(
                                target, f"The {prop} this {name} names.", path_id=f"$response.body#/{prop}"
                            )
                for target in body_refs.get(name, []):
                    links[f"{target}_with_{name}"] = _link(
                        target, f"A request naming this {name}.", body={name: "$response.body#/id"}
                    )
            if links:
                operation["responses"][status].setdefault("links", {}).update(links)
    return result


def _link(target: str, description: str, *, path_id: str | None = None, body: dict | None = None) -> dict[str, Any]:
    link: dict[str, Any] = {"operationId": target, "description": description}
    if path_id:
        link["parameters"] = {"path.id": path_id}
    if body:
        link["requestBody"] = body
    return link
