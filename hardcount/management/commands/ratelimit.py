"""``python manage.py ratelimit TENANT [BUCKET --per-s N --burst N | BUCKET --default]``: a tenant's API rate limits.

Without a bucket, prints the limits each bucket applies to the tenant's keys (its own or the
default of ``HARDCOUNT_RATE_LIMITS``). With one, sets the tenant's own limit for it, or with
``--default`` removes it so the default applies again. Takes effect on the keys' next requests
(:mod:`hardcount.ratelimit`, docs/decisions/0128-api-rate-limits.md).
"""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from hardcount import audit
from hardcount.models import RateLimit, Tenant


class Command(BaseCommand):
    help = "Show or set a tenant's API rate limits (per key: a bucket of BURST requests refilled PER_S a second)."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="The tenant's id (ten_…).")
        parser.add_argument("bucket", nargs="?", choices=sorted(settings.HARDCOUNT_RATE_LIMITS), help="The bucket.")
        parser.add_argument("--per-s", type=float, help="Requests per second, sustained (> 0).")
        parser.add_argument("--burst", type=int, help="Requests at once after a pause (>= 1).")
        parser.add_argument("--default", action="store_true", help="Remove the tenant's own limit for BUCKET.")

    def handle(self, *args, tenant: str, bucket: str | None, per_s, burst, default: bool, **options):
        row = Tenant.objects.filter(pk=tenant).first()
        if row is None:
            raise CommandError(f"No such tenant: {tenant!r}.")
        if bucket is None:
            if per_s is not None or burst is not None or default:
                raise CommandError("Name the BUCKET to change.")
        elif default:
            if per_s is not None or burst is not None:
                raise CommandError("--default takes neither --per-s nor --burst.")
            with transaction.atomic():
                if RateLimit.objects.filter(tenant=row, bucket=bucket).delete()[0]:
                    audit.record(
                        audit.RATE_LIMIT_CLEARED,
                        object_type=RateLimit._meta.label_lower,
                        object_id=f"{row.pk}:{bucket}",
                        tenant_id=row.pk,
                        actor=audit.Actor.cli(),
                        message=f"{bucket}: back to the default.",
                    )
        else:
            if per_s is None or burst is None or not per_s > 0 or burst < 1:
                raise CommandError("Give --per-s (> 0) and --burst (>= 1), or --default.")
            with transaction.atomic():
                limit, _ = RateLimit.objects.update_or_create(
                    tenant=row, bucket=bucket, defaults={"per_s": per_s, "burst": burst}
                )
                audit.record(
                    audit.RATE_LIMIT_SET,
                    obj=limit,
                    object_id=f"{row.pk}:{bucket}",  # as when cleared: the tenant's bucket, whatever its row
                    actor=audit.Actor.cli(),
                    message=str(limit),
                )
        self._show(row)

    def _show(self, tenant: Tenant) -> None:
        own = {limit.bucket: limit for limit in RateLimit.objects.filter(tenant=tenant)}
        self.stdout.write(f"Rate limits of {tenant.name} ({tenant.id}), per API key:")
        for bucket, default in sorted(settings.HARDCOUNT_RATE_LIMITS.items()):
            limit = own.get(bucket)
            per_s, burst = (limit.per_s, limit.burst) if limit else (default["per_s"], default["burst"])
            source = "its own" if limit else "default"
            self.stdout.write(f"  {bucket}: {per_s:g}/s, burst {burst} ({source})")
