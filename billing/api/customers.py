"""``POST /v1/customers/{id}``: change a customer (thin: validate, call the service, render).

Mixed into :class:`billing.api.catalog.CustomerDetailView`, which serves ``GET`` on the same path.
"""

from __future__ import annotations

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from billing import serializers as out
from billing.api.coupons import coupon_change
from billing.representations import customer_data
from billing.serializers import coupon_field, discounts_field
from billing.services.customers import update_customer
from billing.services.discounts import KEEP
from hardcount.api import MetadataField, StrictCharField, StrictEmailField, StrictSerializer, id_path_parameter, is_id
from hardcount.errors import ResourceMissing


class CustomerUpdate(StrictSerializer):
    """Fields to change; those left out keep their value."""

    email = StrictEmailField(max_length=254, required=False)
    name = StrictCharField(max_length=200, required=False, allow_blank=True)
    external_id = StrictCharField(
        max_length=200, required=False, allow_blank=True, help_text="Your own id for this customer."
    )
    default_payment_method = StrictCharField(
        max_length=255,
        required=False,
        validators=[RegexValidator(r"^pm_[A-Za-z0-9_]+$", "Must be a Stripe PaymentMethod id (pm_…).")],
        help_text="Stripe PaymentMethod id (`pm_…`). A new one makes every invoice of the customer in dunning "
        "retry at once with it, including one waiting after a hard decline.",
    )
    metadata = MetadataField(required=False, help_text="Replaces the whole set of keys.")
    coupon = coupon_field()
    discounts = discounts_field()


class CustomerUpdateMixin:
    """The ``post`` handler of the customer detail view."""

    @extend_schema(
        operation_id="customers_update",
        summary="Update a customer",
        description="Changes the fields given (emits `customer.updated` when something changed). A new "
        "`default_payment_method` retries every invoice of the customer that is in dunning at once. "
        "`coupon` or `discounts` applies a coupon (`customer.discount.created`); `discounts: []` deletes the discount.",
        tags=["customers"],
        request=CustomerUpdate,
        parameters=[id_path_parameter("customer")],
        responses={200: out.Customer},
    )
    def post(self, request, id):
        data = self.read_body(CustomerUpdate)
        if not is_id("customer", id):
            raise ResourceMissing(f"No such customer: '{id}'.")
        coupon, coupon_param = coupon_change(data)
        if coupon is not KEEP:
            data["coupon"] = coupon
            data["coupon_param"] = coupon_param
        customer = update_customer(tenant_id=self.tenant.pk, livemode=self.livemode, customer_id=id, **data)
        return Response(customer_data(customer))
