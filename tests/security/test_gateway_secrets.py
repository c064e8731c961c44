"""Gateway secrets at rest: Fernet under HARDCOUNT_SECRETS_KEYS, rotated by a command (docs/decisions/0132).

Real PostgreSQL; the keys are set per test through Django's ``settings`` fixture.
"""

from __future__ import annotations

import io

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.core.management.base import CommandError

from billing import gateway as gw
from billing import gateway_accounts as accounts
from billing import vault
from billing.models import GatewayAccount
from hardcount.models import AuditLogEntry, Tenant

SECRET_KEY = "sk_test_51RotateSecretKey0000000000000abcd"
WEBHOOK_SECRET = "whsec_rotateSigningSecret000000000000"
OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()


@pytest.fixture
def tenant(db):
    return Tenant.objects.create(name="Rotor")


def _set(tenant) -> GatewayAccount:
    account, _ = accounts.set_account(
        tenant_id=tenant.pk, livemode=False, secret_key=SECRET_KEY, webhook_secret=WEBHOOK_SECRET
    )
    return account


def test_rotation_re_encrypts_every_row_so_the_old_key_can_be_dropped(tenant, settings):
    settings.HARDCOUNT_SECRETS_KEYS = [OLD]
    account = _set(tenant)
    before = GatewayAccount.objects.get(pk=account.pk)

    settings.HARDCOUNT_SECRETS_KEYS = [NEW, OLD]  # prepend the new key...
    out = io.StringIO()
    call_command("rotate_gateway_secrets", stdout=out)  # ...re-encrypt...
    assert "1 gateway account" in out.getvalue()
    settings.HARDCOUNT_SECRETS_KEYS = [NEW]  # ...and drop the old one.

    after = GatewayAccount.objects.get(pk=account.pk)
    assert after.secret_key != before.secret_key and after.webhook_secret != before.webhook_secret
    assert (vault.decrypt(after.secret_key), vault.decrypt(after.webhook_secret)) == (SECRET_KEY, WEBHOOK_SECRET)
    assert accounts.gateway_for(tenant.pk, False).account == gw.account_identity(SECRET_KEY)
    assert accounts.webhook_account(after.slug).signing_secret == WEBHOOK_SECRET
    assert after.updated_at == before.updated_at  # same content: the clients' cache stays valid


def test_negative_control_dropping_the_old_key_without_rotating_loses_the_secrets(tenant, settings):
    settings.HARDCOUNT_SECRETS_KEYS = [OLD]
    account = _set(tenant)
    settings.HARDCOUNT_SECRETS_KEYS = [NEW]
    with pytest.raises(vault.SecretUnreadable) as caught:
        accounts.webhook_account(account.slug)
    assert SECRET_KEY not in str(caught.value) and WEBHOOK_SECRET not in str(caught.value)
    with pytest.raises(CommandError, match="keep the old key"):
        call_command("rotate_gateway_secrets", stdout=io.StringIO())


def test_without_configured_keys_development_uses_a_generated_key_under_var(tenant, settings, tmp_path):
    settings.HARDCOUNT_SECRETS_KEYS = []
    settings.VAR_DIR = tmp_path
    account = _set(tenant)
    key = (tmp_path / vault.DEVELOPMENT_KEY_FILE).read_text().strip()
    assert Fernet(key.encode()).decrypt(account.secret_key.encode()).decode() == SECRET_KEY
    assert (tmp_path / vault.DEVELOPMENT_KEY_FILE).stat().st_mode & 0o077 == 0  # the owner's only
    settings.HARDCOUNT_DEVSTACK = False
    with pytest.raises(Exception, match="HARDCOUNT_SECRETS_KEYS is not set"):
        vault.encrypt("anything")


def test_the_command_sets_shows_masked_and_removes_with_audit_entries(tenant, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET_KEY + "\n"))
    out = io.StringIO()
    call_command(
        "gateway_account",
        "--tenant",
        tenant.pk,
        "--mode",
        "test",
        "--secret-key",
        "-",
        "--webhook-secret",
        WEBHOOK_SECRET,
        stdout=out,
    )
    call_command("gateway_account", "--tenant", tenant.pk, "--mode", "test", "--show", stdout=out)
    text = out.getvalue()
    assert "key sk_test_…abcd" in text and SECRET_KEY not in text and WEBHOOK_SECRET not in text
    with pytest.raises(CommandError, match="test-mode key"):
        call_command(
            "gateway_account",
            *("--tenant", tenant.pk, "--mode", "live", "--secret-key", SECRET_KEY),
            *("--webhook-secret", WEBHOOK_SECRET),
        )
    call_command("gateway_account", "--tenant", tenant.pk, "--mode", "test", "--delete", stdout=out)
    assert not GatewayAccount.objects.exists()
    entries = AuditLogEntry.objects.filter(action__startswith="gateway_account.").order_by("id")
    assert [(e.action, e.actor_type) for e in entries] == [
        ("gateway_account.set", AuditLogEntry.CLI),
        ("gateway_account.deleted", AuditLogEntry.CLI),
    ]
    assert not any(SECRET_KEY in e.message or WEBHOOK_SECRET in e.message for e in entries)
