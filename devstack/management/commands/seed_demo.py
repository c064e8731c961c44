"""``python manage.py seed_demo [--subscriptions N] [--seed N] [--tenant NAME]``: the demo book (devstack/seed.py).

Without ``--tenant`` the book goes to ``make run``'s demo tenant (its keys kept in
``var/demo-keys.json``, created if missing), so the next ``make run`` serves and bills it. A
tenant that already has test-mode subscriptions is left alone unless ``--force`` adds a second book.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from billing.models import Subscription
from devstack import demo as demo_credentials
from devstack.seed import FAILING_WEBHOOK_URL, seed_demo_book
from hardcount.models import ApiKey, Tenant

DEFAULT_SUBSCRIPTIONS = 20_000


class Command(BaseCommand):
    help = "Seed a realistic, deterministic test-mode book of due subscriptions for a demo tenant."

    def add_arguments(self, parser):
        parser.add_argument("--subscriptions", type=int, default=DEFAULT_SUBSCRIPTIONS, help="how many (default 20000)")
        parser.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same book")
        parser.add_argument(
            "--tenant", default=None, help="tenant name (created if missing); default: make run's demo tenant"
        )
        parser.add_argument(
            "--webhook-url",
            default=None,
            help="the working webhook endpoint (default: make run's receiver, if one was registered)",
        )
        parser.add_argument(
            "--now",
            default=None,
            help="ISO 8601 instant the book is due at (default: the database's now()); for reproducible books",
        )
        parser.add_argument("--force", action="store_true", help="seed even if the tenant already has subscriptions")

    def handle(self, *args, subscriptions: int, seed: int, tenant: str | None, webhook_url, now, force, **options):
        if not 0 < subscriptions <= 1_000_000:
            raise CommandError("--subscriptions must be from 1 to 1000000.")
        as_of = _parse_now(now)
        tenant_id, webhook_url = self._tenant(tenant, webhook_url)
        if not force and Subscription.objects.filter(tenant_id=tenant_id, livemode=False).exists():
            raise CommandError(f"Tenant {tenant_id} already has test-mode subscriptions; --force adds another book.")
        started = time.perf_counter()
        summary = seed_demo_book(
            tenant_id=tenant_id, subscriptions=subscriptions, seed=seed, now=as_of, webhook_url=webhook_url
        )
        elapsed = time.perf_counter() - started
        self.stdout.write(
            f"Seeded {summary.subscriptions} subscriptions for tenant {tenant_id} in {elapsed:.1f} s: "
            f"{summary.due} due now ({summary.due_declining} with a card that declines, {summary.due_failing} with "
            f"one that fails at the gateway), {summary.trialing} trialing, {summary.credit_balances} credit balances, "
            f"{summary.events} events."
        )
        endpoints = "a receiver at " + webhook_url + " and " if webhook_url else "(no receiver URL known) "
        self.stdout.write(
            f"Webhook endpoints: {endpoints}one that always fails ({FAILING_WEBHOOK_URL}, on purpose: nothing listens "
            "there, so its deliveries show retries and the circuit breaker)."
        )

    def _tenant(self, name: str | None, webhook_url: str | None) -> tuple[str, str | None]:
        if name is None:
            keys_path = Path(settings.VAR_DIR) / "demo-keys.json"
            demo = demo_credentials.ensure_demo_tenant(keys_path)
            if webhook_url is None:
                webhook_url = ((demo.extra.get("webhook_endpoints") or {}).get("test") or {}).get("url")
            self.stdout.write(f"Demo tenant {demo.tenant_id} (make run's; keys in {keys_path}).")
            return demo.tenant_id, webhook_url
        name = name.strip()
        if not name or len(name) > Tenant._meta.get_field("name").max_length:
            raise CommandError("--tenant must be 1 to 200 characters.")
        existing = Tenant.objects.filter(name=name).order_by("-created_at").first()
        if existing is not None:
            return existing.id, webhook_url
        created = Tenant.objects.create(name=name)
        _, test_key = ApiKey.issue(created, livemode=False)
        self.stdout.write(f"Created tenant {name} ({created.id}); test key (shown once): {test_key}")
        return created.id, webhook_url


def _parse_now(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(f"--now must be an ISO 8601 instant, got {value!r}.") from None
    if parsed.tzinfo is None:
        raise CommandError("--now needs a UTC offset (e.g. 2027-03-01T00:00:00Z).")
    return parsed
