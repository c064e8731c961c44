"""Billing's API input serializers (strict) and output schemas.

Input serializers validate types and static ranges only; rules that need the database or
"now" live in :mod:`billing.services.catalog`. Output serializers exist to document the
JSON that :mod:`billing.representations` produces (the single source of the shape): they
are never used to render, and ``tests/api/test_schema.py`` checks that each declares
exactly the keys its representation function returns.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.fields import empty

from billing.models.discounts import CouponDuration
from billing.models.meters import Formula
from billing.models.subscriptions import PauseBehavior, SubscriptionStatus
from billing.periods import INTERVALS
from billing.services.catalog import MAX_INTERVAL_COUNT, MAX_ITEMS, MAX_TRIAL_DAYS
from billing.services.discounts import MAX_DURATION_IN_MONTHS
from hardcount.api import (
    STARTING_AFTER_HELP,
    IdField,
    ListQuery,
    MetadataField,
    QueryCharField,
    QueryIdField,
    StrictBooleanField,
    StrictCharField,
    StrictChoiceField,
    StrictDateTimeField,
    StrictEmailField,
    StrictIntegerField,
    StrictSerializer,
    object_field,
)
from hardcount.errors import storable_text
from hardcount.money import CURRENCY_EXPONENTS, MAX_AMOUNT

CURRENCIES = sorted(CURRENCY_EXPONENTS)
SUBSCRIPTION_STATUSES = SubscriptionStatus.values
BILLING_STATES = ["ok", "waiting", "parked", "paused"]
PAUSE_BEHAVIORS = PauseBehavior.values
COUPON_DURATIONS = CouponDuration.values
INVOICE_STATUSES = ["draft", "open", "paid", "void", "uncollectible"]

_ID_HELP = "An id of the caller's tenant and mode; any other id is answered 404."


# ---------------------------------------------------------------------------------------
# Input


@extend_schema_field(
    {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 100,
        "description": "Percent taken off every line, above 0 and at most 100, with at most two decimals.",
    }
)
class PercentField(serializers.Field):
    """A JSON number (not a string or boolean), as a ``Decimal``; the range and the two decimals are the
    service's rules (:func:`billing.services.discounts.create_coupon`)."""

    default_error_messages = {"invalid": "Must be a JSON number."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float) or not abs(data) <= 1e6:  # NaN too
            self.fail("invalid")
        return Decimal(str(data))

    def to_representation(self, value):
        return float(value)


class CouponCreate(StrictSerializer):
    """A coupon: `percent_off`, or `amount_off` with `currency` (exactly one)."""

    percent_off = PercentField(required=False)
    amount_off = StrictIntegerField(
        min_value=1, max_value=MAX_AMOUNT, required=False, help_text="Minor units of `currency` off the invoice."
    )
    currency = StrictChoiceField(choices=CURRENCIES, required=False, help_text="With `amount_off` only.")
    duration = StrictChoiceField(choices=COUPON_DURATIONS, required=False, default="once")
    duration_in_months = StrictIntegerField(
        min_value=1,
        max_value=MAX_DURATION_IN_MONTHS,
        required=False,
        help_text="With `duration=repeating` only: calendar months from the discount's start.",
    )
    max_redemptions = StrictIntegerField(
        min_value=1, max_value=2_147_483_647, required=False, help_text="How many discounts may be made of it."
    )
    redeem_by = StrictDateTimeField(required=False, help_text="The last time it can be redeemed; in the future.")
    name = StrictCharField(max_length=40, required=False, allow_blank=True, default="")
    metadata = MetadataField(required=False)


class DiscountParam(StrictSerializer):
    coupon = IdField("coupon", help_text=_ID_HELP)


_DISCOUNTS_HELP = (
    "The coupons to apply, as Stripe's `discounts`: one at most here (`[{coupon}]`); on an update `[]` "
    "deletes the discount. Not with `coupon`."
)


def coupon_field() -> IdField:
    """The ``coupon`` shorthand of customer and subscription create and update bodies."""
    return IdField("coupon", required=False, help_text="A coupon to apply (shorthand for `discounts`). " + _ID_HELP)


def discounts_field() -> serializers.ListField:
    """The ``discounts`` of customer and subscription create and update bodies."""
    return serializers.ListField(
        child=DiscountParam(), min_length=0, max_length=1, required=False, help_text=_DISCOUNTS_HELP
    )


