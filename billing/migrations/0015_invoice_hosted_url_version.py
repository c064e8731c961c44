"""The version the hosted invoice page's token is signed over: one more revokes the earlier URLs (decision 0161)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0014_gateway_account_row_level_security"),
    ]

    operations = [
        migrations.AddField("invoice", "hosted_url_version", models.PositiveIntegerField(default=0)),
    ]
