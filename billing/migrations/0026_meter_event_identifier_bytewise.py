"""The identifier guard's ``identifier`` compared byte by byte (``COLLATE "C"``, docs/decisions/0229).

Equality, the only thing the guard's primary key decides, is the same under any deterministic collation, so no
row changes meaning. PostgreSQL rewrites the table and rebuilds its primary key: the guard holds only the
identifiers of its retention, so the rewrite is bounded, but it holds an exclusive lock while it runs."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0025_narrower_usage_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="metereventidentifier",
            name="identifier",
            field=models.CharField(db_collation="C", max_length=100),
        ),
    ]
