"""Stateful schemathesis: sequences of calls chained along the document's links (real app, real PostgreSQL).

Each scenario starts with an operation that needs no id (a create, a list, a billing run) and
follows the document's OpenAPI links (hardcount/openapi_hooks.py): the id a response gives feeds
the next call's path or body (``POST /v1/customers`` → ``POST /v1/subscriptions`` with that
customer → ``cancel``; ``GET /v1/invoices`` → ``pay``/``void`` → the invoice's subscription → …).
About one call in ten is negative data (wrong types, missing or unknown fields) on a real object.
Every response must be a non-500 the document describes, with the same checks and the same
business-rule allowance as the single-request fuzz (tests/api/fuzzing.py), plus schemathesis's
stateful checks (a created object can be read back, a deleted one is gone, ...). The ``seeded``
fixture gives the lists something to link from (an open invoice, a webhook delivery); each
scenario starts from it again (a savepoint rolled back after each). Record:
docs/decisions/0139-stateful-api-fuzzing.md.

Bounded in time (one to three minutes here, with the machine shared):
``HARDCOUNT_FUZZ_STATEFUL_EXAMPLES`` scenarios (default 75) of at most
``HARDCOUNT_FUZZ_STATEFUL_STEPS`` calls (default 10); ``make fuzz`` runs it after the
single-request pass. ``pytest -s`` prints how each operation was answered.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, Phase, settings
from schemathesis.generation.stateful.state_machine import normalize_name
from schemathesis.specs.openapi.checks import ensure_resource_availability, positive_data_acceptance

from hardcount.wsgi import application
from tests.api.conftest import Api, create_catalog, create_invoice
from tests.api.fuzzing import (
    AUTH_HEADERS,
    FUZZ_KEY,
    call_headers,
    fuzz_tenant,
    positive_data_accepted_unless_business_rule,
)

__all__ = ["fuzz_tenant"]  # the fixture, used by name

EXAMPLES = int(os.environ.get("HARDCOUNT_FUZZ_STATEFUL_EXAMPLES", "75"))
STEPS = int(os.environ.get("HARDCOUNT_FUZZ_STATEFUL_STEPS", "10"))

# (operation, status) -> how many calls were answered so; printed after the run (pytest -s).
ANSWERS: Counter[tuple[str, int]] = Counter()

schema = schemathesis.openapi.from_wsgi("/v1/openapi.json", application)
schema.config.update(headers=AUTH_HEADERS)
# Only the document's links: schemathesis's inferred ones copy any response field into a parameter of
# the same name (a customer's external_id "" into ?external_id=, which the document refuses) and call
# the request positive all the same.
schema.config.phases.stateful.inference.algorithms = []


_Generated = schema.as_state_machine()


@schemathesis.check
def created_resource_available_but_not_an_absent_discount(ctx, response, case):
    """``ensure_resource_availability``, except removing the discount of a customer or subscription
    just created without one: a discount is not made with its owner, and removing one that is not
    there is a 404, as Stripe answers. An owner created *with* a discount must still find it."""
    if response.status_code == 404 and case.method.upper() == "DELETE" and case.path.endswith("/{id}/discount"):
        parent = ctx.internals.find_parent(case_id=case.id)
        created = parent and ctx.internals.find_response(case_id=parent.id)
        if created is not None and (created.json() or {}).get("discount") is None:
            return None
    return ensure_resource_availability(ctx, response, case)


class HardcountWorkflow(_Generated):
    """The generated workflow, sending the fuzz tenant's key and a unique ``Idempotency-Key``.

    Scenarios start only at operations without an ``{id}``: a random id is a 404, which the
    single-request fuzz already sends to every operation, and would spend the budget here.
    """

    _without_id = {
        normalize_name(f"RANDOM -> {result.ok().label}")
        for result in schema.get_all_operations()
        if "{id}" in result.ok().path
    }
    locals().update(dict.fromkeys(_without_id))
    root_rules = _Generated.root_rules - _without_id

    def setup(self):
        # Each scenario starts from the seeded book: what a response holds (an id to follow, or none)
        # decides what Hypothesis draws next, and must not depend on the scenarios before it.
        self._savepoint = transaction.savepoint()

    def teardown(self):
        transaction.savepoint_rollback(self._savepoint)
        super().teardown()

    def after_call(self, response, case):
        super().after_call(response, case)
        ANSWERS[(case.operation.label, response.status_code)] += 1

    def get_call_kwargs(self, case):
        return {"headers": call_headers(case)}

    def validate_response(self, response, case, additional_checks=None, **kwargs):
        case.validate_response(
            response,
            excluded_checks=[positive_data_acceptance, ensure_resource_availability],
            additional_checks=[
                positive_data_accepted_unless_business_rule,
                created_resource_available_but_not_an_absent_discount,
            ],
            headers=kwargs.get("headers"),  # so the auth checks know the credentials are ours
            transport_kwargs=kwargs or None,
            recorder=self.recorder,
        )


@pytest.fixture
def _unthrottled(settings):
    """The whole run is one test transaction, where the database's now() stands still, so a key's
    buckets never refill; the limits have their own tests (tests/security/test_rate_limits.py)."""
    settings.HARDCOUNT_RATE_LIMIT = False


@pytest.fixture
def seeded(fuzz_tenant):
    """Objects the lists find for the links to start from: a customer with a card, a price, a subscription,
    an open invoice of it with a credit note (so the credit notes' retrieve, void and pdf are reached), a coupon,
    a test clock, a webhook endpoint (whose events make deliveries)."""
    api = Api(FUZZ_KEY)
    endpoint = {"url": "https://example.com/hardcount", "enabled_events": ["*"]}
    status, body = api.post("/v1/webhook_endpoints", endpoint)
    assert status == 201, body
    catalog = create_catalog(api)
    status, _ = api.post(f"/v1/customers/{catalog['customer']['id']}", {"default_payment_method": "pm_card_visa"})
    assert status == 200
    invoice = create_invoice(catalog["subscription"]["id"])
    status, body = api.post("/v1/credit_notes", {"invoice": invoice.id, "amount": 100, "reason": "order_change"})
    assert status == 201, body
    status, body = api.post("/v1/coupons", {"percent_off": 10, "duration": "once"})
    assert status == 201, body
    status, body = api.post("/v1/test_clocks", {"frozen_time": "2026-01-01T00:00:00Z"})
    assert status == 201, body
    # Django's test client connects the per-request connection closing again after each request.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    return catalog


def test_call_sequences_along_the_links_are_answered_as_documented(seeded, _unthrottled):
    ANSWERS.clear()
    # Generation only: shrinking replays sequences whose ids (new on each run) differ; a failure prints
    # its sequence as found.
    HardcountWorkflow.run(
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,  # a stored sequence replays against another book: not a reproduction
            derandomize=False,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
    )
    for (label, status), count in sorted(ANSWERS.items()):
        print(f"{count:5d}  {status}  {label}")
    # The links work: operations on objects were reached with ids that exist (without links, or with
    # the random-id roots only, these are all 404s). About fifteen are reached here; five is a floor.
    reached = {label for label, status in ANSWERS if "{id}" in label and 200 <= status < 300}
    assert len(reached) >= 5, sorted(ANSWERS.items())
