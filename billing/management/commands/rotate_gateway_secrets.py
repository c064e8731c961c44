"""``python manage.py rotate_gateway_secrets``: re-encrypt every gateway secret under the first key.

After prepending a new key to ``HARDCOUNT_SECRETS_KEYS`` (and restarting with it): this rewrites
every stored secret under that key, so the old key can then be dropped from the list
(:func:`billing.gateway_accounts.rotate_secrets`, docs/decisions/0132-gateway-accounts.md).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from billing import gateway_accounts as accounts
from billing import vault


class Command(BaseCommand):
    help = "Re-encrypt every gateway account's secrets under the first of HARDCOUNT_SECRETS_KEYS."

    def handle(self, *args, **options):
        try:
            done = accounts.rotate_secrets()
        except vault.SecretUnreadable as exc:
            raise CommandError(f"{exc}; keep the old key in the list until every row is rotated.") from None
        self.stdout.write(f"Re-encrypted the secrets of {done} gateway account(s) under the first key.")
