"""Row-level security on billing's tables (docs/decisions/0130-row-level-security.md)."""

from django.db import migrations

from hardcount import tenancy

# A scheduler run (tenant_id null) is shared: a tenant sees it once it attempted one of the
# tenant's subscriptions (the attempts' own policy applies inside the EXISTS), as the API shows it.
_SHARED_RUN = (
    "tenant_id IS NULL AND livemode = NULLIF(current_setting('hardcount.livemode', true), '')::boolean"
    " AND EXISTS (SELECT 1 FROM billing_billingattempt a WHERE a.run_id = billing_billingrun.id)"
)

# table: (USING, WITH CHECK or None for the same)
TABLES = {
    "billing_testclock": (tenancy.OWN_ROWS, None),
    "billing_customer": (tenancy.OWN_ROWS, None),
    "billing_price": (tenancy.OWN_ROWS, None),
    "billing_subscription": (tenancy.OWN_ROWS, None),
    "billing_invoice": (tenancy.OWN_ROWS, None),
    "billing_invoicecounter": (tenancy.OWN_ROWS, None),
    "billing_ledgerentry": (tenancy.OWN_ROWS, None),
    "billing_paymentattempt": (tenancy.OWN_ROWS, None),
    "billing_invoicelineitem": (
        tenancy.through_parent("billing_invoicelineitem", "invoice_id", "billing_invoice"),
        None,
    ),
    "billing_billingattempt": (
        tenancy.through_parent("billing_billingattempt", "subscription_id", "billing_subscription"),
        None,
    ),
    # A tenant never writes a scheduler run.
    "billing_billingrun": (f"({tenancy.OWN_ROWS}) OR ({_SHARED_RUN})", tenancy.OWN_ROWS),
}


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0005_billing_run_lease_role"),
        ("hardcount", "0006_row_level_security"),
    ]

    operations = [
        migrations.RunSQL(tenancy.enable_sql(table, using, check), tenancy.disable_sql(table))
        for table, (using, check) in TABLES.items()
    ]
