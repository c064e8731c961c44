"""Coupons and discounts (docs/reference/discounts.md, docs/decisions/0152-0155), with row-level security."""

import django.db.models.deletion
import django.db.models.expressions
from django.db import migrations, models

import hardcount.ids
from hardcount import tenancy


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0016_proration_inputs_and_cycle_restart"),
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.CreateModel(
            name="Coupon",
            fields=[
                ("livemode", models.BooleanField()),
                (
                    "id",
                    models.CharField(
                        default=hardcount.ids.IdFactory("co"),
                        editable=False,
                        max_length=40,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("name", models.CharField(blank=True, default="", max_length=40)),
                ("percent_off", models.DecimalField(blank=True, decimal_places=2, max_digits=5, null=True)),
                ("amount_off", models.BigIntegerField(blank=True, null=True)),
                ("currency", models.CharField(blank=True, default="", max_length=3)),
                (
                    "duration",
                    models.CharField(
                        choices=[("once", "once"), ("repeating", "repeating"), ("forever", "forever")], max_length=12
                    ),
                ),
                ("duration_in_months", models.PositiveIntegerField(blank=True, null=True)),
                ("max_redemptions", models.PositiveIntegerField(blank=True, null=True)),
                ("redeem_by", models.DateTimeField(blank=True, null=True)),
                ("times_redeemed", models.PositiveIntegerField(default=0)),
                ("metadata", models.JSONField(blank=True, default=dict)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("deleted_at", models.DateTimeField(blank=True, null=True)),
            ],
        ),
        migrations.CreateModel(
            name="Discount",
            fields=[
                ("livemode", models.BooleanField()),
                (
                    "id",
                    models.CharField(
                        default=hardcount.ids.IdFactory("di"),
                        editable=False,
                        max_length=40,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("start", models.DateTimeField()),
                ("end", models.DateTimeField(blank=True, null=True)),
                ("deleted_at", models.DateTimeField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
        migrations.RemoveConstraint(
            model_name="invoice",
            name="invoice_total_is_subtotal_plus_tax",
        ),
        migrations.AddField(
            model_name="invoice",
            name="total_discount",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="invoicelineitem",
            name="discount_amount",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="coupon",
            name="tenant",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="+", to="hardcount.tenant"
            ),
        ),
        migrations.AddField(
            model_name="discount",
            name="coupon",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="discounts", to="billing.coupon"
            ),
        ),
        migrations.AddField(
            model_name="discount",
            name="customer",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="+", to="billing.customer"
            ),
        ),
        migrations.AddField(
            model_name="discount",
            name="invoice",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.invoice",
            ),
        ),
        migrations.AddField(
            model_name="discount",
            name="subscription",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.subscription",
            ),
        ),
        migrations.AddField(
            model_name="discount",
            name="tenant",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="+", to="hardcount.tenant"
            ),
        ),
        migrations.AddField(
            model_name="customer",
            name="discount",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.discount",
            ),
        ),
        migrations.AddField(
            model_name="invoice",
            name="discount",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.discount",
            ),
        ),
        migrations.AddField(
            model_name="subscription",
            name="discount",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.discount",
            ),
        ),
        migrations.AddConstraint(
            model_name="invoice",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "total",
                        django.db.models.expressions.CombinedExpression(
                            django.db.models.expressions.CombinedExpression(
                                models.F("subtotal"), "-", models.F("total_discount")
                            ),
                            "+",
                            models.F("tax"),
                        ),
                    )
                ),
                name="invoice_total_is_subtotal_less_discount_plus_tax",
            ),
        ),
        migrations.AddIndex(
            model_name="coupon",
            index=models.Index(fields=["tenant", "livemode", "id"], name="coupon_scope_idx"),
        ),
        migrations.AddConstraint(
            model_name="coupon",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("amount_off__isnull", True),
                        ("currency", ""),
                        ("percent_off__gt", 0),
                        ("percent_off__lte", 100),
                    ),
                    models.Q(
                        ("amount_off__gt", 0), ("percent_off__isnull", True), models.Q(("currency", ""), _negated=True)
                    ),
                    _connector="OR",
                ),
                name="coupon_percent_xor_amount",
            ),
        ),
        migrations.AddConstraint(
            model_name="coupon",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("duration", "repeating"), ("duration_in_months__gte", 1)),
                    models.Q(models.Q(("duration", "repeating"), _negated=True), ("duration_in_months__isnull", True)),
                    _connector="OR",
                ),
                name="coupon_repeating_has_months",
            ),
        ),
        migrations.AddConstraint(
            model_name="coupon",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("max_redemptions__isnull", True),
                    ("times_redeemed__lte", models.F("max_redemptions")),
                    _connector="OR",
                ),
                name="coupon_redemptions_within_max",
            ),
        ),
        migrations.AddIndex(
            model_name="discount",
            index=models.Index(fields=["customer", "start"], name="discount_customer_idx"),
        ),
        migrations.AddIndex(
            model_name="discount",
            index=models.Index(fields=["subscription", "start"], name="discount_subscription_idx"),
        ),
        migrations.RunSQL(
            tenancy.enable_sql("billing_coupon", tenancy.OWN_ROWS), tenancy.disable_sql("billing_coupon")
        ),
        migrations.RunSQL(
            tenancy.enable_sql("billing_discount", tenancy.OWN_ROWS), tenancy.disable_sql("billing_discount")
        ),
    ]
