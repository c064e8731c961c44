"""Usage billed by a change or an immediate cancel: an item's usage start, a customer's billed-until per meter
(docs/decisions/0170)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0019_usage_billing"),
    ]

    operations = [
        migrations.AddField(
            model_name="subscriptionitem",
            name="usage_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="customer",
            name="usage_billed_until",
            field=models.JSONField(blank=True, default=dict),
        ),
    ]
