"""Row-level security: the API's role and the kernel's tenant tables (docs/decisions/0130-row-level-security.md)."""

from django.db import migrations

from hardcount import tenancy

# The key lookup runs as the connecting role, before the request switches to the tenant role;
# under the tenant role a request sees only its own tenant, keys and idempotency records.
TABLES = {
    "hardcount_tenant": tenancy.OWN_TENANT,
    "hardcount_apikey": tenancy.OWN_ROWS,
    "hardcount_idempotencyrecord": tenancy.OWN_ROWS,
    # A request records its own key and secret changes (an endpoint created, updated, deleted).
    # Append-only all the same: the table's trigger refuses UPDATE and DELETE for every role.
    "hardcount_auditlogentry": tenancy.OWN_TENANT_ROWS,
}


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0005_audit_log"),
    ]

    operations = [
        migrations.RunSQL(tenancy.create_role_sql(), tenancy.drop_grants_sql()),
        # A tenant's rate limits are read by the limiter before a request switches to the tenant
        # role: under it they are closed altogether (a policy, and no grant).
        migrations.RunSQL(
            "ALTER TABLE hardcount_ratelimit ENABLE ROW LEVEL SECURITY;"
            f" CREATE POLICY tenant_isolation ON hardcount_ratelimit USING ({tenancy.OWN_TENANT_ROWS});",
            "DROP POLICY IF EXISTS tenant_isolation ON hardcount_ratelimit;"
            " ALTER TABLE hardcount_ratelimit DISABLE ROW LEVEL SECURITY;",
        ),
        *(
            migrations.RunSQL(tenancy.enable_sql(table, condition), tenancy.disable_sql(table))
            for table, condition in TABLES.items()
        ),
    ]