class CustomerCreate(StrictSerializer):
    email = StrictEmailField(max_length=254)
    name = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    external_id = StrictCharField(
        max_length=200, required=False, allow_blank=True, default="", help_text="Your own id for this customer."
    )
    default_payment_method = StrictCharField(
        max_length=255,
        required=False,
        validators=[RegexValidator(r"^pm_[A-Za-z0-9_]+$", "Must be a Stripe PaymentMethod id (pm_…).")],
        help_text="Stripe PaymentMethod id (`pm_…`) charged off-session for this customer's invoices.",
    )
    metadata = MetadataField(required=False)
    test_clock = IdField("test_clock", required=False, help_text="Test mode only: a test clock id. " + _ID_HELP)
    coupon = coupon_field()
    discounts = discounts_field()


@extend_schema_field(
    {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 10**15}, {"type": "string", "enum": ["inf"]}]}
)
class UpToField(serializers.Field):
    """A tier's ``up_to``: a positive JSON integer (at most 10¹⁵), or ``"inf"`` (the last tier)."""

    default_error_messages = {
        "not_integer": 'Must be a positive JSON integer or "inf" (no quotes, fractions or exponents).',
    }

    def to_internal_value(self, data):
        if data == "inf" or (isinstance(data, int) and not isinstance(data, bool) and 1 <= data <= 10**15):
            return data
        self.fail("not_integer")

    def to_representation(self, value):
        return value


class RecurringIn(StrictSerializer):
    usage_type = StrictChoiceField(
        choices=["licensed", "metered"],
        required=False,
        default="licensed",
        help_text="`metered`: billed in arrears from `meter`'s usage of the period that ended.",
    )
    meter = IdField("meter", required=False, help_text="With `metered`: the meter whose usage is billed. " + _ID_HELP)


class TierIn(StrictSerializer):
    up_to = UpToField()
    unit_amount = StrictIntegerField(min_value=0, max_value=MAX_AMOUNT, required=False, default=0)
    flat_amount = StrictIntegerField(min_value=0, max_value=MAX_AMOUNT, required=False, default=0)


class TransformQuantityIn(StrictSerializer):
    divide_by = StrictIntegerField(min_value=1, max_value=10**9, help_text="Units per package.")
    round = StrictChoiceField(choices=["up", "down"])


class PriceCreate(StrictSerializer):
    amount = StrictIntegerField(
        min_value=0,
        max_value=MAX_AMOUNT,
        help_text="Integer minor units of `currency`: 1000 usd is $10.00, 1000 jpy is ¥1,000.",
    )
    currency = StrictChoiceField(choices=CURRENCIES, help_text="Lower-case ISO 4217 code.")
    interval = StrictChoiceField(choices=list(INTERVALS))
    interval_count = StrictIntegerField(
        min_value=1,
        max_value=max(MAX_INTERVAL_COUNT.values()),
        required=False,
        default=1,
        help_text="Intervals per billing period; at most three years in total "
        "(1098 days, 156 weeks, 36 months or 3 years).",
    )
    nickname = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    active = StrictBooleanField(required=False, default=True)
    recurring = RecurringIn(required=False)
    billing_scheme = StrictChoiceField(
        choices=["per_unit", "tiered"],
        required=False,
        default="per_unit",
        help_text="`per_unit`: `amount` per unit (after `transform_quantity`); `tiered`: the `tiers` (amount 0).",
    )
    tiers_mode = StrictChoiceField(choices=["graduated", "volume"], required=False, help_text="With `tiered`.")
    tiers = serializers.ListField(
        child=TierIn(),
        required=False,
        min_length=1,
        max_length=25,
        help_text="With `tiered`: ascending `up_to`, the last `inf`.",
    )
    transform_quantity = TransformQuantityIn(required=False)


# Largest quantity of one subscription item (Stripe's own bound is larger; ours keeps every line in bigint range).
MAX_QUANTITY = 10_000


_CEILING_HELP = (
    "`quantity × unit amount`, and the next invoice (the items' lines and the pending items it sweeps), at most "
    "99,999,999 minor units (422 `amount_too_large`)."
)


class SubscriptionItemCreate(StrictSerializer):
    price = IdField("price", help_text=_ID_HELP)
    quantity = StrictIntegerField(
        min_value=1, max_value=MAX_QUANTITY, required=False, default=1, help_text=_CEILING_HELP
    )


