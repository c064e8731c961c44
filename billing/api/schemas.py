"""Input serializers and output schemas of the billing-run, payment and credit endpoints.

Output serializers document the JSON of :mod:`billing.representations` (they never render);
``tests/billing/test_api.py`` checks each declares exactly the keys its function returns.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from billing import models as billing_models
from billing.serializers import CURRENCIES
from hardcount.api import (
    STARTING_AFTER_HELP,
    IdField,
    ListQuery,
    QueryIdField,
    StrictCharField,
    StrictChoiceField,
    StrictIntegerField,
    StrictSerializer,
    object_field,
)
from hardcount.money import MAX_AMOUNT

# ---------------------------------------------------------------------------------------
# Input


class Empty(StrictSerializer):
    """No fields: the body is ``{}`` (or empty)."""


@extend_schema_field({"type": "integer", "minimum": -MAX_AMOUNT, "maximum": MAX_AMOUNT, "not": {"const": 0}})
class NonZeroAmountField(StrictIntegerField):
    """Signed minor units from ``-MAX_AMOUNT`` to ``MAX_AMOUNT``, never 0 (documented so in the schema)."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if value == 0:
            self.fail("invalid")
        return value


class InvoiceItemCreate(StrictSerializer):
    customer = IdField("customer", help_text="An id of the caller's tenant and mode; any other id is answered 404.")
    amount = NonZeroAmountField(
        min_value=-MAX_AMOUNT,
        max_value=MAX_AMOUNT,
        help_text="Signed minor units of `currency`, not 0: negative is a credit on the next invoice. 422 "
        "`amount_too_large` when the invoice that would sweep it would exceed 99,999,999.",
    )
    currency = StrictChoiceField(choices=CURRENCIES, help_text="The customer's billing currency.")
    description = StrictCharField(max_length=500, required=False, allow_blank=True, default="")
    subscription = IdField(
        "subscription",
        required=False,
        help_text="Bill it on this subscription's next invoice (one of the customer's). Without it, the "
        "customer's next invoice takes it.",
    )


class InvoiceItemListQuery(ListQuery):
    starting_after = QueryIdField("invoice_item", help_text=STARTING_AFTER_HELP)
    customer = QueryIdField("customer", help_text="Only this customer's items.")
    subscription = QueryIdField("subscription", help_text="Only this subscription's items.")


class CreditCreate(StrictSerializer):
    amount = StrictIntegerField(
        min_value=-MAX_AMOUNT,
        max_value=MAX_AMOUNT,
        help_text="Signed minor units of the balance's currency, not 0: positive grants credit (applied to the "
        "next invoices), negative records an amount the customer owes.",
    )
    currency = StrictChoiceField(
        choices=CURRENCIES,
        required=False,
        help_text="Defaults to the customer's balance currency; required when the customer has none yet. "
        "Any other currency is refused.",
    )
    description = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class BillingRunListQuery(ListQuery):
    starting_after = QueryIdField("billing_run", help_text=STARTING_AFTER_HELP)


class BillingAttemptListQuery(ListQuery):
    starting_after = QueryIdField("billing_attempt", help_text=STARTING_AFTER_HELP)


class LedgerListQuery(ListQuery):
    starting_after = QueryIdField("ledger_entry", help_text=STARTING_AFTER_HELP)


class PaymentAttemptListQuery(ListQuery):
    starting_after = QueryIdField("payment_attempt", help_text=STARTING_AFTER_HELP)


# ---------------------------------------------------------------------------------------
# Output


