"""What both API fuzzers share: the fuzz tenant's key, its fixture, and the acceptance check.

tests/api/test_fuzz_api.py sends single generated requests; tests/api/test_fuzz_stateful.py chains
them along the document's links. Both send :data:`FUZZ_KEY` and judge schema-valid data refused
with :func:`positive_data_accepted_unless_business_rule`.
"""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from schemathesis.specs.openapi.checks import positive_data_acceptance

from hardcount.errors import registered_business_rule_codes
from outbox.services import BUSINESS_RULE_CODES as OUTBOX_BUSINESS_RULE_CODES

# A fixed test-mode secret, stored (as its hash) for each test by the ``fuzz_tenant`` fixture. Given to
# schemathesis as configured headers, so it knows the credentials come from the caller.
FUZZ_KEY = "hc_test_fuzzfuzzfuzzfuzzfuzzfuzzfuzzfuzz"
AUTH_HEADERS = {"Authorization": f"Bearer {FUZZ_KEY}"}

_unique = itertools.count()


def call_headers(case) -> dict[str, str]:
    """The key, and the case's ``Idempotency-Key`` made unique when it is a valid one: the generator
    reuses short keys across different bodies, which the API rightly answers 422 (tested on its own in
    ``test_idempotency.py``)."""
    key = (case.headers or {}).get("Idempotency-Key")
    headers = dict(AUTH_HEADERS)
    if isinstance(key, str) and key.isascii() and key.isprintable() and 1 <= len(key) <= 255:
        headers["Idempotency-Key"] = f"{key[:240]}-{next(_unique)}"
    return headers


def _is_integral_float(case, param) -> bool:
    # ``param`` may point inside the body: "retry_days.0" is the first entry of the retry_days array.
    value = case.body
    for part in (param or "").split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return False
    return isinstance(value, float) and value.is_integer()


@schemathesis.check
def positive_data_accepted_unless_business_rule(ctx, response, case):
    """``positive_data_acceptance``, except for a 422 carrying a documented business-rule code,
    or refusing an integer written as a float (``10.0``: JSON Schema's integer, not the API's)."""
    if response.status_code == 422:
        error = (response.json() or {}).get("error", {})
        if error.get("code") in registered_business_rule_codes() | OUTBOX_BUSINESS_RULE_CODES:
            return None
        if error.get("code") == "parameter_not_integer" and _is_integral_float(case, error.get("param")):
            return None
    return positive_data_acceptance(ctx, response, case)


@pytest.fixture
def fuzz_tenant(db):
    """A tenant whose test key is :data:`FUZZ_KEY`. The app runs inside the test's transaction, as
    with Django's test client, so its per-request connection closing is switched off for the test."""
    from hardcount.models import ApiKey, Tenant, hash_api_key

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        tenant = Tenant.objects.create(name="Fuzz")
        ApiKey.objects.create(tenant=tenant, livemode=False, key_hash=hash_api_key(FUZZ_KEY), key_hint=FUZZ_KEY[:14])
        yield tenant
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
