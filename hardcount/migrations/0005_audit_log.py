"""The operators' audit log (hardcount.audit, docs/security.md), append-only in the database.

A trigger refuses every UPDATE and DELETE of a row, whoever sends it: the application's own
code, the ORM's bulk operations, a psql session with the application's role. TRUNCATE is left
to the table's privileges (the test suite empties tables with it between transactional tests).
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("hardcount", "0004_rate_limits"),
    ]

    operations = [
        migrations.CreateModel(
            name="AuditLogEntry",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                (
                    "actor_type",
                    models.CharField(
                        choices=[("user", "user"), ("api_key", "API key"), ("cli", "command line")], max_length=16
                    ),
                ),
                ("actor_id", models.CharField(max_length=150)),
                ("actor_label", models.CharField(blank=True, max_length=150)),
                ("action", models.CharField(max_length=64)),
                ("object_type", models.CharField(max_length=100)),
                ("object_id", models.CharField(blank=True, max_length=255)),
                ("tenant_id", models.CharField(blank=True, max_length=40)),
                ("message", models.TextField(blank=True)),
                ("remote_addr", models.CharField(max_length=64)),
            ],
            options={
                "verbose_name": "audit log entry",
                "verbose_name_plural": "audit log",
                "indexes": [
                    models.Index(fields=["actor_type", "actor_id"], name="audit_log_actor"),
                    models.Index(fields=["object_type", "object_id"], name="audit_log_object"),
                    models.Index(fields=["action"], name="audit_log_action"),
                    models.Index(fields=["tenant_id"], name="audit_log_tenant"),
                    models.Index(fields=["created_at"], name="audit_log_created"),
                ],
            },
        ),
        migrations.RunSQL(
            """
            CREATE FUNCTION hardcount_audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'hardcount_auditlogentry is append-only: % refused', TG_OP
                    USING ERRCODE = 'restrict_violation';
            END
            $$;
            CREATE TRIGGER hardcount_auditlogentry_append_only
                BEFORE UPDATE OR DELETE ON hardcount_auditlogentry
                FOR EACH ROW EXECUTE FUNCTION hardcount_audit_log_append_only();
            """,
            reverse_sql="""
            DROP TRIGGER hardcount_auditlogentry_append_only ON hardcount_auditlogentry;
            DROP FUNCTION hardcount_audit_log_append_only();
            """,
        ),
    ]
