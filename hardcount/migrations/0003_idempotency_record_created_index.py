"""Index idempotency records by ``created_at`` for retention pruning (docs/decisions/0023).

Built ``CONCURRENTLY``: the table has never been pruned, so on a live system it may be large,
and a plain ``CREATE INDEX`` would block every POST carrying an ``Idempotency-Key`` meanwhile.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("hardcount", "0002_idempotency_in_flight"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="idempotencyrecord",
            index=models.Index(fields=["created_at"], name="idempotency_record_created"),
        ),
    ]
