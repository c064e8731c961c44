"""Billing's history tables partitioned by month (docs/decisions/0177).

Billing attempts by their time-ordered ``id``; payment attempts by their invoice's ``id`` (so
``UNIQUE (invoice_id, attempt_number)`` and the one-success index keep holding across the table);
meter events by ``timestamp``, the key their primary key ``(timestamp, id)`` was made for
(docs/decisions/0164). Nothing references these tables by a foreign key.
"""

from django.db import migrations

from hardcount.partitions import Spec, operation


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0021_drain_claims"),
    ]

    operations = [
        operation(Spec("billing_billingattempt", "id", kind="id", prefix="batt"), forward={}, backward={}),
        operation(
            Spec("billing_paymentattempt", "invoice_id", kind="id", prefix="in"),
            forward={"billing_paymentattempt_pkey": "PRIMARY KEY (id, invoice_id)"},
            backward={"billing_paymentattempt_pkey": "PRIMARY KEY (id)"},
        ),
        operation(Spec("billing_meterevent", "timestamp", kind="time"), forward={}, backward={}),
    ]