class SubscriptionCreate(StrictSerializer):
    customer = IdField("customer", help_text=_ID_HELP)
    price = IdField(
        "price", required=False, help_text="One item of this price, quantity 1 (shorthand for `items`). " + _ID_HELP
    )
    items = serializers.ListField(
        child=SubscriptionItemCreate(),
        min_length=1,
        max_length=MAX_ITEMS,
        required=False,
        help_text="The prices billed each period, each at a quantity; they share one currency and billing "
        "interval. Give `items` or `price`, not both.",
    )
    billing_cycle_anchor = StrictDateTimeField(
        required=False,
        help_text="Start of the first billing period (default: now, or the customer's test clock time). "
        "At most 24 hours in the past and one interval in the future; not with a trial.",
    )
    trial_end = StrictDateTimeField(
        required=False, help_text=f"End of a free trial: after now, within {MAX_TRIAL_DAYS} days."
    )
    trial_period_days = StrictIntegerField(min_value=1, max_value=MAX_TRIAL_DAYS, required=False)
    cancel_at_period_end = StrictBooleanField(required=False, default=False)
    metadata = MetadataField(required=False)
    coupon = coupon_field()
    discounts = discounts_field()


@extend_schema_field(
    {
        "oneOf": [
            {"type": "integer", "minimum": 0, "maximum": 253402300799},
            {"type": "string", "format": "date-time"},
        ],
        "nullable": True,
        "description": "When collection resumes by itself: Unix seconds (Stripe's form) or an ISO 8601 "
        "date-time with a time zone; after the subscription's current time (its test clock's). Null or "
        "absent: paused until resumed by hand.",
    }
)
class ResumesAtField(StrictDateTimeField):
    """Stripe's ``resumes_at``: Unix seconds, or (this API's form for times) an ISO 8601 date-time; as UTC."""

    MAX_UNIX_S = 253402300799  # 9999-12-31T23:59:59Z

    default_error_messages = {
        "invalid": "Must be Unix seconds or an ISO 8601 date-time with a time zone, e.g. 2027-01-31T09:30:00Z.",
    }

    def to_internal_value(self, value):
        if isinstance(value, bool):
            self.fail("invalid")
        if isinstance(value, int):
            if not 0 <= value <= self.MAX_UNIX_S:
                self.fail("invalid")
            return datetime.fromtimestamp(value, UTC)
        return super().to_internal_value(value)


class PauseCollection(StrictSerializer):
    """Stripe's ``pause_collection`` (https://docs.stripe.com/billing/subscriptions/pause-payment)."""

    behavior = StrictChoiceField(
        choices=PAUSE_BEHAVIORS,
        help_text="What becomes of each invoice of a period that comes due while paused: `void` (created and "
        "voided at once), `mark_uncollectible` (created, numbered and marked uncollectible) or `keep_as_draft` "
        "(kept a draft, never finalised or charged). Nothing is charged while paused.",
    )
    resumes_at = ResumesAtField(required=False, allow_null=True)

    def run_validation(self, data=empty):
        # Stripe clears the pause with an empty string as well as with null.
        if data == "":
            return None
        return super().run_validation(data)


class SubscriptionItemUpdate(StrictSerializer):
    id = IdField("subscription_item", required=False, help_text="An item of this subscription; none: a new item.")
    price = IdField("price", required=False, help_text="The item's new price (a new item's price). " + _ID_HELP)
    quantity = StrictIntegerField(min_value=1, max_value=MAX_QUANTITY, required=False, help_text=_CEILING_HELP)
    deleted = StrictBooleanField(required=False, default=False, help_text="true: remove the item `id`.")


