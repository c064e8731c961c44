"""Dunning runs get their schedule state (docs/decisions/0070).

Runs opened by the first version (which only created the row) get the default schedule
anchored at their first decline, their invoice's test clock, and a due time for their next
retry, so the dunning loop takes them over.
"""

import django.db.models.deletion
from django.db import migrations, models

import dunning.models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0002_gateway_fields"),
        ("dunning", "0001_initial"),
        ("hardcount", "0002_idempotency_in_flight"),
    ]

    operations = [
        migrations.AddField(
            model_name="dunningrun",
            name="attempt_started_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="end_reason",
            field=models.CharField(
                blank=True,
                choices=[
                    ("retry_succeeded", "retry_succeeded"),
                    ("paid", "paid"),
                    ("retries_exhausted", "retries_exhausted"),
                    ("no_new_payment_method", "no_new_payment_method"),
                    ("voided", "voided"),
                    ("subscription_canceled", "subscription_canceled"),
                    ("invoice_settled", "invoice_settled"),
                ],
                default="",
                max_length=32,
            ),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="last_error",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="retry_days",
            field=models.JSONField(default=dunning.models.default_retry_days),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="retry_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="schedule_anchor_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="test_clock",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="billing.testclock",
            ),
        ),
        migrations.AddField(
            model_name="dunningrun",
            name="updated_at",
            field=models.DateTimeField(auto_now=True),
        ),
        migrations.RunSQL(
            # IMMEDIATE: the deferred foreign-key check of test_clock_id runs now, so the ALTER TABLEs
            # below do not meet "pending trigger events".
            sql="""
                SET CONSTRAINTS ALL IMMEDIATE;
                UPDATE dunning_dunningrun d
                SET schedule_anchor_at = d.first_declined_at,
                    next_attempt_at = CASE WHEN d.status = 'active' AND d.next_attempt_at IS NULL
                                           THEN d.first_declined_at + interval '1 day'
                                           ELSE d.next_attempt_at END,
                    test_clock_id = COALESCE(s.test_clock_id, c.test_clock_id)
                FROM billing_invoice i
                JOIN billing_customer c ON c.id = i.customer_id
                LEFT JOIN billing_subscription s ON s.id = i.subscription_id
                WHERE i.id = d.invoice_id;
                SET CONSTRAINTS ALL DEFERRED;
            """,
            reverse_sql=migrations.RunSQL.noop,
        ),
        migrations.AlterField(
            model_name="dunningrun",
            name="schedule_anchor_at",
            field=models.DateTimeField(),
        ),
        migrations.AlterField(
            model_name="dunningsettings",
            name="retry_days",
            field=models.JSONField(default=dunning.models.default_retry_days),
        ),
        migrations.AddIndex(
            model_name="dunningrun",
            index=models.Index(fields=["tenant", "livemode", "status"], name="dunning_run_status_idx"),
        ),
        migrations.AddConstraint(
            model_name="dunningrun",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("ended_at__isnull", True), ("status", "active")),
                    models.Q(models.Q(("status", "active"), _negated=True), ("ended_at__isnull", False)),
                    _connector="OR",
                ),
                name="dunning_run_ended_at_iff_not_active",
            ),
        ),
    ]
