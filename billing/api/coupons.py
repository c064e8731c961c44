"""Coupons, and deleting a customer's or a subscription's discount, over HTTP (thin: validate, call a service,
render). docs/reference/discounts.md."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response

from billing import serializers as s
from billing.models import Coupon, Customer, Subscription
from billing.representations import coupon_data, discount_data
from billing.services import discounts
from billing.services.discounts import KEEP
from hardcount.api import ERROR, ApiView, id_path_parameter, list_of
from hardcount.errors import InvalidRequestError

# The param a refused coupon is named by: the body's own field (Stripe names ``discounts[0][coupon]``).
COUPON_PARAM = "coupon"
DISCOUNTS_PARAM = "discounts[0][coupon]"


def coupon_change(data: dict) -> tuple[object, str]:
    """The discount a create or update body asks for, and the param that names it in an error.

    The first is ``KEEP`` (:mod:`billing.services.discounts`), a coupon id, or None (``discounts: []``, delete the
    discount); the second :data:`COUPON_PARAM` or :data:`DISCOUNTS_PARAM`, after the field the body used. Pops
    ``coupon`` and ``discounts`` from ``data``; 422 ``coupon_or_discounts`` for both."""
    coupon = data.pop("coupon", None)
    listed = data.pop("discounts", None)
    if coupon is not None and listed is not None:
        raise InvalidRequestError("Give coupon or discounts, not both.", code="coupon_or_discounts", param="coupon")
    if coupon is not None:
        return coupon, COUPON_PARAM
    if listed is None:
        return KEEP, COUPON_PARAM
    return (listed[0]["coupon"] if listed else None), DISCOUNTS_PARAM


class CouponListView(ApiView):
    get_query = s.CouponListQuery

    @extend_schema(
        operation_id="coupons_create",
        summary="Create a coupon",
        description="`percent_off` or `amount_off` with `currency` (exactly one); `duration` `once`, `repeating` "
        "(with `duration_in_months`) or `forever`. Ids are `co_…`, chosen by the service. 422 `coupon_terms` for "
        "terms that do not go together, `redeem_by_in_past`.",
        tags=["coupons"],
        request=s.CouponCreate,
        responses={201: s.Coupon},
    )
    def post(self, request):
        data = self.read_body(s.CouponCreate)
        coupon = discounts.create_coupon(tenant_id=self.tenant.pk, livemode=self.livemode, **data)
        return Response(coupon_data(coupon), status=status.HTTP_201_CREATED)

    @extend_schema(
        operation_id="coupons_list",
        summary="List coupons, newest first",
        tags=["coupons"],
        responses=list_of(s.Coupon, "CouponList"),
    )
    def get(self, request):
        query = self.read_query()
        return self.paginate(self.scoped(Coupon).filter(deleted_at__isnull=True), coupon_data, query, kind="coupon")


class CouponDetailView(ApiView):
    @extend_schema(
        operation_id="coupons_retrieve",
        summary="Retrieve a coupon",
        tags=["coupons"],
        parameters=[id_path_parameter("coupon")],
        responses=s.Coupon,
    )
    def get(self, request, id):
        return Response(coupon_data(self.get_scoped(Coupon.objects.filter(deleted_at__isnull=True), id, kind="coupon")))

    @extend_schema(
        operation_id="coupons_delete",
        summary="Delete a coupon",
        description="It can no longer be redeemed; the discounts made of it keep applying (Stripe's rule).",
        tags=["coupons"],
        parameters=[id_path_parameter("coupon")],
        responses={200: s.DeletedCoupon, 404: ERROR},
    )
    def delete(self, request, id):
        self.get_scoped(Coupon.objects.filter(deleted_at__isnull=True), id, kind="coupon")
        coupon = discounts.delete_coupon(tenant_id=self.tenant.pk, livemode=self.livemode, coupon_id=id)
        return Response({"id": coupon.id, "object": "coupon", "deleted": True})


def _deleted(discount) -> dict:
    return {**discount_data(discount), "deleted": True}


class CustomerDiscountView(ApiView):
    @extend_schema(
        operation_id="customers_delete_discount",
        summary="Delete a customer's discount",
        description="Invoices whose period starts from now on take no customer discount. 404 when there is none.",
        tags=["customers"],
        parameters=[id_path_parameter("customer")],
        responses={200: s.DeletedDiscount, 404: ERROR},
    )
    def delete(self, request, id):
        self.get_scoped(Customer, id, kind="customer")
        discount = discounts.delete_customer_discount(tenant_id=self.tenant.pk, livemode=self.livemode, customer_id=id)
        return Response(_deleted(discount))


class SubscriptionDiscountView(ApiView):
    @extend_schema(
        operation_id="subscriptions_delete_discount",
        summary="Delete a subscription's discount",
        description="Invoices whose period starts from now on take the customer's discount, if any. 404 when "
        "there is none.",
        tags=["subscriptions"],
        parameters=[id_path_parameter("subscription")],
        responses={200: s.DeletedDiscount, 404: ERROR},
    )
    def delete(self, request, id):
        self.get_scoped(Subscription, id, kind="subscription")
        discount = discounts.delete_subscription_discount(
            tenant_id=self.tenant.pk, livemode=self.livemode, subscription_id=id
        )
        return Response(_deleted(discount))