class SubscriptionUpdate(StrictSerializer):
    """The body of ``POST /v1/subscriptions/{id}``: each field is optional and only those given change."""

    items = serializers.ListField(
        child=SubscriptionItemUpdate(),
        min_length=1,
        max_length=MAX_ITEMS,
        required=False,
        help_text="Changes to the items, as Stripe's: `{id, quantity}` or `{id, price}` changes an item, "
        "`{id, deleted: true}` removes it, `{price, quantity}` adds one. Items not named stay.",
    )
    proration_behavior = StrictChoiceField(
        choices=["create_prorations", "always_invoice", "none"],
        required=False,
        default="create_prorations",
        help_text="`create_prorations`: credit and charge lines for the rest of the current period, billed on "
        "the next invoice; `always_invoice`: the same lines invoiced and charged now; `none`: no prorations.",
    )
    proration_date = StrictIntegerField(
        min_value=0,
        max_value=253402300799,
        required=False,
        help_text="Unix seconds: prorate as of this instant (a preview's), within the current period, not after now.",
    )
    effective_at = StrictChoiceField(
        choices=["immediately", "period_end"],
        required=False,
        default="immediately",
        help_text="`period_end`: nothing is prorated; the next period's invoice bills the new items (a scheduled "
        "change, shown as `scheduled_change`). 422 `effective_at_conflict` with `proration_date` or "
        "`proration_behavior: always_invoice`.",
    )
    billing_cycle_anchor = StrictChoiceField(
        choices=["unchanged", "now"],
        required=False,
        default="unchanged",
        help_text="`now`: restart the billing cycle at this instant (the test clock's time on a clock): the unused "
        "time of the current period is credited (unless `proration_behavior` is `none`) and a full period from "
        "now is invoiced and charged at once. 422 `billing_cycle_anchor_conflict` with `effective_at=period_end`, "
        "`proration_date`, `pause_collection` or a cancellation at period end; 422 "
        "`billing_cycle_anchor_unavailable` in a trial, while collection is paused, before the current period "
        "is invoiced, or at the current period's very start.",
    )
    pause_collection = PauseCollection(
        required=False,
        allow_null=True,
        help_text='Pause payment collection (an object), or resume it (`null` or `""`).',
    )
    cancel_at_period_end = StrictBooleanField(
        required=False,
        help_text="Stripe's: `true` cancels the subscription at the end of its current period, `false` withdraws a "
        "cancellation so scheduled (the subscription renews). Sent alone (422 `cancel_with_changes` with `items`, "
        "`pause_collection`, a discount, `billing_cycle_anchor: now`, `proration_date` or `effective_at`); 409 "
        "`subscription_canceled` once it has ended.",
    )
    coupon = coupon_field()
    discounts = discounts_field()


class SubscriptionCancel(StrictSerializer):
    at_period_end = StrictBooleanField(
        required=False,
        default=False,
        help_text="false (default): cancel now, as Stripe's `DELETE /v1/subscriptions/{id}` does (also when a "
        "cancellation at period end is scheduled). true: keep the subscription until its current period ends "
        "(the same as `cancel_at_period_end: true` on `POST /v1/subscriptions/{id}`, which with `false` "
        "withdraws it).",
    )
    prorate = StrictBooleanField(
        required=False,
        default=False,
        help_text="With a cancellation now: credit the unused time of the current period to the customer's "
        "balance (ledger reason `proration_credit`).",
    )


class QueryUnixTimeField(serializers.IntegerField):
    """Unix seconds in the query string: decimal digits only (up to 12)."""

    def to_internal_value(self, data):
        if not isinstance(data, str) or not data.isascii() or not data.isdigit() or len(data) > 12:
            self.fail("invalid")
        return super().to_internal_value(data)


class UpcomingInvoiceQuery(StrictSerializer):
    subscription = QueryIdField("subscription", required=True, help_text=_ID_HELP)
    items = QueryCharField(
        max_length=20_000,
        help_text="Proposed changes to the items, as the JSON array `items` of `POST /v1/subscriptions/{id}`.",
    )
    proration_behavior = StrictChoiceField(
        choices=["create_prorations", "always_invoice", "none"], required=False, default="create_prorations"
    )
    proration_date = QueryUnixTimeField(
        required=False,
        min_value=0,
        max_value=253402300799,
        help_text="Unix seconds: prorate as of this instant (default: now).",
    )


class CustomerListQuery(ListQuery):
    starting_after = QueryIdField("customer", help_text=STARTING_AFTER_HELP)
    email = QueryCharField(help_text="Only customers with this exact email.")
    external_id = QueryCharField(help_text="Only customers with this external id.")


class PriceListQuery(ListQuery):
    starting_after = QueryIdField("price", help_text=STARTING_AFTER_HELP)


class SubscriptionListQuery(ListQuery):
    starting_after = QueryIdField("subscription", help_text=STARTING_AFTER_HELP)
    customer = QueryIdField("customer", help_text="Only this customer's subscriptions.")
    status = StrictChoiceField(choices=SUBSCRIPTION_STATUSES, required=False)
    billing_state = StrictChoiceField(
        choices=BILLING_STATES,
        required=False,
        help_text="Only subscriptions in this billing state: `waiting` (a billing failure waits for its "
        "retry-ladder step), `parked` (eight failures: billed again only after retry-billing), `paused` (payment "
        "collection paused) or `ok`.",
    )


class CouponListQuery(ListQuery):
    starting_after = QueryIdField("coupon", help_text=STARTING_AFTER_HELP)


