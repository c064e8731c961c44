"""Every existing subscription gets one item (its price, quantity 1), and the new tables get row-level
security as every tenant-owned table has (docs/decisions/0130-row-level-security.md, 0140)."""

from django.db import migrations

from hardcount import tenancy

# Deterministic ids of the layout of hardcount.ids ("si_" and 26 characters of the alphabet: md5's hex digits).
_BACKFILL = """
INSERT INTO billing_subscriptionitem (id, tenant_id, livemode, subscription_id, price_id, quantity, created_at)
SELECT 'si_' || substr(md5(s.id || ':item'), 1, 26), s.tenant_id, s.livemode, s.id, s.price_id, 1, s.created_at
FROM billing_subscription s
WHERE NOT EXISTS (SELECT 1 FROM billing_subscriptionitem i WHERE i.subscription_id = s.id)
"""

TABLES = {
    "billing_subscriptionitem": tenancy.OWN_ROWS,
    "billing_invoiceitem": tenancy.OWN_ROWS,
}


class Migration(migrations.Migration):
    dependencies = [("billing", "0009_subscription_items")]

    operations = [
        migrations.RunSQL(_BACKFILL, migrations.RunSQL.noop),
        *(
            migrations.RunSQL(tenancy.enable_sql(table, using), tenancy.disable_sql(table))
            for table, using in TABLES.items()
        ),
    ]
