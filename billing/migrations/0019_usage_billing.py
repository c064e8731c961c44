"""Usage billing: meters, meter events and their identifier guard, metered prices (docs/decisions/0164, 0166).

The new tenant tables get row-level security as every tenant table does (docs/decisions/0130)."""

import django.db.models.deletion
from django.db import migrations, models

import hardcount.ids
from hardcount import tenancy

TABLES = ("billing_meter", "billing_meterevent", "billing_metereventidentifier")


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0018_credit_notes"),
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.CreateModel(
            name="MeterEvent",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "timestamp", "id", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("id", models.CharField(max_length=40)),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="hardcount.tenant",
                    ),
                ),
                (
                    "customer",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="billing.customer",
                    ),
                ),
                ("livemode", models.BooleanField()),
                ("event_name", models.CharField(max_length=100)),
                ("identifier", models.CharField(max_length=100)),
                ("value", models.BigIntegerField(null=True)),
                ("payload", models.JSONField(default=dict)),
                ("timestamp", models.DateTimeField()),
                ("created_at", models.DateTimeField()),
            ],
        ),
        migrations.CreateModel(
            name="MeterEventIdentifier",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "tenant",
                        "livemode",
                        "identifier",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="hardcount.tenant",
                    ),
                ),
                ("livemode", models.BooleanField()),
                ("identifier", models.CharField(max_length=100)),
                ("event_id", models.CharField(max_length=40)),
                ("event_timestamp", models.DateTimeField()),
                ("created_at", models.DateTimeField()),
            ],
        ),
        migrations.AddField(
            model_name="price",
            name="billing_scheme",
            field=models.CharField(
                choices=[("per_unit", "per_unit"), ("tiered", "tiered")], default="per_unit", max_length=8
            ),
        ),
        migrations.AddField(
            model_name="price",
            name="tiers",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="price",
            name="tiers_mode",
            field=models.CharField(blank=True, default="", max_length=10),
        ),
        migrations.AddField(
            model_name="price",
            name="transform_divide_by",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="price",
            name="transform_round",
            field=models.CharField(blank=True, default="", max_length=4),
        ),
        migrations.AddField(
            model_name="price",
            name="usage_type",
            field=models.CharField(
                choices=[("licensed", "licensed"), ("metered", "metered")], default="licensed", max_length=8
            ),
        ),
        migrations.CreateModel(
            name="Meter",
            fields=[
                ("livemode", models.BooleanField()),
                (
                    "id",
                    models.CharField(
                        default=hardcount.ids.IdFactory("mtr"),
                        editable=False,
                        max_length=40,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("display_name", models.CharField(max_length=250)),
                ("event_name", models.CharField(max_length=100)),
                (
                    "formula",
                    models.CharField(
                        choices=[
                            ("sum", "sum"),
                            ("count", "count"),
                            ("max", "max"),
                            ("last", "last"),
                            ("unique_count", "unique_count"),
                        ],
                        max_length=16,
                    ),
                ),
                ("customer_key", models.CharField(default="stripe_customer_id", max_length=100)),
                ("value_key", models.CharField(default="value", max_length=100)),
                ("status", models.CharField(default="active", max_length=16)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="hardcount.tenant"
                    ),
                ),
            ],
        ),
        migrations.AddField(
            model_name="price",
            name="meter",
            field=models.ForeignKey(
                blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="+", to="billing.meter"
            ),
        ),
        migrations.AddConstraint(
            model_name="price",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("meter__isnull", True), ("usage_type", "licensed")),
                    models.Q(("meter__isnull", False), ("usage_type", "metered")),
                    _connector="OR",
                ),
                name="price_metered_has_meter",
            ),
        ),
        migrations.AddConstraint(
            model_name="meter",
            constraint=models.UniqueConstraint(
                fields=("tenant", "livemode", "event_name"), name="meter_one_per_event_name"
            ),
        ),
        migrations.AddIndex(
            model_name="meterevent",
            index=models.Index(
                fields=["tenant", "livemode", "customer", "event_name", "timestamp"], name="meter_event_usage_idx"
            ),
        ),
    ] + [migrations.RunSQL(tenancy.enable_sql(table, tenancy.OWN_ROWS), tenancy.disable_sql(table)) for table in TABLES]
