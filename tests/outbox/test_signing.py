"""The signature helper: what a receiver runs on every delivery (docs/reference/webhooks.md)."""

import hashlib
import hmac

import pytest

from outbox.signing import SignatureVerificationError, compute_signature, generate_secret, sign, verify

BODY = b'{"id":"evt_1","type":"invoice.paid","data":{"amount":1000}}'
SECRET = "whsec_test_secret"


def test_signature_is_hmac_sha256_of_timestamp_dot_body():
    header = sign(BODY, SECRET, timestamp=1_700_000_000)
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_verify_accepts_what_sign_produced():
    header = sign(BODY, SECRET, timestamp=1_700_000_000)
    assert verify(BODY, header, SECRET, now=1_700_000_010) == 1_700_000_000
    assert verify(BODY.decode(), header, SECRET, now=1_700_000_010) == 1_700_000_000


def test_verify_rejects_a_changed_body():
    header = sign(BODY, SECRET, timestamp=1_700_000_000)
    with pytest.raises(SignatureVerificationError, match="no signature matches"):
        verify(BODY.replace(b"1000", b"9000"), header, SECRET, now=1_700_000_000)


def test_verify_rejects_another_secret():
    header = sign(BODY, SECRET, timestamp=1_700_000_000)
    with pytest.raises(SignatureVerificationError):
        verify(BODY, header, generate_secret(), now=1_700_000_000)


def test_verify_rejects_a_timestamp_older_than_the_tolerance():
    header = sign(BODY, SECRET, timestamp=1_700_000_000)
    assert verify(BODY, header, SECRET, tolerance_s=300, now=1_700_000_300)
    with pytest.raises(SignatureVerificationError, match="tolerance"):
        verify(BODY, header, SECRET, tolerance_s=300, now=1_700_000_301)


def test_verify_rejects_a_timestamp_from_the_future():
    header = sign(BODY, SECRET, timestamp=1_700_000_301)
    with pytest.raises(SignatureVerificationError, match="tolerance"):
        verify(BODY, header, SECRET, tolerance_s=300, now=1_700_000_000)


def test_verify_rejects_a_replayed_signature_with_a_new_timestamp():
    # An attacker who captured a request cannot refresh its timestamp: t is inside the MAC.
    old = sign(BODY, SECRET, timestamp=1_700_000_000)
    forged = old.replace("t=1700000000", "t=1700009999")
    with pytest.raises(SignatureVerificationError, match="no signature matches"):
        verify(BODY, forged, SECRET, now=1_700_009_999)


def test_verify_accepts_any_of_several_signatures_during_secret_rotation():
    new_secret = generate_secret()
    t = 1_700_000_000
    header = f"t={t},v1={compute_signature(BODY, 'whsec_old', t)},v1={compute_signature(BODY, new_secret, t)}"
    assert verify(BODY, header, new_secret, now=t) == t


@pytest.mark.parametrize("header", ["", "v1=abc", "t=abc,v1=abc", "t=1700000000", "garbage"])
def test_verify_rejects_malformed_headers(header):
    with pytest.raises(SignatureVerificationError):
        verify(BODY, header, SECRET, now=1_700_000_000)


def test_generated_secrets_are_prefixed_and_unique():
    a, b = generate_secret(), generate_secret()
    assert a.startswith("whsec_") and b.startswith("whsec_")
    assert a != b and len(a) >= 30