class InvoiceListQuery(ListQuery):
    starting_after = QueryIdField("invoice", help_text=STARTING_AFTER_HELP)
    customer = QueryIdField("customer", help_text="Only this customer's invoices.")
    subscription = QueryIdField("subscription", help_text="Only this subscription's invoices.")
    status = StrictChoiceField(choices=INVOICE_STATUSES, required=False)


# ---------------------------------------------------------------------------------------
# Output (documentation of billing.representations)


class Coupon(serializers.Serializer):
    """A coupon (Stripe's shape): `percent_off`, or `amount_off` minor units of `currency`, for `duration`."""

    id = serializers.CharField()
    object = object_field("coupon")
    livemode = serializers.BooleanField()
    name = serializers.CharField(allow_null=True)
    percent_off = serializers.FloatField(allow_null=True)
    amount_off = serializers.IntegerField(allow_null=True)
    currency = serializers.CharField(allow_null=True)
    duration = serializers.ChoiceField(choices=COUPON_DURATIONS)
    duration_in_months = serializers.IntegerField(allow_null=True)
    max_redemptions = serializers.IntegerField(allow_null=True)
    redeem_by = serializers.DateTimeField(allow_null=True)
    times_redeemed = serializers.IntegerField()
    valid = serializers.BooleanField(
        help_text="false once deleted, redeemed `max_redemptions` times, or past `redeem_by`."
    )
    metadata = serializers.DictField(child=serializers.CharField(allow_blank=True))
    created = serializers.DateTimeField()


class DeletedCoupon(serializers.Serializer):
    id = serializers.CharField()
    object = object_field("coupon")
    deleted = serializers.BooleanField()


class Discount(serializers.Serializer):
    """A coupon applied to a customer or to a subscription (`subscription` set), from `start` to `end`."""

    id = serializers.CharField()
    object = object_field("discount")
    coupon = Coupon()
    customer = serializers.CharField()
    subscription = serializers.CharField(allow_null=True)
    start = serializers.DateTimeField()
    end = serializers.DateTimeField(allow_null=True, help_text="null: no end (`once` and `forever`).")


class DeletedDiscount(Discount):
    deleted = serializers.BooleanField()


class DiscountAmount(serializers.Serializer):
    amount = serializers.IntegerField(help_text="Minor units of the invoice's currency.")
    discount = serializers.CharField()


class Customer(serializers.Serializer):
    """A customer. Money fields are integer minor units of `currency`."""

    id = serializers.CharField()
    object = object_field("customer")
    livemode = serializers.BooleanField()
    email = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    external_id = serializers.CharField(allow_blank=True)
    default_payment_method = serializers.CharField(allow_null=True)
    credit_balance = serializers.IntegerField(
        help_text="Ledger balance in minor units of `currency`: positive is credit owed to the customer."
    )
    currency = serializers.CharField(allow_null=True, help_text="Fixed by the first subscription or ledger entry.")
    test_clock = serializers.CharField(allow_null=True)
    discount = Discount(allow_null=True, help_text="The customer's discount, for all its invoices.")
    metadata = serializers.DictField(child=serializers.CharField(allow_blank=True))
    created = serializers.DateTimeField()


class RecurringOut(serializers.Serializer):
    interval = serializers.ChoiceField(choices=list(INTERVALS))
    interval_count = serializers.IntegerField()
    usage_type = serializers.ChoiceField(choices=["licensed", "metered"])
    meter = serializers.CharField(allow_null=True)


class TierOut(serializers.Serializer):
    up_to = UpToField()
    unit_amount = serializers.IntegerField()
    flat_amount = serializers.IntegerField()


class TransformQuantityOut(serializers.Serializer):
    divide_by = serializers.IntegerField()
    round = serializers.ChoiceField(choices=["up", "down"])


class Price(serializers.Serializer):
    """A recurring price: `amount` minor units of `currency` every `interval_count` `interval`s."""

    id = serializers.CharField()
    object = object_field("price")
    livemode = serializers.BooleanField()
    nickname = serializers.CharField(allow_blank=True)
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    interval = serializers.ChoiceField(choices=list(INTERVALS))
    interval_count = serializers.IntegerField()
    active = serializers.BooleanField()
    created = serializers.DateTimeField()
    recurring = RecurringOut()
    billing_scheme = serializers.ChoiceField(choices=["per_unit", "tiered"])
    tiers_mode = serializers.ChoiceField(choices=["graduated", "volume"], allow_null=True)
    tiers = TierOut(many=True, allow_null=True)
    transform_quantity = TransformQuantityOut(allow_null=True)


