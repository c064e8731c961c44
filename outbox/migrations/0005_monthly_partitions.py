"""The outbox's history tables partitioned by month of their creation (docs/decisions/0177).

Events and deliveries by their time-ordered ``id``, delivery attempts by their delivery's ``id`` (so
``UNIQUE (delivery_id, number)`` keeps holding and ``ON CONFLICT`` on it keeps working). The foreign
keys between these tables are dropped first: each has its own retention. ``sequence`` stays unique by
its generator (a unique index of a partitioned table must hold the key); its index stays, not unique.
"""

from django.db import migrations, models

from hardcount.partitions import Spec, operation


class Migration(migrations.Migration):
    dependencies = [
        ("outbox", "0004_row_level_security"),
    ]

    operations = [
        migrations.AlterField(
            model_name="delivery",
            name="event",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=models.deletion.CASCADE,
                related_name="deliveries",
                to="outbox.event",
            ),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="replay_of",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=models.deletion.SET_NULL,
                related_name="replays",
                to="outbox.delivery",
            ),
        ),
        migrations.AlterField(
            model_name="deliveryattempt",
            name="delivery",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=models.deletion.CASCADE,
                related_name="attempt_rows",
                to="outbox.delivery",
            ),
        ),
        operation(
            Spec("outbox_event", "id", kind="id", prefix="evt"),
            forward={"outbox_event_sequence_key": "INDEX (sequence)"},
            backward={"outbox_event_sequence_key": "UNIQUE (sequence)"},
        ),
        operation(Spec("outbox_delivery", "id", kind="id", prefix="whd"), forward={}, backward={}),
        operation(
            Spec("outbox_deliveryattempt", "delivery_id", kind="id", prefix="whd"),
            forward={"outbox_deliveryattempt_pkey": "PRIMARY KEY (id, delivery_id)"},
            backward={"outbox_deliveryattempt_pkey": "PRIMARY KEY (id)"},
        ),
    ]
