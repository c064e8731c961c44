"""The usage index without the tenant and mode before the customer (docs/decisions/0218, 0222).

Created on the partitioned parent, which PostgreSQL builds on every partition and on each one created later.
Built whole here; on a large table an operator builds it on each partition CONCURRENTLY first and attaches
those (decision 0172)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0024_usage_guard_and_held_invoices"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="meterevent", name="meter_event_usage_idx"),
        migrations.AddIndex(
            model_name="meterevent",
            index=models.Index(
                fields=["customer", "event_name", "timestamp"],
                include=["value"],
                name="meter_event_customer_usage_idx",
            ),
        ),
    ]
