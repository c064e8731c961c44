"""Row-level security on the outbox's tables (docs/decisions/0130-row-level-security.md)."""

from django.db import migrations

from hardcount import tenancy

TABLES = {
    "outbox_event": tenancy.OWN_ROWS,
    "outbox_webhookendpoint": tenancy.OWN_ROWS,
    # A delivery's event and endpoint belong to one tenant and mode: the endpoint decides, because
    # an event and its deliveries are written by one statement (outbox.queries), whose policy
    # checks cannot see the event row that statement inserts.
    "outbox_delivery": tenancy.through_parent("outbox_delivery", "endpoint_id", "outbox_webhookendpoint"),
    "outbox_deliveryattempt": tenancy.through_parent("outbox_deliveryattempt", "delivery_id", "outbox_delivery"),
}


class Migration(migrations.Migration):
    dependencies = [
        ("outbox", "0003_admin_filter_indexes"),
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.RunSQL(tenancy.enable_sql(table, condition), tenancy.disable_sql(table))
        for table, condition in TABLES.items()
    ]