class PauseCollectionOut(serializers.Serializer):
    """A subscription's paused collection."""

    behavior = serializers.ChoiceField(choices=PAUSE_BEHAVIORS)
    resumes_at = serializers.DateTimeField(
        allow_null=True, help_text="When collection resumes by itself; null: when resumed by hand."
    )


class SubscriptionItem(serializers.Serializer):
    """One price at a quantity on a subscription: each period bills `quantity × price.amount`."""

    id = serializers.CharField()
    object = object_field("subscription_item")
    subscription = serializers.CharField()
    price = Price()
    quantity = serializers.IntegerField()
    created = serializers.DateTimeField()


class SubscriptionItemList(serializers.Serializer):
    object = object_field("list")
    data = SubscriptionItem(many=True)


class ScheduledItem(serializers.Serializer):
    id = serializers.CharField(allow_null=True, help_text="The item it changes; null: a new item.")
    price = serializers.CharField()
    quantity = serializers.IntegerField()


class ScheduledChange(serializers.Serializer):
    """Items a change with `effective_at=period_end` bills from the next period on."""

    effective_at = serializers.DateTimeField()
    items = ScheduledItem(many=True)


class Subscription(serializers.Serializer):
    """A customer's subscription to prices (its `items`), billed in advance at `next_billing_at`."""

    id = serializers.CharField()
    object = object_field("subscription")
    livemode = serializers.BooleanField()
    customer = serializers.CharField()
    price = serializers.CharField(help_text="The first item's price.")
    items = SubscriptionItemList()
    scheduled_change = ScheduledChange(allow_null=True)
    status = serializers.ChoiceField(choices=SUBSCRIPTION_STATUSES)
    billing_cycle_anchor = serializers.DateTimeField()
    trial_end = serializers.DateTimeField(allow_null=True)
    current_period_start = serializers.DateTimeField(allow_null=True)
    current_period_end = serializers.DateTimeField(allow_null=True)
    next_billing_at = serializers.DateTimeField(allow_null=True)
    test_clock = serializers.CharField(allow_null=True)
    cancel_at_period_end = serializers.BooleanField()
    canceled_at = serializers.DateTimeField(allow_null=True)
    ended_at = serializers.DateTimeField(allow_null=True)
    billing_state = serializers.ChoiceField(
        choices=BILLING_STATES,
        help_text="`waiting`: a billing failure waits for its retry-ladder step; `parked`: eight failures, "
        "billing stopped until retry-billing; `paused`: payment collection is paused (`pause_collection`).",
    )
    billing_failure_count = serializers.IntegerField()
    next_billing_attempt_at = serializers.DateTimeField(allow_null=True)
    billing_parked_at = serializers.DateTimeField(allow_null=True)
    last_billing_error = serializers.CharField(allow_null=True)
    pause_collection = PauseCollectionOut(
        allow_null=True, help_text="Set while payment collection is paused; null while it runs."
    )
    discount = Discount(allow_null=True, help_text="The subscription's discount; it beats the customer's.")
    discounts = serializers.ListField(child=serializers.CharField(), help_text="The discount's id, if any.")
    metadata = serializers.DictField(child=serializers.CharField(allow_blank=True))
    created = serializers.DateTimeField()


class LineItem(serializers.Serializer):
    id = serializers.CharField()
    object = object_field("line_item")
    description = serializers.CharField(allow_blank=True)
    price = serializers.CharField(allow_null=True)
    quantity = serializers.IntegerField()
    amount = serializers.IntegerField()
    discount_amounts = DiscountAmount(many=True, help_text="The invoice's discount on this line, before tax.")
    currency = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    subscription_item = serializers.CharField(allow_null=True, help_text="The subscription item the line bills.")
    invoice_item = serializers.CharField(allow_null=True, help_text="The pending invoice item the line was made of.")
    proration = serializers.BooleanField()


