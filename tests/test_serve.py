"""The development stack's parts: localstripe launcher, demo credentials, webhook receiver, socket paths,
``make clean``'s refusal, the supervisor's database retries, and what ``make run`` prints.

The whole ``serve`` process (gunicorn included) is exercised in tests/system/test_serve_process.py.
"""

import json
import os
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest
import stripe
from django.db import InterfaceError, OperationalError, connection

from devstack import demo
from devstack.management.commands.serve import DEV_STRIPE_KEY, DatabaseRetry, wants_localstripe
from devstack.stack import SchedulerLogView, WebhookReceiver, signature_verdict, start_localstripe
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


# --- make clean -----------------------------------------------------------------------------------------------------

BASE_DIR = Path(__file__).resolve().parents[1]


def _make(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(BASE_DIR), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_make_clean_refuses_while_database_url_is_set(db, tmp_path):
    s = connection.settings_dict
    database_url = f"postgresql://{s['USER']}@:{s['PORT']}/{s['NAME']}?host={s['HOST']}"
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    (var_dir / "demo-keys.json").write_text("{}")
    env = {**os.environ, "DATABASE_URL": database_url, "HARDCOUNT_VAR_DIR": str(var_dir)}

    done = _make("clean", env=env)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "refusing, DATABASE_URL is set" in done.stderr
    assert "env -u DATABASE_URL make clean" in done.stderr
    assert (var_dir / "demo-keys.json").exists()  # nothing deleted
    with connection.cursor() as cursor:  # nor stopped
        cursor.execute("SELECT 1")
    # Set on make's command line, it is refused too.
    env.pop("DATABASE_URL")
    assert _make("clean", f"DATABASE_URL={database_url}", env=env).returncode == 2
    assert (var_dir / "demo-keys.json").exists()


def test_make_clean_without_database_url_stops_the_embedded_database_and_deletes_var(tmp_path):
    var_dir = tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"HARDCOUNT_VAR_DIR": str(var_dir)}

    done = _make("-n", "clean", env=env)

    assert done.returncode == 0, done.stderr
    assert "stop-db" in done.stdout
    assert f"rm -rf {var_dir}" in done.stdout


# --- the supervisor's database reads ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_database_retry_says_once_backs_off_and_says_when_it_is_back():
    lines, clock, calls = [], FakeClock(), []

    def query():
        calls.append(clock.now)
        if len(calls) <= 3:
            raise OperationalError("terminating connection due to administrator command")
        return "billing  due 0"

    retry = DatabaseRetry(lines.append, max_s=4.0, clock=clock)
    assert retry.call(query) is None  # fails at 100
    assert retry.failing
    results = []
    for t in (100.5, 101.0, 102.0, 103.0, 106.0, 107.0, 108.0):
        clock.now = t
        results.append(retry.call(query))

    # Tried at 100, then after 1 s (101), 2 s (103), 4 s (107, capped), then at once again.
    assert calls == [100.0, 101.0, 103.0, 107.0, 108.0]
    assert results == [None] * 5 + ["billing  due 0"] * 2
    assert not retry.failing
    assert len(lines) == 2
    assert lines[0].startswith("database: the supervisor's query failed (OperationalError: terminating connection")
    assert "the stack keeps serving" in lines[0]
    assert lines[1] == "database: back after 7 s (3 failed attempts); progress lines resume."


def test_database_retry_catches_an_interface_error_and_passes_other_errors():
    retry = DatabaseRetry(lambda line: None, clock=FakeClock())

    def closed():
        raise InterfaceError("connection already closed")

    assert retry.call(closed) is None
    with pytest.raises(ZeroDivisionError):
        DatabaseRetry(lambda line: None).call(lambda: 1 / 0)


# --- what make run prints -----------------------------------------------------------------------------------------

BILLING_TICK = (
    "2026-12-01 10:36:40,776 INFO hardcount.scheduler event=tick_completed role=billing token=1 duration_s=3.902 "
    "recorded=True live_run=brun_01 live_attempted=0 live_billed=0 live_failed=0 test_run=brun_02 "
    "test_attempted=184 test_billed=182 test_failed=2 test_clocks_resumed=0 live_reconcile_tax=0 test_reconcile_tax=0"
)


def test_scheduler_lines_are_short_and_idle_ticks_quiet():
    shown = []
    view = SchedulerLogView(shown.append)

    view(BILLING_TICK)
    view("2026-12-01 10:36:36,870 INFO hardcount.scheduler event=tick_started role=billing token=1")
    view(BILLING_TICK.replace("test_attempted=184 test_billed=182 test_failed=2", "test_attempted=0"))
    view("2026-12-01 10:36:26 INFO hardcount.scheduler event=ticker_started role=dunning holder=vm:1:a interval_s=60")
    view("2026-12-01 10:36:26 WARNING hardcount.scheduler event=tick_failed role=billing token=1 error=boom")
    view('127.0.0.1 - - [01/Dec/2026:10:36:27 +0000] "POST /v1/customers HTTP/1.1" 201 370')

    assert shown == [
        "scheduler  billing tick 3.902 s: test_attempted=184 test_billed=182 test_failed=2",
        "2026-12-01 10:36:26 WARNING hardcount.scheduler event=tick_failed role=billing token=1 error=boom",
        '127.0.0.1 - - [01/Dec/2026:10:36:27 +0000] "POST /v1/customers HTTP/1.1" 201 370',
    ]
    detailed = []
    SchedulerLogView(detailed.append, detail=True)(BILLING_TICK)
    assert detailed == [BILLING_TICK]


def test_webhook_receiver_samples_a_burst_and_logs_one_by_one_again_once_it_is_over():
    lines, clock = [], FakeClock()
    receiver = WebhookReceiver(secrets=lambda: ["whsec_demo"], log=lines.append, burst=3, window_s=5.0, clock=clock)
    try:

        def deliver(n: int, secret: str = "whsec_demo") -> None:
            for i in range(n):
                body = json.dumps({"id": f"evt_{clock.now:.0f}_{i}", "type": "invoice.paid"}).encode()
                receiver._record(sign(body, secret), body)

        deliver(10)  # a burst: three one by one, the rest counted
        assert len(lines) == 3
        clock.now += 5
        receiver.flush()
        assert lines[3] == (
            "webhook  … 7 more deliveries in 5 s, sampled: not logged one by one (signatures ok; 10 received in all)"
        )
        deliver(2, secret="whsec_other")  # still sampling: the last window was over the burst
        clock.now += 5
        receiver.flush()
        assert lines[4].startswith("webhook  … 2 more deliveries in 5 s, sampled")
        assert "2 signatures NOT verified" in lines[4]
        deliver(1)  # a quiet window passed: one by one again
        assert lines[5] == f"webhook  evt_{clock.now:.0f}_0 invoice.paid (test) signature ok"
        assert receiver.count == 13
    finally:
        receiver.server.server_close()
