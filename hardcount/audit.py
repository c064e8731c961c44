"""The operators' audit log: who did what to which object, when and from where (docs/security.md).

Every admin operation and every change of a credential records one
:class:`~hardcount.models.AuditLogEntry` through :func:`record`:

- the admin's add, change and delete (next to Django's own ``LogEntry``, which knows no
  address) and each admin action, one entry per row it acted on, refusals included;
- API keys issued (admin, ``manage.py createtenant``) and revoked (admin), tenants created,
  tenants' rate limits set (``manage.py ratelimit``);
- webhook endpoints created, changed and deleted through the API.

Who is the staff user, the API key or, for a command, the operating-system user; when is the
database's clock (``statement_timestamp()`` of the insert); where is the request's
``REMOTE_ADDR`` or ``cli``. Messages never hold a secret:
callers name keys by their hint, and :func:`record` replaces anything shaped like a full API
key or signing secret with ``[secret]`` all the same.

Actions are registered names (:func:`actions`), so the admin can filter on a fixed list. Apps
register theirs at import time, like :func:`hardcount.errors.business_rule_codes`.
"""

from __future__ import annotations

import getpass
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.db.models import Model

from hardcount.models import ApiKey, AuditLogEntry

CLI_ADDRESS = "cli"
# A full API key is its prefix and 32 characters, a hint the prefix and 6: anything longer than a hint is a key.
_SECRETS = re.compile(r"hc_(?:test|live)_[A-Za-z0-9_-]{7,}|whsec_[A-Za-z0-9_-]+")
REDACTED = "[secret]"

_ACTIONS: set[str] = set()


def actions(*names: str) -> frozenset[str]:
    """Register audit action names (``"invoice.void"``); returns them. :func:`record` refuses unregistered ones."""
    _ACTIONS.update(names)
    return frozenset(names)


def registered_actions() -> frozenset[str]:
    """Every action name registered so far."""
    return frozenset(_ACTIONS)


ADMIN_ADD, ADMIN_CHANGE, ADMIN_DELETE = "admin.add", "admin.change", "admin.delete"
TENANT_CREATED, API_KEY_ISSUED, API_KEY_REVOKED = "tenant.created", "api_key.issued", "api_key.revoked"
RATE_LIMIT_SET, RATE_LIMIT_CLEARED = "rate_limit.set", "rate_limit.cleared"
KERNEL_ACTIONS = actions(
    ADMIN_ADD,
    ADMIN_CHANGE,
    ADMIN_DELETE,
    TENANT_CREATED,
    API_KEY_ISSUED,
    API_KEY_REVOKED,
    RATE_LIMIT_SET,
    RATE_LIMIT_CLEARED,
)


@dataclass(frozen=True)
class Actor:
    """Who acted: ``type`` is one of :attr:`AuditLogEntry.ACTOR_TYPES`, ``id`` and ``label`` name them."""

    type: str
    id: str
    label: str = ""

    @classmethod
    def cli(cls) -> Actor:
        """The operating-system user running this management command."""
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no login name and no passwd entry, as in some containers
            user = "unknown"
        return cls(AuditLogEntry.CLI, user, user)


def actor_of(request) -> Actor:
    """The actor of a request: its API key (a DRF request authenticated by key) or its logged-in user.

    Raises ``ValueError`` for a request with neither.
    """
    api_key = getattr(request, "auth", None)
    if isinstance(api_key, ApiKey):
        return Actor(AuditLogEntry.API_KEY, api_key.pk, api_key.key_hint)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and getattr(user, "pk", None) is not None:
        return Actor(AuditLogEntry.USER, str(user.pk), user.get_username())
    raise ValueError("The request has no API key and no logged-in user to record as the actor.")


def scrub(text: str) -> str:
    """``text`` with every full API key and signing secret replaced by ``[secret]``."""
    return _SECRETS.sub(REDACTED, text)


def redacted_url(url: str) -> str:
    """``url`` without user, password, query or fragment, which may carry the receiver's own credentials."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return REDACTED
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, f"{host}{port}", parts.path, "", ""))


def record(
    action: str,
    *,
    obj: Model | None = None,
    request=None,
    actor: Actor | None = None,
    message: str = "",
    object_type: str | None = None,
    object_id: Any = None,
    tenant_id: str | None = None,
) -> AuditLogEntry:
    """Append one entry; returns it (``created_at`` is set by the database).

    The object is ``obj`` (its ``app_label.model_name``, primary key and ``tenant_id``), or
    ``object_type``/``object_id``/``tenant_id`` given as values. The actor is ``actor`` or the
    request's (:func:`actor_of`); the address is the request's ``REMOTE_ADDR``, or ``cli`` with
    no request. Call it inside the transaction of the change it records, so both or neither
    stay. Raises ``ValueError`` for an unregistered action or without an actor.
    """
    if action not in _ACTIONS:
        raise ValueError(f"Unregistered audit action {action!r}: register it with hardcount.audit.actions().")
    if actor is None:
        if request is None:
            raise ValueError("Give the request or the actor.")
        actor = actor_of(request)
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_id = obj.pk if object_id is None else object_id
        tenant_id = tenant_id or getattr(obj, "tenant_id", None)
    if object_type is None:
        raise ValueError("Give the object or its type.")
    address = CLI_ADDRESS if request is None else (request.META.get("REMOTE_ADDR") or "unknown")
    return AuditLogEntry.objects.create(
        actor_type=actor.type,
        actor_id=str(actor.id)[:150],
        actor_label=scrub(actor.label)[:150],
        action=action,
        object_type=object_type,
        object_id="" if object_id is None else scrub(str(object_id))[:255],
        tenant_id=tenant_id or "",
        message=scrub(message),
        remote_addr=address[:64],
    )


__all__ = [
    "ADMIN_ADD",
    "ADMIN_CHANGE",
    "ADMIN_DELETE",
    "API_KEY_ISSUED",
    "API_KEY_REVOKED",
    "CLI_ADDRESS",
    "KERNEL_ACTIONS",
    "RATE_LIMIT_CLEARED",
    "RATE_LIMIT_SET",
    "REDACTED",
    "TENANT_CREATED",
    "Actor",
    "actions",
    "actor_of",
    "record",
    "redacted_url",
    "registered_actions",
    "scrub",
]
