"""Row-level security on dunning's tables (docs/decisions/0130-row-level-security.md)."""

from django.db import migrations

from hardcount import tenancy

TABLES = ["dunning_dunningsettings", "dunning_dunningrun"]


class Migration(migrations.Migration):
    dependencies = [
        ("dunning", "0002_schedule_state"),
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.RunSQL(tenancy.enable_sql(table, tenancy.OWN_ROWS), tenancy.disable_sql(table)) for table in TABLES
    ]
