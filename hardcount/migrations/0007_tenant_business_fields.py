"""A tenant's business details, printed as the seller on its customers' invoice documents (decision 0162)."""

from django.db import migrations, models


def _text(max_length: int):
    return models.CharField(max_length=max_length, blank=True, default="")


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.AddField("tenant", "business_name", _text(200)),
        migrations.AddField("tenant", "address_line1", _text(200)),
        migrations.AddField("tenant", "address_line2", _text(200)),
        migrations.AddField("tenant", "city", _text(100)),
        migrations.AddField("tenant", "postal_code", _text(20)),
        migrations.AddField("tenant", "state", _text(100)),
        migrations.AddField("tenant", "country", _text(2)),
    ]
