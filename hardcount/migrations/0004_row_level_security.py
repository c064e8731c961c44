"""Row-level security: the API's role and the kernel's tenant tables (docs/decisions/0130-row-level-security.md)."""

from django.db import migrations

from hardcount import tenancy

# The key lookup runs as the connecting role, before the request switches to the tenant role;
# under the tenant role a request sees only its own tenant, keys and idempotency records.
TABLES = {
    "hardcount_tenant": tenancy.OWN_TENANT,
    "hardcount_apikey": tenancy.OWN_ROWS,
    "hardcount_idempotencyrecord": tenancy.OWN_ROWS,
}


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0003_idempotency_record_created_index"),
    ]

    operations = [
        migrations.RunSQL(tenancy.create_role_sql(), tenancy.drop_grants_sql()),
        *(
            migrations.RunSQL(tenancy.enable_sql(table, condition), tenancy.disable_sql(table))
            for table, condition in TABLES.items()
        ),
    ]
