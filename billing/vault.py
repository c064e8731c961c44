"""Secrets at rest: the tenants' gateway keys and webhook signing secrets, Fernet-encrypted.

``settings.HARDCOUNT_SECRETS_KEYS`` lists the Fernet keys; :class:`cryptography.fernet.MultiFernet`
encrypts with the first and decrypts with any, so a rotation is: prepend a new key, run
``manage.py rotate_gateway_secrets`` (:func:`rotate`), then drop the old key
(https://cryptography.io/en/latest/fernet/#cryptography.fernet.MultiFernet.rotate). Without any
key, development (``HARDCOUNT_DEVSTACK``) uses one generated once under ``var/``; production
settings refuse to start (docs/decisions/0132-gateway-accounts.md).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

DEVELOPMENT_KEY_FILE = "secrets.key"

_lock = threading.Lock()
_cache: dict[tuple[str, ...], MultiFernet] = {}


class SecretUnreadable(Exception):
    """A stored secret decrypts under none of the configured keys (a key was dropped too early)."""


def _development_key() -> str:
    path = Path(settings.VAR_DIR) / DEVELOPMENT_KEY_FILE
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key().decode("ascii")
    try:
        # O_EXCL: two processes starting at once agree on the first key written.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="ascii").strip()
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key + "\n")
    return key


def keys() -> tuple[str, ...]:
    """The Fernet keys in use, first the one that encrypts. Raises ``ImproperlyConfigured`` when none is set
    outside development."""
    configured = tuple(settings.HARDCOUNT_SECRETS_KEYS)
    if configured:
        return configured
    if settings.HARDCOUNT_DEVSTACK:
        return (_development_key(),)
    raise ImproperlyConfigured("HARDCOUNT_SECRETS_KEYS is not set")


def _fernet() -> MultiFernet:
    current = keys()
    with _lock:
        box = _cache.get(current)
        if box is None:
            box = _cache[current] = MultiFernet([Fernet(k.encode("ascii")) for k in current])
        return box


def encrypt(plaintext: str) -> str:
    """The Fernet token (ASCII) of ``plaintext`` under the first key; ``""`` stays ``""``."""
    if not plaintext:
        return ""
    return _fernet().encrypt(plaintext.encode("utf-8")).decode("ascii")


def decrypt(token: str) -> str:
    """The plaintext of a token from :func:`encrypt`; raises :class:`SecretUnreadable` (naming no secret)."""
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode("ascii")).decode("utf-8")
    except InvalidToken:
        raise SecretUnreadable("a stored secret decrypts under none of HARDCOUNT_SECRETS_KEYS") from None


def rotate(token: str) -> str:
    """``token`` re-encrypted under the first key (its plaintext unchanged); raises :class:`SecretUnreadable`."""
    if not token:
        return ""
    try:
        return _fernet().rotate(token.encode("ascii")).decode("ascii")
    except InvalidToken:
        raise SecretUnreadable("a stored secret decrypts under none of HARDCOUNT_SECRETS_KEYS") from None
