"""The development stack's parts: localstripe launcher, demo credentials, webhook receiver, socket paths.

The whole ``serve`` process (gunicorn included) is exercised in tests/system/test_serve_process.py.
"""

import json
import os
import stat
import urllib.request
from pathlib import Path

import pytest
import stripe

from devstack import demo
from devstack.management.commands.serve import DEV_STRIPE_KEY, wants_localstripe
from devstack.stack import WebhookReceiver, signature_verdict, start_localstripe
from hardcount.embedded_db import _MAX_SOCKET_PATH, _socket_dir
from hardcount.models import ApiKey, hash_api_key
from outbox.signing import sign

SHARED_UPSTREAM_STORE = Path("/tmp/localstripe.pickle")


def _mtime(path: Path):
    return path.stat().st_mtime_ns if path.exists() else None


def test_localstripe_keeps_its_store_in_the_given_file_across_restarts(tmp_path):
    store = tmp_path / "localstripe.pickle"
    upstream_before = _mtime(SHARED_UPSTREAM_STORE)

    first = start_localstripe(store_path=store, log_path=tmp_path / "ls.log")
    client = stripe.StripeClient("sk_test_devstack", base_addresses={"api": first.api_base})
    customer = client.v1.customers.create(params={"email": "jenny@example.com"})
    assert first.stop() == 0
    assert store.exists()

    second = start_localstripe(store_path=store)
    try:
        client = stripe.StripeClient("sk_test_devstack", base_addresses={"api": second.api_base})
        assert client.v1.customers.retrieve(customer.id).email == "jenny@example.com"
    finally:
        second.stop()
    # Upstream localstripe would have pickled every write to this machine-wide file.
    assert _mtime(SHARED_UPSTREAM_STORE) == upstream_before


def test_localstripe_stop_leaves_no_process(tmp_path):
    localstripe = start_localstripe(store_path=tmp_path / "s.pickle", log_path=tmp_path / "ls.log")
    pid = localstripe.child.pid
    localstripe.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_wants_localstripe_unless_a_gateway_is_configured():
    assert wants_localstripe({})
    assert wants_localstripe({"STRIPE_API_KEY": DEV_STRIPE_KEY})
    assert not wants_localstripe({"STRIPE_API_BASE": "http://127.0.0.1:8420"})
    assert not wants_localstripe({"STRIPE_API_KEY": "sk_test_51RealKeyFromTheDashboard"})


def test_demo_tenant_keys_are_reused_while_the_database_accepts_them(db, tmp_path):
    path = tmp_path / "demo-keys.json"
    first = demo.ensure_demo_tenant(path)
    second = demo.ensure_demo_tenant(path)

    assert first.created and not second.created
    assert (second.tenant_id, second.test_key, second.live_key) == (first.tenant_id, first.test_key, first.live_key)
    assert ApiKey.objects.get(key_hash=hash_api_key(first.test_key)).livemode is False
    assert ApiKey.objects.get(key_hash=hash_api_key(first.live_key)).livemode is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_demo_tenant_is_replaced_when_a_saved_key_was_revoked(db, tmp_path):
    path = tmp_path / "demo-keys.json"
    first = demo.ensure_demo_tenant(path)
    ApiKey.objects.filter(key_hash=hash_api_key(first.live_key)).update(revoked_at="2026-01-01T00:00:00Z")

    second = demo.ensure_demo_tenant(path)

    assert second.created
    assert second.tenant_id != first.tenant_id
    assert json.loads(path.read_text())["live_key"] == second.live_key


def test_demo_tenant_extra_fields_survive_a_save(db, tmp_path):
    path = tmp_path / "demo-keys.json"
    tenant = demo.ensure_demo_tenant(path)
    tenant.extra["webhook_receiver_port"] = 40123
    demo.save_demo_tenant(path, tenant)

    assert demo.ensure_demo_tenant(path).extra == {"webhook_receiver_port": 40123}


def test_operator_password_is_kept_and_logs_in(db, tmp_path, client):
    path = tmp_path / "operator.json"
    username, password = demo.ensure_operator(path)

    assert (username, password) == demo.ensure_operator(path)
    assert client.login(username="operator", password=password)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_operator_password_is_reset_when_its_file_is_lost(db, tmp_path, client):
    _, old = demo.ensure_operator(tmp_path / "operator.json")

    _, new = demo.ensure_operator(tmp_path / "elsewhere.json")

    assert new != old
    assert not client.login(username="operator", password=old)
    assert client.login(username="operator", password=new)


def test_signature_verdict_accepts_only_the_exact_body_and_a_known_secret():
    body = b'{"id": "evt_1"}'
    header = sign(body, "whsec_a")
    assert signature_verdict(header, body, ["whsec_b", "whsec_a"]) == "signature ok"
    assert signature_verdict(header, body + b" ", ["whsec_a"]).startswith("signature REJECTED")
    assert signature_verdict(header, body, ["whsec_b"]).startswith("signature REJECTED")
    assert signature_verdict("", body, ["whsec_a"]) == "unsigned"


def test_webhook_receiver_logs_each_delivery_with_its_signature_verdict():
    lines = []
    receiver = WebhookReceiver(secrets=lambda: ["whsec_demo"], log=lines.append).start()
    body = json.dumps({"id": "evt_123", "type": "invoice.paid", "livemode": False}).encode()
    try:
        for secret in ("whsec_demo", "whsec_other"):
            request = urllib.request.Request(
                receiver.url, data=body, headers={"Hardcount-Signature": sign(body, secret)}, method="POST"
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200
    finally:
        receiver.stop()
    assert lines == [
        "webhook  evt_123 invoice.paid (test) signature ok",
        "webhook  evt_123 invoice.paid (test) signature REJECTED (no signature matches the payload and secret)",
    ]
    assert [r["id"] for r in receiver.received] == ["evt_123", "evt_123"]


def test_socket_stays_in_the_data_dir_when_its_path_fits():
    assert _socket_dir(Path("/srv/hc/var/pgdata")) == Path("/srv/hc/var/pgdata")


def test_socket_of_a_deep_clone_moves_to_a_short_dir_of_its_own(tmp_path):
    deep = tmp_path / ("a" * 60) / ("b" * 60)
    one = _socket_dir(deep / "one" / "var" / "pgdata")
    two = _socket_dir(deep / "two" / "var" / "pgdata")
    try:
        assert len(os.fsencode(one / ".s.PGSQL.5432")) <= _MAX_SOCKET_PATH
        assert one != two
        assert one.is_dir()
    finally:
        one.rmdir()
        two.rmdir()
