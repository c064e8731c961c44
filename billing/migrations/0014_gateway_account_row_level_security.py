"""Row-level security on the gateway accounts (docs/decisions/0130-row-level-security.md, 0132)."""

from django.db import migrations

from hardcount import tenancy


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0013_gateway_account"),
    ]

    operations = [
        migrations.RunSQL(
            tenancy.enable_sql("billing_gatewayaccount", tenancy.OWN_ROWS),
            tenancy.disable_sql("billing_gatewayaccount"),
        )
    ]
