"""Customers, prices, subscriptions and invoices over HTTP (thin: validate, call a service, render).

The JSON of every object comes from :mod:`billing.representations`; the serializers in
:mod:`billing.serializers` validate input and document output.
"""

from __future__ import annotations

import json

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response

from billing import serializers as s
from billing.api.coupons import coupon_change
from billing.api.customers import CustomerUpdateMixin
from billing.models import Customer, Invoice, Price, Subscription
from billing.models.subscriptions import BILLING_STATE_FILTERS
from billing.representations import customer_data, invoice_data, price_data, subscription_data
from billing.services import catalog, changes, discounts, pausing
from billing.services.discounts import KEEP
from hardcount.api import ERROR, ApiView, id_path_parameter, list_of
from hardcount.errors import InvalidRequestError, business_rule_codes, first_validation_error


class CustomerListView(ApiView):
    get_query = s.CustomerListQuery

    @extend_schema(
        operation_id="customers_create",
        summary="Create a customer",
        tags=["customers"],
        request=s.CustomerCreate,
        responses={201: s.Customer, 404: ERROR},
    )
    def post(self, request):
        data = self.read_body(s.CustomerCreate)
        coupon, coupon_param = coupon_change(data)
        customer = catalog.create_customer(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            email=data["email"],
            name=data["name"],
            external_id=data["external_id"],
            default_payment_method=data.get("default_payment_method", ""),
            metadata=data.get("metadata"),
            test_clock_id=data.get("test_clock"),
            coupon_id=coupon if isinstance(coupon, str) else None,
            coupon_param=coupon_param,
        )
        return Response(customer_data(customer), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="customers_list",
        summary="List customers, newest first",
        tags=["customers"],
        responses=list_of(s.Customer, "CustomerList"),
    )
    def get(self, request):
        query = self.read_query()
        customers = self.filter_by_query(self.scoped(Customer), query, email="email", external_id="external_id")
        return self.paginate(customers, customer_data, query, kind="customer")


class CustomerDetailView(CustomerUpdateMixin, ApiView):
    @extend_schema(
        operation_id="customers_retrieve",
        summary="Retrieve a customer",
        tags=["customers"],
        parameters=[id_path_parameter("customer")],
        responses=s.Customer,
    )
    def get(self, request, id):
        return Response(customer_data(self.get_scoped(Customer, id, kind="customer")))


class PriceListView(ApiView):
    get_query = s.PriceListQuery

    @extend_schema(
        operation_id="prices_create",
        summary="Create a price",
        tags=["prices"],
        request=s.PriceCreate,
        responses={201: s.Price},
    )
    def post(self, request):
        data = self.read_body(s.PriceCreate)
        price = catalog.create_price(tenant_id=self.tenant.pk, livemode=self.livemode, **data)
        return Response(price_data(price), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="prices_list",
        summary="List prices, newest first",
        tags=["prices"],
        responses=list_of(s.Price, "PriceList"),
    )
    def get(self, request):
        query = self.read_query()
        return self.paginate(self.scoped(Price), price_data, query, kind="price")


class PriceDetailView(ApiView):
    @extend_schema(
        operation_id="prices_retrieve",
        summary="Retrieve a price",
        tags=["prices"],
        parameters=[id_path_parameter("price")],
        responses=s.Price,
    )
    def get(self, request, id):
        return Response(price_data(self.get_scoped(Price, id, kind="price")))


class SubscriptionListView(ApiView):
    get_query = s.SubscriptionListQuery

    @extend_schema(
        operation_id="subscriptions_create",
        summary="Create a subscription",
        description="Subscribes a customer to a price. The first period is billed by the next drain "
        "(at `next_billing_at`: the anchor, or the trial's end). A customer on a test clock puts the "
        "subscription on that clock.",
        tags=["subscriptions"],
        request=s.SubscriptionCreate,
        responses={201: s.Subscription, 404: ERROR},
    )
    def post(self, request):
        data = self.read_body(s.SubscriptionCreate)
        coupon, coupon_param = coupon_change(data)
        subscription = catalog.create_subscription(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            customer_id=data["customer"],
            price_id=data.get("price"),
            items=data.get("items"),
            billing_cycle_anchor=data.get("billing_cycle_anchor"),
            trial_end=data.get("trial_end"),
            trial_period_days=data.get("trial_period_days"),
            cancel_at_period_end=data["cancel_at_period_end"],
            metadata=data.get("metadata"),
            coupon_id=coupon if isinstance(coupon, str) else None,
            coupon_param=coupon_param,
        )
        return Response(subscription_data(subscription), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="subscriptions_list",
        summary="List subscriptions, newest first",
        tags=["subscriptions"],
        responses=list_of(s.Subscription, "SubscriptionList"),
    )
    def get(self, request):
        query = self.read_query()
        subscriptions = self.filter_by_query(
            self.scoped(Subscription).prefetch_related("items__price"), query, customer="customer_id", status="status"
        )
        if query.get("billing_state"):
            subscriptions = subscriptions.filter(BILLING_STATE_FILTERS[query["billing_state"]])
        return self.paginate(subscriptions, subscription_data, query, kind="subscription")


