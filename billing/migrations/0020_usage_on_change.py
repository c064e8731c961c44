"""Usage billed by a change or an immediate cancel: an item's usage start, a customer's billed-until per meter
(docs/decisions/0170), and the usage index carrying the value (docs/decisions/0172)."""

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
        # Rebuilt whole here; on a large table an operator builds it CONCURRENTLY first (decision 0172).
        migrations.RemoveIndex(model_name="meterevent", name="meter_event_usage_idx"),
        migrations.AddIndex(
            model_name="meterevent",
            index=models.Index(
                fields=["tenant", "livemode", "customer", "event_name", "timestamp"],
                include=["value"],
                name="meter_event_usage_idx",
            ),
        ),
    ]
