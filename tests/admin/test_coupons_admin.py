"""Coupons and their redemptions (discounts) in the console: listed read-only with their terms and counts, found by
id; changed only through the API's services (docs/reference/discounts.md#operators)."""

from decimal import Decimal

from django.urls import reverse

from billing.models import Coupon, Discount
from billing.services import discounts


def test_coupons_and_their_redemptions_are_listed_with_terms_and_counts_and_cannot_be_changed(book, operator):
    tenant = book.tenant()
    quarter = discounts.create_coupon(
        tenant_id=tenant.id,
        livemode=False,
        percent_off=Decimal("25"),
        duration="repeating",
        duration_in_months=3,
        max_redemptions=3,
        name="Spring",
    )
    five = discounts.create_coupon(tenant_id=tenant.id, livemode=False, amount_off=500, currency="usd", duration="once")
    first, second = book.subscribed(tenant), book.subscribed(tenant)
    for sub in (first, second):
        discounts.set_subscription_discount(
            tenant_id=tenant.id, livemode=False, subscription_id=sub.id, coupon_id=quarter.id
        )
    discounts.set_customer_discount(
        tenant_id=tenant.id, livemode=False, customer_id=first.customer_id, coupon_id=five.id
    )

    listed = operator.get(reverse("admin:billing_coupon_changelist")).content.decode()
    # 25 % redeemed twice of three; $5.00 once of no limit.
    assert "Spring" in listed and "25 %" in listed and "2 / 3" in listed
    assert "$5.00" in listed and "1 / ∞" in listed

    redemptions = operator.get(reverse("admin:billing_discount_changelist")).content.decode()
    for discount in Discount.objects.all():
        assert discount.id in redemptions
    assert Discount.objects.count() == 3
    # Found by the coupon's id: its two redemptions, not the other coupon's.
    found = operator.get(reverse("admin:billing_discount_changelist"), {"q": quarter.id}).content.decode()
    assert {d.id for d in Discount.objects.filter(coupon=quarter)} == {
        d for d in Discount.objects.values_list("id", flat=True) if d in found
    }

    # Read-only: no add, no change, no delete from the console.
    assert operator.get(reverse("admin:billing_coupon_add")).status_code == 403
    response = operator.post(reverse("admin:billing_coupon_change", args=[quarter.pk]), {"name": "Changed"})
    assert response.status_code == 403 and Coupon.objects.get(pk=quarter.pk).name == "Spring"
    assert operator.post(reverse("admin:billing_coupon_delete", args=[quarter.pk]), {"post": "yes"}).status_code == 403
    assert Coupon.objects.filter(pk=quarter.pk).exists()
