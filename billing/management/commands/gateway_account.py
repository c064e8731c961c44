"""``python manage.py gateway_account --tenant ten_… --mode test|live …``: a tenant's Stripe account.

``--show`` (the default) prints it masked; ``--secret-key sk_…`` or ``--connect-account acct_…``
with ``--webhook-secret whsec_…`` sets it (a value ``-`` is read from a line of standard input, so
secrets need not sit in the shell's history); ``--delete`` removes it (charges go to the
platform's account again). Every change is in the audit log, as the operating-system user, never
with a secret (:mod:`billing.gateway_accounts`, docs/decisions/0132-gateway-accounts.md).
"""

from __future__ import annotations

import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from billing import gateway_accounts as accounts
from hardcount import audit
from hardcount.errors import ServiceError
from hardcount.models import Tenant


class Command(BaseCommand):
    help = "Show, set or remove a tenant's own Stripe account in one mode (secrets shown masked only)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="The tenant's id (ten_…).")
        parser.add_argument("--mode", required=True, choices=["test", "live"], help="The account's mode.")
        what = parser.add_mutually_exclusive_group()
        what.add_argument("--secret-key", help="The account's sk_…/rk_… key of that mode ('-': read from stdin).")
        what.add_argument("--connect-account", help="A Connect account id (acct_…), charged with the platform key.")
        what.add_argument("--delete", action="store_true", help="Remove the account.")
        what.add_argument("--show", action="store_true", help="Print the account, masked (the default).")
        parser.add_argument("--webhook-secret", help="The whsec_… of its Stripe webhook endpoint ('-': from stdin).")

    def handle(self, *args, tenant: str, mode: str, secret_key, connect_account, delete: bool, webhook_secret, **_):
        row = Tenant.objects.filter(pk=tenant).first()
        if row is None:
            raise CommandError(f"No such tenant: {tenant!r}.")
        livemode = mode == "live"
        if delete:
            with transaction.atomic():
                account = accounts.delete_account(tenant_id=row.pk, livemode=livemode)
                if account is None:
                    raise CommandError(f"{row.pk} has no gateway account in {mode} mode.")
                audit.record(
                    accounts.AUDIT_DELETED,
                    obj=account,
                    actor=audit.Actor.cli(),
                    message=f"Removed: {accounts.describe(account)}.",
                )
            self.stdout.write(f"Removed; {row.pk}'s {mode}-mode charges go to the platform's account.")
            return
        if secret_key or connect_account:
            if not webhook_secret:
                raise CommandError("Give --webhook-secret too.")
            secret_key = _read(secret_key)
            webhook_secret = _read(webhook_secret)
            try:
                with transaction.atomic():
                    account, created = accounts.set_account(
                        tenant_id=row.pk,
                        livemode=livemode,
                        secret_key=secret_key or "",
                        connect_account=connect_account or "",
                        webhook_secret=webhook_secret,
                    )
                    audit.record(
                        accounts.AUDIT_SET,
                        obj=account,
                        actor=audit.Actor.cli(),
                        message=f"{'Set' if created else 'Replaced'}: {accounts.describe(account)}.",
                    )
            except ServiceError as exc:
                raise CommandError(exc.message) from None
        elif webhook_secret:
            raise CommandError("--webhook-secret goes with --secret-key or --connect-account.")
        account = accounts.account_of(row.pk, livemode)
        if account is None:
            self.stdout.write(f"{row.pk} has no gateway account in {mode} mode: the platform's account charges it.")
            return
        self.stdout.write(
            f"{row.pk} ({mode}): {accounts.describe(account)}; updated {account.updated_at:%Y-%m-%d %H:%M} UTC"
        )


def _read(value: str | None) -> str | None:
    """``value``, or a line of standard input for ``-``."""
    if value != "-":
        return value
    return sys.stdin.readline().strip()