class BillingRun(serializers.Serializer):
    """One drain of due subscriptions: who triggered it, what it covered, and its counts."""

    id = serializers.CharField()
    object = object_field("billing_run")
    livemode = serializers.BooleanField()
    trigger = serializers.ChoiceField(choices=billing_models.BillingRun.Trigger.values)
    scope = serializers.ChoiceField(
        choices=["tenant", "all_tenants"],
        help_text="`all_tenants`: a scheduler run; its counts are your subscriptions' only and `pages` is null.",
    )
    test_clock = serializers.CharField(allow_null=True)
    status = serializers.ChoiceField(
        choices=billing_models.BillingRun.Status.values,
        help_text="`running` while it drains (its counts are saved page by page), then `completed` or `failed`; "
        "`abandoned`: a scheduler run whose process stopped.",
    )
    as_of = serializers.DateTimeField(help_text="The billing time: the database's now(), or the test clock's time.")
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    pages = serializers.IntegerField(allow_null=True)
    attempted = serializers.IntegerField()
    billed = serializers.IntegerField(
        help_text="Closed: paid, declined into dunning, waiting for tax, or its payment finishing later."
    )
    failed = serializers.IntegerField(help_text="Failed: the period did not advance.")
    error = serializers.CharField(allow_null=True)
    shard = serializers.CharField(
        help_text="The billing shard, as its lease role (`billing`, or `billing:<index>` when billing is sharded): "
        "the one a scheduler run drained, or the one whose scheduler leader bills your subscriptions."
    )


class BillingAttempt(serializers.Serializer):
    """One subscription attempted by one billing run."""

    id = serializers.CharField()
    object = object_field("billing_attempt")
    billing_run = serializers.CharField()
    subscription = serializers.CharField()
    invoice = serializers.CharField(allow_null=True)
    outcome = serializers.ChoiceField(choices=billing_models.BillingAttempt.Outcome.values)
    error = serializers.CharField(allow_null=True)
    failure_number = serializers.IntegerField(
        help_text="The subscription's billing_failure_count after this attempt (0 when it did not fail)."
    )
    created = serializers.DateTimeField()


class LedgerEntry(serializers.Serializer):
    """One change of a customer's credit balance (append-only)."""

    id = serializers.CharField()
    object = object_field("customer_balance_transaction")
    livemode = serializers.BooleanField()
    customer = serializers.CharField()
    amount = serializers.IntegerField(help_text="Signed minor units: + grants credit, − applies it or records a debit.")
    currency = serializers.CharField()
    balance_after = serializers.IntegerField()
    reason = serializers.ChoiceField(
        choices=["grant", "applied_to_invoice", "carried_debit", "adjustment", "proration_credit"]
    )
    description = serializers.CharField(allow_blank=True)
    invoice = serializers.CharField(allow_null=True)
    created = serializers.DateTimeField()


class InvoiceItemPeriod(serializers.Serializer):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()


class InvoiceItem(serializers.Serializer):
    """A pending amount for a customer's next invoice; `invoice` is null until an invoice takes it (once)."""

    id = serializers.CharField()
    object = object_field("invoiceitem")
    livemode = serializers.BooleanField()
    customer = serializers.CharField()
    subscription = serializers.CharField(allow_null=True)
    invoice = serializers.CharField(allow_null=True)
    amount = serializers.IntegerField(help_text="Signed minor units of `currency`: negative is a credit.")
    currency = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    price = serializers.CharField(allow_null=True)
    quantity = serializers.IntegerField()
    proration = serializers.BooleanField(help_text="Made by a subscription change for the time it prorates.")
    period = InvoiceItemPeriod()
    date = serializers.DateTimeField()


class PaymentAttempt(serializers.Serializer):
    """One charge of an invoice at the gateway, under one idempotency key."""

    id = serializers.CharField()
    object = object_field("payment_attempt")
    livemode = serializers.BooleanField()
    invoice = serializers.CharField()
    attempt_number = serializers.IntegerField()
    payment_intent = serializers.CharField(allow_null=True)
    idempotency_key = serializers.CharField(allow_null=True)
    payment_method = serializers.CharField(allow_null=True)
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    outcome = serializers.ChoiceField(choices=["succeeded", "declined", "unknown", "error"])
    payment_intent_status = serializers.CharField(
        allow_null=True,
        help_text="The PaymentIntent's status as last seen (Stripe's): `requires_action` or `processing` while the "
        "payment finishes later (outcome `unknown`), null before any answer.",
    )
    decline_code = serializers.CharField(allow_null=True)
    error_message = serializers.CharField(allow_null=True)
    http_status = serializers.IntegerField(allow_null=True)
    settled_without_charge = serializers.BooleanField()
    started_at = serializers.DateTimeField()
    completed_at = serializers.DateTimeField()
