"""The drain's run-scoped claim marker, and the due-scan index in the claim's (next_billing_at, id) order
(docs/decisions/0187)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0020_usage_on_change"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="subscription",
            name="subscription_due_idx",
        ),
        migrations.AddField(
            model_name="subscription",
            name="claimed_by_run",
            field=models.CharField(blank=True, editable=False, max_length=40, null=True),
        ),
        migrations.AddIndex(
            model_name="subscription",
            index=models.Index(
                condition=models.Q(
                    ("billing_parked_at__isnull", True),
                    ("status__in", ["trialing", "active", "past_due"]),
                    ("test_clock__isnull", True),
                ),
                fields=["livemode", "next_billing_at", "id"],
                name="subscription_due_idx",
            ),
        ),
    ]