class SubscriptionDetailView(ApiView):
    @extend_schema(
        operation_id="subscriptions_retrieve",
        summary="Retrieve a subscription",
        tags=["subscriptions"],
        parameters=[id_path_parameter("subscription")],
        responses=s.Subscription,
    )
    def get(self, request, id):
        return Response(subscription_data(self.get_scoped(Subscription, id, kind="subscription")))

    @extend_schema(
        operation_id="subscriptions_update",
        summary="Update a subscription",
        description="Changes only what is given. `items` adds, removes, re-prices or re-quantifies items, "
        "prorating the rest of the current period as `proration_behavior` says (docs/reference/billing-changes.md); "
        "every item keeps the subscription's currency and billing interval. `pause_collection` pauses payment "
        'collection (Stripe\'s shape: `behavior` and `resumes_at`) or, as `null` or `""`, resumes it. While '
        "paused nothing is charged, dunning included; each period that comes due is still invoiced once and "
        "advances, its invoice settled as `behavior` says. A change of items and a pause are separate requests "
        "(422 `pause_with_items` for both in one body: a change may charge an invoice at once, which a pause "
        "in the same request would forbid). `billing_cycle_anchor: now` restarts the billing cycle now: the "
        "unused time is credited and a full period from now invoiced and charged at once (422 codes in the "
        "field's description). 422 `resumes_at_in_past` for a `resumes_at` not after the "
        "subscription's current time; `subscription_canceled` (409 for a change, 422 for a pause) when the "
        "subscription is canceled. `coupon` or `discounts` applies a coupon (`discounts: []` deletes the discount), "
        "in the same transaction as a change of items and before it (a change invoiced at once takes it); 422 "
        "`pause_with_discount` with `pause_collection`.",
        tags=["subscriptions"],
        parameters=[id_path_parameter("subscription")],
        request=s.SubscriptionUpdate,
        responses={200: s.Subscription, 404: ERROR},
    )
    def post(self, request, id):
        data = self.read_body(s.SubscriptionUpdate)
        self.get_scoped(Subscription, id, kind="subscription")
        coupon, coupon_param = coupon_change(data)
        if "cancel_at_period_end" in data:
            return Response(subscription_data(self._update_cancel_at_period_end(id, data, coupon)))
        if "pause_collection" in data:
            if data["billing_cycle_anchor"] != changes.ANCHOR_UNCHANGED:
                raise InvalidRequestError(
                    "Restart the billing cycle and pause collection in separate requests.",
                    code="billing_cycle_anchor_conflict",
                    param="billing_cycle_anchor",
                )
            if coupon is not KEEP:
                raise InvalidRequestError(
                    "Send a discount and a pause of collection as separate requests.",
                    code="pause_with_discount",
                    param="pause_collection",
                )
            if "items" in data:
                raise InvalidRequestError(
                    "Send a change of items and a pause of collection as separate requests.",
                    code="pause_with_items",
                    param="pause_collection",
                )
            return Response(subscription_data(self._update_pause_collection(id, data["pause_collection"])))
        if coupon is not KEEP and "items" not in data and data["billing_cycle_anchor"] == changes.ANCHOR_UNCHANGED:
            subscription = discounts.set_subscription_discount(
                tenant_id=self.tenant.pk,
                livemode=self.livemode,
                subscription_id=id,
                coupon_id=coupon,
                coupon_param=coupon_param,
            )
            return Response(subscription_data(subscription))
        subscription, _invoice = changes.change_subscription(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            subscription_id=id,
            items=data.get("items"),
            proration_behavior=data["proration_behavior"],
            proration_date=data.get("proration_date"),
            effective_at=data["effective_at"],
            billing_cycle_anchor=data["billing_cycle_anchor"],
            coupon=coupon,
            coupon_param=coupon_param,
            request_key=self.idempotency_key,
        )
        return Response(subscription_data(subscription))

    def _update_cancel_at_period_end(self, subscription_id: str, data: dict, coupon: object) -> Subscription:
        """The body's ``cancel_at_period_end``, sent alone (docs/decisions/0199)."""
        others = [
            name
            for name, given in (
                ("items", "items" in data),
                ("pause_collection", "pause_collection" in data),
                ("coupon", coupon is not KEEP),
                ("billing_cycle_anchor", data["billing_cycle_anchor"] != changes.ANCHOR_UNCHANGED),
                ("proration_date", "proration_date" in data),
                ("effective_at", data["effective_at"] != "immediately"),
            )
            if given
        ]
        if others:
            raise InvalidRequestError(
                f"Send cancel_at_period_end and {others[0]} as separate requests.",
                code="cancel_with_changes",
                param="cancel_at_period_end",
            )
        return catalog.set_cancel_at_period_end(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            subscription_id=subscription_id,
            cancel_at_period_end=data["cancel_at_period_end"],
        )

    def _update_pause_collection(self, subscription_id: str, pause_collection: dict | None) -> Subscription:
        """The body's ``pause_collection`` (docs/reference/billing.md#pausing-collection)."""
        return pausing.update_pause_collection(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            subscription_id=subscription_id,
            pause_collection=pause_collection,
        )