class Invoice(serializers.Serializer):
    """One invoice per subscription period. `total = subtotal - discounts + tax`; `amount_due = total -
    credit_applied`."""

    id = serializers.CharField()
    object = object_field("invoice")
    livemode = serializers.BooleanField()
    number = serializers.CharField(allow_null=True, help_text="Gapless per tenant and mode; set when finalised.")
    customer = serializers.CharField()
    subscription = serializers.CharField(allow_null=True)
    status = serializers.ChoiceField(choices=INVOICE_STATUSES)
    billing_reason = serializers.ChoiceField(choices=["subscription_cycle", "subscription_update", "manual"])
    currency = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    lines = LineItem(many=True)
    subtotal = serializers.IntegerField(help_text="The sum of the lines, before discounts and tax.")
    discounts = serializers.ListField(child=serializers.CharField(), help_text="The discount the invoice took.")
    total_discount_amounts = DiscountAmount(many=True)
    tax = serializers.IntegerField(help_text="On `subtotal` less the discounts.")
    tax_rate_bps = serializers.IntegerField()
    tax_status = serializers.ChoiceField(choices=["not_applicable", "calculated", "pending"])
    credit_applied = serializers.IntegerField()
    total = serializers.IntegerField()
    amount_due = serializers.IntegerField()
    amount_paid = serializers.IntegerField()
    pre_payment_credit_notes_amount = serializers.IntegerField(
        help_text="The non-void credit notes issued while the invoice was open: they reduced `amount_due`."
    )
    post_payment_credit_notes_amount = serializers.IntegerField(
        help_text="The non-void credit notes issued after it was paid (refunded, credited or out of band)."
    )
    payment_intent = serializers.CharField(allow_null=True)
    attempt_count = serializers.IntegerField()
    created = serializers.DateTimeField()
    finalized_at = serializers.DateTimeField(allow_null=True)
    paid_at = serializers.DateTimeField(allow_null=True)
    voided_at = serializers.DateTimeField(allow_null=True)
    marked_uncollectible_at = serializers.DateTimeField(allow_null=True)
    hosted_invoice_url = serializers.URLField(
        allow_null=True,
        help_text="The customer's page of the invoice (no login: the URL is the credential), null on a draft. "
        "`POST /v1/invoices/{id}/rotate_hosted_url` revokes it and issues a new one.",
    )
    invoice_pdf = serializers.URLField(
        allow_null=True,
        help_text="The invoice's PDF under the hosted URL (no login), null on a draft. With the API key: "
        "`GET /v1/invoices/{id}/pdf`.",
    )


class UpcomingLineItem(LineItem):
    id = serializers.CharField(allow_null=True, help_text="null: the line is not written yet.")


class UpcomingInvoice(Invoice):
    """The next invoice as it would be billed (nothing is written): no id or number yet."""

    id = serializers.CharField(allow_null=True)
    lines = UpcomingLineItem(many=True)


# ---------------------------------------------------------------------------------------
# Usage billing: meters and meter events (docs/reference/usage-billing.md)


class DefaultAggregationIn(StrictSerializer):
    formula = StrictChoiceField(
        choices=Formula.values,
        help_text="`sum`, `max`, `last` of the values, `count` of the events, `unique_count` of the value key's "
        "distinct values.",
    )


class CustomerMappingIn(StrictSerializer):
    event_payload_key = StrictCharField(max_length=100, help_text="The payload key holding the customer id.")
    type = StrictChoiceField(choices=["by_id"], required=False, default="by_id")


class ValueSettingsIn(StrictSerializer):
    event_payload_key = StrictCharField(max_length=100, help_text="The payload key holding the value.")


class MeterCreate(StrictSerializer):
    display_name = StrictCharField(max_length=250)
    event_name = StrictCharField(
        max_length=100,
        validators=[RegexValidator(r"^[A-Za-z0-9_.:-]+$", "Letters, digits and _ . : - only.")],
        help_text="The name the meter's events carry; one meter per name.",
    )
    default_aggregation = DefaultAggregationIn()
    customer_mapping = CustomerMappingIn(required=False)
    value_settings = ValueSettingsIn(required=False)


class MeterListQuery(ListQuery):
    starting_after = QueryIdField("meter", help_text=STARTING_AFTER_HELP)


class DefaultAggregationOut(serializers.Serializer):
    formula = serializers.ChoiceField(choices=Formula.values)


class CustomerMappingOut(serializers.Serializer):
    event_payload_key = serializers.CharField()
    type = serializers.ChoiceField(choices=["by_id"])


class ValueSettingsOut(serializers.Serializer):
    event_payload_key = serializers.CharField()


class Meter(serializers.Serializer):
    """A meter: how a customer's events named `event_name` become one quantity per period."""

    id = serializers.CharField()
    object = object_field("billing.meter")
    livemode = serializers.BooleanField()
    display_name = serializers.CharField()
    event_name = serializers.CharField()
    status = serializers.ChoiceField(choices=["active"])
    default_aggregation = DefaultAggregationOut()
    customer_mapping = CustomerMappingOut()
    value_settings = ValueSettingsOut()
    created = serializers.DateTimeField()


