"""The identifier guard's ``identifier`` compared byte by byte (``COLLATE "C"``, docs/decisions/0229).

Equality, the only thing the guard's primary key decides, is the same under any deterministic collation, so no
row changes meaning. PostgreSQL rebuilds the primary key (the column's type is unchanged, so the table is not
rewritten): the guard holds only the identifiers of its retention, so the rebuild is bounded, but it holds an
exclusive lock that stops ingest while it runs; migrate at a quiet hour."""

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
