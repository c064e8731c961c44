"""API rate limits (docs/decisions/0128-api-rate-limits.md): tenants' own limits and the token buckets.

The buckets' table is UNLOGGED: no WAL per request, and a crash only empties it (every bucket
full again), which a rate limit can afford. Its rows are not on standbys either; a promoted
standby starts with full buckets.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0003_idempotency_record_created_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateLimitBucket",
            fields=[
                ("id", models.CharField(max_length=80, primary_key=True, serialize=False)),
                ("bucket", models.CharField(max_length=32)),
                ("per_s", models.FloatField()),
                ("burst", models.FloatField()),
                ("tokens", models.FloatField()),
                ("allowed", models.BooleanField()),
                ("updated_at", models.DateTimeField()),
                (
                    "api_key",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="+", to="hardcount.apikey"
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="RateLimit",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("bucket", models.CharField(max_length=32)),
                ("per_s", models.FloatField(help_text="Tokens added per second (requests per second sustained).")),
                (
                    "burst",
                    models.PositiveIntegerField(help_text="The bucket's size: requests allowed at once after a pause."),
                ),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="rate_limits",
                        to="hardcount.tenant",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("tenant", "bucket"), name="rate_limit_unique_bucket"),
                    models.CheckConstraint(condition=models.Q(("per_s__gt", 0)), name="rate_limit_positive_rate"),
                    models.CheckConstraint(condition=models.Q(("burst__gte", 1)), name="rate_limit_burst_at_least_one"),
                ],
            },
        ),
        migrations.RunSQL(
            "ALTER TABLE hardcount_ratelimitbucket SET UNLOGGED",
            reverse_sql="ALTER TABLE hardcount_ratelimitbucket SET LOGGED",
        ),
    ]