@extend_schema_field(
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 253402300799}, {"type": "string", "format": "date-time"}]}
)
class EventTimestampField(serializers.Field):
    """A meter event's ``timestamp``: unix seconds or ISO 8601 (checked by the service)."""

    def to_internal_value(self, data):
        return data


@extend_schema_field(
    {
        "type": "object",
        "maxProperties": 50,
        "propertyNames": {"maxLength": 100},
        "additionalProperties": {"oneOf": [{"type": "string", "maxLength": 500}, {"type": "integer"}]},
    }
)
class PayloadField(serializers.DictField):
    """A meter event's ``payload``: up to 50 keys (100 characters at most), each a string (500 at most) or integer."""

    default_error_messages = {"payload": "Up to 50 keys of at most 100 characters; values strings (≤ 500) or integers."}

    def to_internal_value(self, data):
        data = super().to_internal_value(data)
        # JSON Schema counts 5.0 as an integer, so the document allows it: read it as 5.
        data = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in data.items()}
        if len(data) > 50 or not all(
            len(k) <= 100
            and storable_text(k)
            and (
                (isinstance(v, str) and len(v) <= 500 and storable_text(v))
                or (isinstance(v, int) and not isinstance(v, bool))
            )
            for k, v in data.items()
        ):
            self.fail("payload")
        return data


class MeterEventCreate(StrictSerializer):
    event_name = StrictCharField(max_length=100)
    payload = PayloadField(
        help_text="The meter's customer key (default `stripe_customer_id`) and value key (default `value`), "
        "string or integer values.",
    )
    timestamp = EventTimestampField(required=False, help_text="Default: now (the customer's test clock's time).")
    identifier = StrictCharField(
        max_length=100, required=False, help_text="Unique per tenant and mode: a retry with it is not counted again."
    )


@extend_schema_field(
    {
        "type": "array",
        "minItems": 1,
        "maxItems": 1000,
        "items": {"type": "object", "description": "A meter event, as the body of POST /v1/billing/meter_events."},
    }
)
class EventListField(serializers.ListField):
    """The batch's events: JSON objects, each checked on its own by the service (a bad one is refused, the
    rest go on)."""

    def run_child_validation(self, data):
        # Objects straight from the JSON parser are taken as they are: the DictField child would copy every event
        # key by key, a third of a 1,000-event request's time in Python (decision 0216). Anything else is refused
        # by the child as before (422 on ``events.<index>``).
        if all(type(event) is dict for event in data):
            return list(data)
        return super().run_child_validation(data)


class MeterEventBatchCreate(StrictSerializer):
    events = EventListField(child=serializers.DictField(), min_length=1, max_length=1000)


class MeterEvent(serializers.Serializer):
    """A usage event, as Stripe's `billing.meter_event`."""

    object = object_field("billing.meter_event")
    event_name = serializers.CharField()
    identifier = serializers.CharField()
    livemode = serializers.BooleanField()
    payload = serializers.DictField()
    timestamp = serializers.DateTimeField()
    created = serializers.DateTimeField()


class MeterEventError(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    param = serializers.CharField()


class MeterEventResult(serializers.Serializer):
    index = serializers.IntegerField()
    identifier = serializers.CharField(allow_null=True)
    status = serializers.ChoiceField(choices=["accepted", "duplicate", "refused"])
    error = MeterEventError(allow_null=True)


class MeterEventBatch(serializers.Serializer):
    """What became of each event of a batch, in order."""

    object = object_field("billing.meter_event_batch")
    accepted = serializers.IntegerField()
    duplicate = serializers.IntegerField()
    refused = serializers.IntegerField()
    data = MeterEventResult(many=True)


class EventSummaryQuery(StrictSerializer):
    customer = QueryIdField("customer", required=True, help_text=_ID_HELP)
    start_time = QueryUnixTimeField(min_value=0, max_value=253402300799, help_text="Unix seconds, inclusive.")
    end_time = QueryUnixTimeField(min_value=0, max_value=253402300799, help_text="Unix seconds, exclusive.")
    value_grouping_window = StrictChoiceField(choices=["day", "none"], required=False, default="none")


class EventSummary(serializers.Serializer):
    object = object_field("billing.meter_event_summary")
    meter = serializers.CharField()
    customer = serializers.CharField()
    aggregated_value = serializers.IntegerField()
    start_time = serializers.DateTimeField()
    end_time = serializers.DateTimeField()
