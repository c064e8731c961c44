"""Claims: named, expiring holds kept in a row instead of session advisory locks (decision 0182)."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0007_tenant_business_fields"),
    ]

    operations = [
        migrations.CreateModel(
            name="Claim",
            fields=[
                ("key", models.CharField(max_length=200, primary_key=True, serialize=False)),
                ("holder", models.CharField(max_length=200)),
                ("taken_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("expires_at", models.DateTimeField()),
            ],
        ),
    ]
