"""Webhook signatures: how Hardcount signs a delivery and how a receiver verifies it.

Header (docs/reference/webhooks.md)::

    Hardcount-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>

The scheme is Stripe's ``Stripe-Signature``: the timestamp is part of the signed
message, so a captured request cannot be replayed later than the receiver's tolerance
(default 300 s, Stripe's). Every attempt is signed afresh with the time it is sent, so a
retry a day later verifies as well as the first attempt. A header may carry several
``v1=`` signatures (one per secret while a secret is being rolled); any one matching is
enough. :func:`verify` is the helper receivers use (and the tests use as a receiver).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

HEADER = "Hardcount-Signature"
SCHEME = "v1"
SECRET_PREFIX = "whsec_"  # noqa: S105 (a prefix, not a secret)
DEFAULT_TOLERANCE_S = 300
# Longer headers are refused unread: a few signatures (one per secret being rolled) fit many times.
MAX_HEADER_LENGTH = 8192
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class SignatureVerificationError(ValueError):
    """The payload does not carry a valid, fresh signature for the secret: reject the request."""


def generate_secret() -> str:
    """A new endpoint signing secret, ``whsec_`` followed by 192 random bits (URL-safe base64)."""
    return SECRET_PREFIX + secrets.token_urlsafe(24)


def compute_signature(payload: bytes, secret: str, timestamp: int) -> str:
    """Hex HMAC-SHA256 of ``b"<timestamp>." + payload`` keyed with the whole secret string (``whsec_…``)."""
    message = str(timestamp).encode() + b"." + payload
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(payload: bytes, secret: str, *, timestamp: int | None = None) -> str:
    """The ``Hardcount-Signature`` header value for ``payload`` (the exact body bytes sent).

    ``timestamp`` is unix seconds, default the current time: pass nothing when sending.
    """
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},{SCHEME}={compute_signature(payload, secret, t)}"


def parse_header(header: str | bytes | None) -> tuple[int, list[str]]:
    """Split a header into ``(timestamp, [v1 signatures])``.

    Raises :class:`SignatureVerificationError` for anything but an ASCII header of at most
    :data:`MAX_HEADER_LENGTH` characters with exactly one timestamp (``t=``, 1 to 12 ASCII
    digits; repeated only with the same value) and at least one ``v1`` signature. Unknown
    schemes are ignored, as Stripe receivers do.
    """
    if header is None:
        header = ""
    if isinstance(header, bytes | bytearray):
        try:
            header = bytes(header).decode("ascii")
        except UnicodeDecodeError:
            raise SignatureVerificationError("signature header is not ASCII") from None
    if not isinstance(header, str):
        raise SignatureVerificationError("signature header is not text")
    if len(header) > MAX_HEADER_LENGTH:
        raise SignatureVerificationError(f"signature header is longer than {MAX_HEADER_LENGTH} characters")
    if not header.isascii():
        raise SignatureVerificationError("signature header is not ASCII")
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if not _TIMESTAMP.fullmatch(value):
                raise SignatureVerificationError("signature header timestamp is not an integer")
            if timestamp is not None and timestamp != int(value):
                raise SignatureVerificationError("signature header has more than one timestamp")
            timestamp = int(value)
        elif key == SCHEME:
            signatures.append(value)
    if timestamp is None:
        raise SignatureVerificationError("signature header has no timestamp")
    if not signatures:
        raise SignatureVerificationError(f"signature header has no {SCHEME} signature")
    return timestamp, signatures


def verify(
    payload: bytes | str,
    header: str,
    secret: str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> int:
    """Check that ``header`` signs ``payload`` (the raw request body) with ``secret``, recently.

    Rejects a timestamp more than ``tolerance_s`` seconds older *or newer* than ``now``
    (default the receiver's clock; a timestamp from the future is as suspect as a stale
    one). Signatures are compared in constant time; any one matching ``v1`` passes. Returns
    the signed timestamp (unix seconds); raises :class:`SignatureVerificationError` on any
    mismatch and on any malformed header (:func:`parse_header`), ``TypeError`` when
    ``payload`` is neither bytes nor str. Pass the body exactly as received: re-serialising
    parsed JSON changes the bytes and fails.
    """
    if isinstance(payload, str):
        body = payload.encode()
    elif isinstance(payload, bytes | bytearray | memoryview):
        body = bytes(payload)
    else:
        raise TypeError(f"payload must be the raw body as bytes or str, not {type(payload).__name__}")
    timestamp, signatures = parse_header(header)
    current = time.time() if now is None else now
    if tolerance_s is not None and abs(current - timestamp) > tolerance_s:
        raise SignatureVerificationError(
            f"signature timestamp {timestamp} is outside the tolerance of {tolerance_s} s (now {int(current)})"
        )
    expected = compute_signature(body, secret, timestamp).encode()
    matched = False
    for candidate in signatures:
        # Compare every candidate so the time taken does not reveal which one matched (bytes:
        # parse_header allowed ASCII only, and compare_digest takes no other str).
        matched |= hmac.compare_digest(expected, candidate.encode())
    if not matched:
        raise SignatureVerificationError("no signature matches the payload and secret")
    return timestamp


__all__ = [
    "DEFAULT_TOLERANCE_S",
    "HEADER",
    "MAX_HEADER_LENGTH",
    "SECRET_PREFIX",
    "SignatureVerificationError",
    "compute_signature",
    "generate_secret",
    "parse_header",
    "sign",
    "verify",
]
