"""``python manage.py createtenant NAME [--json]``: a new tenant with one test and one live key."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from hardcount import audit
from hardcount.models import ApiKey, Tenant


class Command(BaseCommand):
    help = "Create a tenant with one test-mode and one live-mode API key, and print the keys (shown only once)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="The tenant's display name.")
        parser.add_argument("--json", action="store_true", help="Print one JSON object (for scripts).")

    def handle(self, *args, name: str, json: bool = False, **options):
        name = name.strip()
        if not name or len(name) > Tenant._meta.get_field("name").max_length:
            raise CommandError("NAME must be 1 to 200 characters.")
        actor = audit.Actor.cli()
        with transaction.atomic():
            tenant = Tenant.objects.create(name=name)
            test_row, test_key = ApiKey.issue(tenant, livemode=False)
            live_row, live_key = ApiKey.issue(tenant, livemode=True)
            audit.record(audit.TENANT_CREATED, obj=tenant, actor=actor, message=f"Created tenant {tenant.name}.")
            for row in (test_row, live_row):
                audit.record(audit.API_KEY_ISSUED, obj=row, actor=actor, message=f"Issued {row} with tenant {name}.")
        if json:
            self.stdout.write(
                _dumps(
                    {
                        "tenant": {"id": tenant.id, "name": tenant.name},
                        "test_key": {"id": test_row.id, "secret": test_key},
                        "live_key": {"id": live_row.id, "secret": live_key},
                    }
                )
            )
            return
        self.stdout.write(f"Tenant {tenant.name} ({tenant.id})")
        self.stdout.write(f"  test key: {test_key}")
        self.stdout.write(f"  live key: {live_key}")
        self.stdout.write("Keys are shown once; only their hashes are stored.")


def _dumps(value) -> str:
    return json.dumps(value, indent=2)
