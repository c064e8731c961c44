import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    # first_sent_at is added without a default first, so the rows already there keep NULL ("sent at an
    # unknown time": looked up, never re-sent, docs/decisions/0129-idempotency-keys-expire.md); only rows
    # inserted from now on take the database's clock.
    dependencies = [
        ("billing", "0003_admin_filter_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="paymentattempt",
            name="first_sent_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="paymentattempt",
            name="first_sent_at",
            field=models.DateTimeField(blank=True, db_default=django.db.models.functions.datetime.Now(), null=True),
        ),
        migrations.AddField(
            model_name="paymentattempt",
            name="payment_intent_status",
            field=models.CharField(blank=True, default="", max_length=32),
        ),
    ]
