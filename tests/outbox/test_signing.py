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


# --- malformed headers: always the module's own error, never a crash ----------------------------------------------

T = 1_700_000_000


def _good(secret: str = SECRET, t: int = T) -> str:
    return compute_signature(BODY, secret, t)


@pytest.mark.parametrize(
    "header",
    [
        f"t={T},v1=é",  # a non-ASCII signature once raised TypeError from hmac.compare_digest
        f"t={T},v1={_good()[:-1]}é",
        f"t={T},v1=\u0661\u0662",
        f"t=\uff11\uff17\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10,v1={_good()}",  # fullwidth digits
        f"t=\u0661\u0667\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660,v1={_good()}",  # Arabic-Indic digits
        f"t={T},v1={_good()}\u200b",
        f"t={T},v1={_good()},x=\udcff",  # a lone surrogate
        "t=\x00,v1=\x00",
    ],
)
def test_non_ascii_headers_raise_the_verification_error(header):
    with pytest.raises(SignatureVerificationError):
        verify(BODY, header, SECRET, now=T)


@pytest.mark.parametrize("header", [b"t=1700000000,v1=\xc3\xa9", b"\xff\xfe", bytearray(b"t=\x80")])
def test_non_ascii_bytes_headers_raise_the_verification_error(header):
    with pytest.raises(SignatureVerificationError):
        verify(BODY, header, SECRET, now=T)


def test_an_ascii_bytes_header_verifies():
    assert verify(BODY, sign(BODY, SECRET, timestamp=T).encode(), SECRET, now=T) == T


@pytest.mark.parametrize(
    "header",
    [None, "", ",", "=", ",,,", "t", "v1", "t=", "v1=", f"t={T}", f"t={T},", f"t={T},v1", f"v1={_good()}", "t=,v1="],
)
def test_headers_missing_a_part_raise_the_verification_error(header):
    with pytest.raises(SignatureVerificationError):
        verify(BODY, header, SECRET, now=T)


@pytest.mark.parametrize(
    "stamp",
    ["1.5", "-1700000000", "+1700000000", "1_700_000_000", " 1700000000x", "0x10", "1e9", "9" * 13, "abc", "NaN"],
)
def test_non_integer_timestamps_raise_the_verification_error(stamp):
    with pytest.raises(SignatureVerificationError, match="not an integer"):
        verify(BODY, f"t={stamp},v1={_good()}", SECRET, now=T)


def test_two_different_timestamps_are_refused_and_a_repeated_one_is_not():
    with pytest.raises(SignatureVerificationError, match="more than one timestamp"):
        verify(BODY, f"t={T},t={T + 1},v1={_good()}", SECRET, now=T)
    assert verify(BODY, f"t={T},t={T},v1={_good()}", SECRET, now=T) == T


@pytest.mark.parametrize("position", [0, 1, 5])
def test_any_matching_v1_passes_among_others(position):
    others = ["0" * 64, "zz", "", _good("whsec_old"), "A" * 64, _good().upper()]
    candidates = [*others[:position], _good(), *others[position:]]
    header = f"t={T}," + ",".join(f"v1={c}" for c in candidates)
    assert verify(BODY, header, SECRET, now=T) == T


def test_several_v1_none_matching_is_refused():
    header = f"t={T},v1={'0' * 64},v1={_good('whsec_old')},v1=zz"
    with pytest.raises(SignatureVerificationError, match="no signature matches"):
        verify(BODY, header, SECRET, now=T)


def test_unknown_schemes_are_ignored():
    assert verify(BODY, f"v0=abc,t={T},v2=def,v1={_good()}", SECRET, now=T) == T


def test_huge_headers_are_refused_quickly():
    import time

    for header in (f"t={T},v1={_good()}," + "v1=" + "a" * 10_000_000, "t=" + "1" * 10_000_000, "," * 10_000_000):
        started = time.monotonic()
        with pytest.raises(SignatureVerificationError, match="longer than"):
            verify(BODY, header, SECRET, now=T)
        assert time.monotonic() - started < 0.5
    # Many signatures within the limit are fine (one per secret being rolled, and more).
    many = f"t={T}," + ",".join(f"v1={_good(f'whsec_{i}')}" for i in range(100)) + f",v1={_good()}"
    assert verify(BODY, many, SECRET, now=T) == T


@pytest.mark.parametrize("payload", [5, None, 1.5, ["a"], {"a": 1}])
def test_a_payload_that_is_not_bytes_or_text_is_a_type_error(payload):
    with pytest.raises(TypeError):
        verify(payload, sign(BODY, SECRET, timestamp=T), SECRET, now=T)


def test_arbitrary_headers_raise_only_the_verification_error():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    parts = st.one_of(
        st.text(max_size=80),
        st.builds(lambda v: f"t={v}", st.text(max_size=20)),
        st.builds(lambda v: f"v1={v}", st.text(max_size=80)),
        st.just(f"t={T}"),
        st.just(f"v1={_good()}"),
    )

    @settings(max_examples=500, deadline=None)
    @given(st.lists(parts, max_size=6).map(",".join))
    def check(header):
        try:
            verify(BODY, header, SECRET, now=T)
        except SignatureVerificationError:
            pass

    check()
