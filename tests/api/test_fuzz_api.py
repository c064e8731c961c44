"""Schemathesis over /v1/openapi.json: generated requests against the real Django app (WSGI, real PostgreSQL).

Every documented operation gets positive and negative examples (wrong types, missing
fields, unknown fields, bad headers), sent with a real test key; every response must be
a non-500 that the document describes (status, content type, body schema), and the
built-in checks (ignored auth, schema-violating data accepted, schema-valid data
refused, ...) must pass. ``make fuzz`` runs this file alone.

Two adjustments, both narrower than switching a check off:

- Schema-valid data may be refused with a 422 only for a documented business rule
  (codes registered with :func:`hardcount.errors.business_rule_codes`: cross-field and
  time-relative rules a JSON schema cannot state), or for an integer written as a float (``10.0``, which
  JSON Schema counts as an integer and the API refuses, see ``StrictIntegerField``); any
  other 422 to schema-valid data still fails.
- Each generated ``Idempotency-Key`` gets a unique suffix: the generator reuses short
  keys across different bodies, which the API rightly answers 422 (tested on its own in
  ``test_idempotency.py``).

Both live in tests/api/fuzzing.py, shared with the stateful pass (tests/api/test_fuzz_stateful.py).
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from hardcount.wsgi import application
from tests.api.fuzzing import AUTH_HEADERS, call_headers, fuzz_tenant, positive_data_accepted_unless_business_rule

__all__ = ["fuzz_tenant"]  # the fixture, used by name

schema = schemathesis.openapi.from_wsgi("/v1/openapi.json", application)
schema.config.generation.update(max_examples=10)
schema.config.update(headers=AUTH_HEADERS)


@schema.parametrize()
@settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_api_answers_every_generated_request_as_documented(case, fuzz_tenant):
    # The key is passed explicitly too, so the auth checks know the credentials are ours.
    case.call_and_validate(
        headers=call_headers(case),
        excluded_checks=[positive_data_acceptance],
        additional_checks=[positive_data_accepted_unless_business_rule],
    )
