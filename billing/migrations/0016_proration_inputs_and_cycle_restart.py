"""A proration's inputs on its invoice item, and the anchor an invoice's restarted cycle replaced.

docs/decisions/0146 (the doctor recomputes every proration from its inputs) and 0147
(``billing_cycle_anchor=now``). Proration items written before this migration get their inputs
back from what they imply: the full amount is ``±quantity × unit amount`` (the sign of the
item's amount), the remaining time the item's own period ``[at, end)``, and the period the
subscription's billing period that ends at ``end`` (no anchor had been moved yet).
"""

from datetime import UTC

from dateutil.relativedelta import relativedelta
from django.db import migrations, models

_STEPS = {"day": "days", "week": "weeks", "month": "months", "year": "years"}


def _period_seconds(anchor, interval, count, end):
    """Seconds of the period of the cycle (``anchor + n × count interval``) that ends at ``end``; None if none does."""
    anchor = anchor.astimezone(UTC)
    n = 0
    while True:
        start = anchor + relativedelta(**{_STEPS[interval]: count * n})
        stop = anchor + relativedelta(**{_STEPS[interval]: count * (n + 1)})
        if stop == end:
            return int((stop - start).total_seconds())
        if stop > end:
            return None
        n += 1


def backfill(apps, schema_editor):
    InvoiceItem = apps.get_model("billing", "InvoiceItem")
    rows = InvoiceItem.objects.filter(proration=True, proration_period_s__isnull=True).select_related(
        "price", "subscription__price"
    )
    for item in rows.iterator():
        if item.price is None or item.subscription is None:
            continue
        price = item.subscription.price
        period_s = _period_seconds(
            item.subscription.billing_cycle_anchor, price.interval, price.interval_count, item.period_end
        )
        if period_s is None:
            continue
        item.proration_full_amount = (1 if item.amount > 0 else -1) * item.quantity * item.price.amount
        item.proration_remaining_s = int((item.period_end - item.period_start).total_seconds())
        item.proration_period_s = period_s
        item.save(update_fields=["proration_full_amount", "proration_remaining_s", "proration_period_s"])


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0015_invoice_hosted_url_version"),
    ]

    operations = [
        migrations.AddField(
            model_name="invoiceitem",
            name="proration_full_amount",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="invoiceitem",
            name="proration_remaining_s",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="invoiceitem",
            name="proration_period_s",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="invoice",
            name="previous_billing_cycle_anchor",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
