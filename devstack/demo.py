"""The development demo's credentials: a demo tenant with its keys, and an operator for the admin.

API keys are shown once by design (only their hash is stored), so a development stack
that should print the same keys on every start keeps the demo's plaintext keys in
``var/demo-keys.json``, and the operator's generated password in ``var/operator.json``.
Both files are for development only: they are written with mode 0600 under ``var/`` and
nothing in production reads them. See docs/decisions/0040-make-run-dev-stack.md.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction

from hardcount.models import ApiKey, Tenant, hash_api_key

DEMO_TENANT_NAME = "Demo"
OPERATOR_USERNAME = "operator"


@dataclass
class DemoTenant:
    """The demo tenant and its plaintext keys; ``extra`` holds what later steps store beside them."""

    tenant_id: str
    test_key: str
    live_key: str
    created: bool = False
    extra: dict = field(default_factory=dict)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_private_json(path: Path, value: dict) -> None:
    """Write ``value`` to ``path`` atomically, readable by the owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _key_is_valid(tenant_id: str, secret: object, *, livemode: bool) -> bool:
    return (
        isinstance(secret, str)
        and ApiKey.objects.filter(
            tenant_id=tenant_id, livemode=livemode, key_hash=hash_api_key(secret), revoked_at__isnull=True
        ).exists()
    )


def ensure_demo_tenant(path: Path) -> DemoTenant:
    """Reuse the demo tenant whose keys ``path`` holds, or create a new one and write ``path``.

    The stored keys are reused only while the tenant exists and both keys are still valid
    (not revoked) in this database; otherwise (a fresh database, a revoked key) a new demo
    tenant with a new test key and live key is created. Returns the tenant id and keys.
    """
    saved = read_json(path) or {}
    tenant_id = saved.get("tenant_id")
    if (
        isinstance(tenant_id, str)
        and Tenant.objects.filter(id=tenant_id).exists()
        and _key_is_valid(tenant_id, saved.get("test_key"), livemode=False)
        and _key_is_valid(tenant_id, saved.get("live_key"), livemode=True)
    ):
        extra = {k: v for k, v in saved.items() if k not in {"tenant_id", "test_key", "live_key", "note"}}
        return DemoTenant(tenant_id, saved["test_key"], saved["live_key"], extra=extra)
    with transaction.atomic():
        tenant = Tenant.objects.create(name=DEMO_TENANT_NAME)
        _, test_key = ApiKey.issue(tenant, livemode=False)
        _, live_key = ApiKey.issue(tenant, livemode=True)
    demo = DemoTenant(tenant.id, test_key, live_key, created=True)
    save_demo_tenant(path, demo)
    return demo


def save_demo_tenant(path: Path, demo: DemoTenant) -> None:
    """Write the demo tenant's keys (and ``extra``) to ``path``, mode 0600."""
    write_private_json(
        path,
        {
            "note": "Development only: the demo tenant's plaintext API keys, kept so make run can show them again.",
            "tenant_id": demo.tenant_id,
            "test_key": demo.test_key,
            "live_key": demo.live_key,
            **demo.extra,
        },
    )


def ensure_operator(path: Path) -> tuple[str, str]:
    """Make sure the superuser ``operator`` exists with the password kept in ``path``.

    The password is generated on first use (or when the file is missing or no longer
    matches) and written to ``path`` (mode 0600). Returns ``(username, password)``.
    """
    User = get_user_model()
    saved = read_json(path) or {}
    password = saved.get("password")
    user = User.objects.filter(username=OPERATOR_USERNAME).first()
    if (
        user is not None
        and isinstance(password, str)
        and user.is_active
        and user.is_superuser
        and user.check_password(password)
    ):
        return OPERATOR_USERNAME, password
    # Letters and digits only, so it reads and pastes cleanly wherever it is printed (~95 bits).
    password = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(16))
    if user is None:
        User.objects.create_superuser(OPERATOR_USERNAME, email="", password=password)
    else:
        user.is_active = user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
    write_private_json(
        path,
        {"note": "Development only: the operator's generated admin password.", "username": OPERATOR_USERNAME}
        | {"password": password},
    )
    return OPERATOR_USERNAME, password