class SubscriptionCancelView(ApiView):
    @extend_schema(
        operation_id="subscriptions_cancel",
        summary="Cancel a subscription",
        description="Cancels now (`status=canceled`; the usage of metered items not billed yet, up to now, goes "
        "on a final invoice charged by the next billing tick), or with `at_period_end` at the end of the current "
        "period. 409 when the subscription is already canceled.",
        tags=["subscriptions"],
        parameters=[id_path_parameter("subscription")],
        request=s.SubscriptionCancel,
        responses={200: s.Subscription},
    )
    def post(self, request, id):
        data = self.read_body(s.SubscriptionCancel)
        self.get_scoped(Subscription, id, kind="subscription")
        subscription = changes.cancel_subscription(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            subscription_id=id,
            at_period_end=data["at_period_end"],
            prorate=data["prorate"],
        )
        return Response(subscription_data(subscription))


class InvoiceListView(ApiView):
    get_query = s.InvoiceListQuery

    @extend_schema(
        operation_id="invoices_list",
        summary="List invoices, newest first",
        tags=["invoices"],
        responses=list_of(s.Invoice, "InvoiceList"),
    )
    def get(self, request):
        query = self.read_query()
        invoices = self.filter_by_query(
            self.scoped(Invoice).prefetch_related("lines"),
            query,
            customer="customer_id",
            subscription="subscription_id",
            status="status",
        )
        return self.paginate(invoices, invoice_data, query, kind="invoice")


class InvoiceDetailView(ApiView):
    @extend_schema(
        operation_id="invoices_retrieve",
        summary="Retrieve an invoice",
        tags=["invoices"],
        parameters=[id_path_parameter("invoice")],
        responses=s.Invoice,
    )
    def get(self, request, id):
        return Response(invoice_data(self.get_scoped(Invoice.objects.prefetch_related("lines"), id, kind="invoice")))


class InvoiceUpcomingView(ApiView):
    get_query = s.UpcomingInvoiceQuery

    @extend_schema(
        operation_id="invoices_upcoming",
        summary="Preview a subscription's next invoice",
        description="The lines and totals the next invoice would have, optionally after a proposed change "
        "(`items`, `proration_behavior`, `proration_date`: the same as `POST /v1/subscriptions/{id}`; with "
        "`always_invoice`, the change's own invoice). Writes nothing. Give the preview's `proration_date` "
        "to the change to get exactly these prorations.",
        tags=["invoices"],
        responses={200: s.UpcomingInvoice, 404: ERROR},
    )
    def get(self, request):
        query = self.read_query()
        items = None
        if query.get("items"):
            items = _proposed_items(query["items"])
        invoice, lines = changes.preview_upcoming(
            tenant_id=self.tenant.pk,
            livemode=self.livemode,
            subscription_id=query["subscription"],
            items=items,
            proration_behavior=query["proration_behavior"],
            proration_date=query.get("proration_date"),
        )
        data = invoice_data(invoice, lines=lines)
        data["id"] = None
        for line in data["lines"]:
            line["id"] = None
        return Response(data)


# A JSON array inside a query string: its shape is a rule the OpenAPI document states in prose only.
PROPOSED_ITEMS_CODES = business_rule_codes("items_invalid")
UPDATE_CODES = business_rule_codes("pause_with_items", "pause_with_discount", "cancel_with_changes")


def _proposed_items(raw: str) -> list[dict]:
    """The ``items`` query parameter: a JSON array validated as the update body's ``items``; 422 naming it."""
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError("items must be a JSON array.", code="items_invalid", param="items") from exc
    body = s.SubscriptionUpdate(data={"items": parsed})
    if not body.is_valid():
        # The first fault, named as in a body (items.0.price); the code stays the parameter's own.
        param, _code, message = first_validation_error(body.errors)
        raise InvalidRequestError(message, code="items_invalid", param=param or "items")
    return body.validated_data["items"]
