"""``manage.py serve`` as a real process: it serves, then leaves nothing running when stopped or killed.

Each test starts ``serve`` against the test database (through ``DATABASE_URL``) with its own
``HARDCOUNT_VAR_DIR`` and a free port, so it touches neither the developer's database nor port 8000.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from django.conf import settings

from tests.system.harness import ServeProcess

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

BASE_DIR = Path(settings.BASE_DIR)


def _gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


def test_serve_prints_working_keys_and_sigterm_stops_gunicorn_and_localstripe(tmp_path):
    serve = ServeProcess(tmp_path / "var")
    try:
        serve.wait_ready()
        assert serve.get("/admin/login/") == 200
        assert serve.banner_value("test key").startswith("hc_test_")
        assert serve.banner_value("live key").startswith("hc_live_")
        children = serve.descendants()
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "gunicorn" in names
        assert "localstripe" in names
        assert len(children) >= 3  # localstripe, the gunicorn arbiter and its worker
        arbiter = next(p for p in children if "gunicorn" in " ".join(p.cmdline()))
        assert arbiter.environ()["HARDCOUNT_RUN_SCHEDULER"] == "1"
        assert arbiter.environ()["STRIPE_API_BASE"].startswith("http://127.0.0.1:")

        test_key, live_key = serve.banner_value("test key"), serve.banner_value("live key")
        status, customer = serve.api("POST", "/v1/customers", test_key, {"email": "jenny@example.com"})
        assert status in (200, 201)
        assert serve.api("GET", f"/v1/customers/{customer['id']}", test_key)[0] == 200
        assert serve.api("GET", f"/v1/customers/{customer['id']}", live_key)[0] == 404
        # The receiver is the demo's test-mode endpoint: the event arrives, signed.
        assert serve.wait_for_line("customer.created (test) signature ok", timeout_s=30)

        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(60) == 0
        assert _gone(children, 5) == []
        assert "Stopped gunicorn and localstripe." in serve.lines
    finally:
        if serve.process.poll() is None:
            serve.process.kill()


def test_killed_serve_takes_its_children_with_it(tmp_path):
    serve = ServeProcess(tmp_path / "var")
    try:
        serve.wait_ready()
        children = serve.descendants()
        assert children

        serve.process.send_signal(signal.SIGKILL)
        serve.process.wait(10)
        # PR_SET_PDEATHSIG sends the children SIGTERM; gunicorn then stops its workers gracefully.
        assert _gone(children, 30) == []
    finally:
        if serve.process.poll() is None:
            serve.process.kill()


def test_sigterm_to_make_run_stops_serve_and_every_child(tmp_path):
    # make passes SIGTERM to the child it started and waits for it. When that child was a shell running serve
    # (dash does not exec a recipe's last command), the shell died and serve, gunicorn and both Stripes ran on.
    run = ServeProcess(tmp_path / "var", make=True)
    left: list[psutil.Process] = []
    try:
        run.wait_ready(timeout_s=180)
        left = psutil.Process(run.process.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in left)
        for name in ("manage.py serve", "gunicorn", "localstripe", "strict_stripe"):
            assert name in names, names

        run.process.send_signal(signal.SIGTERM)
        run.process.wait(60)
        alive = _gone(left, 10)
        assert alive == [], [" ".join(p.cmdline()) for p in alive]
        assert "Stopped gunicorn and localstripe." in run.lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.process.pid, signal.SIGKILL)  # make's group: serve, and a shell if one was between
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_first_start_seeds_the_demo_book_and_reports_until_the_first_drain_billed_it(tmp_path):
    serve = ServeProcess(tmp_path / "var", demo_subscriptions=40)
    try:
        serve.wait_ready()
        assert any("Seeding the demo book: 40 subscriptions" in line for line in serve.lines)
        # The billing loop ticks every 10 s in the dev stack; the drain then bills the book through localstripe.
        assert serve.wait_for_line("First drain completed", timeout_s=90), "\n".join(serve.lines)
        progress = [line for line in serve.lines if line.startswith("billing  due ")]
        assert progress, "no progress line before the first drain ended"
        summary = next(line for line in serve.lines if line.startswith("First drain completed"))
        attempted = int(summary.split(": ")[1].split(" attempted")[0])
        assert attempted >= 30  # the due part of the book (about 92%)
        done_at = serve.lines.index(summary)
        assert serve.lines[done_at + 1].strip().startswith("admin")
        assert "login: operator / " in serve.lines[done_at + 1]
        # The seed line, the last progress line and the summary count the same things the same way.
        due = int(re.search(r"seeded in [\d.]+ s: (\d+) due now", "\n".join(serve.lines)).group(1))
        counts = re.match(
            r"billing  due \d+ · billed (\d+) \(paid (\d+), declined (\d+)\) · failed (\d+)", serve.lines[done_at - 2]
        )
        billed, paid, declined, failed = map(int, counts.groups())
        assert summary.startswith(
            f"First drain completed: {due} attempted, {billed} billed (paid {paid}, declined {declined}), "
            f"{failed} failed (retry ladder)"
        ), (summary, serve.lines[done_at - 2])
        assert (
            serve.lines[done_at - 1].startswith("webhooks ") and "always-down demo endpoint" in serve.lines[done_at - 1]
        )
        assert any(line.strip().startswith("always-down    http://127.0.0.1:9/") for line in serve.lines)

        test_key = serve.banner_value("test key")
        status, invoices = serve.api("GET", "/v1/invoices?limit=100", test_key)
        assert status == 200 and len(invoices["data"]) >= 30
        assert {i["status"] for i in invoices["data"]} <= {"paid", "open"}
    finally:
        if serve.process.poll() is None:
            serve.process.send_signal(signal.SIGTERM)
            try:
                serve.process.wait(60)
            except subprocess.TimeoutExpired:
                serve.process.kill()


def test_the_banner_names_test_payment_methods_and_its_commands_bill_a_customer(tmp_path):
    serve = ServeProcess(tmp_path / "var")
    try:
        serve.wait_ready()
        banner = "\n".join(serve.lines)
        for pm in (
            "pm_card_visa",
            "pm_card_chargeDeclined",
            "pm_card_chargeCustomerFail",
            "pm_card_authenticationRequired",
        ):
            assert f"    {pm} " in banner
        start = next(i for i, line in enumerate(serve.lines) if line.strip().startswith("Bill a customer"))
        commands = []
        for line in serve.lines[start + 2 :]:
            if not line.startswith("    "):
                break
            commands.append(line[4:])

        # Run as printed: a customer with pm_card_visa, a price, a subscription; the billing loop bills it.
        done = subprocess.run(
            ["bash", "-e", "-c", "\n".join(commands)], capture_output=True, text=True, timeout=60, check=False
        )

        assert done.returncode == 0, done.stderr
        ids, status, invoices = done.stdout.splitlines()[:3]
        assert status == "active", done.stdout
        invoices = json.loads(invoices)["data"]
        assert [(i["status"], i["subscription"]) for i in invoices] == [("paid", ids.split()[2])]
        assert not any("payment_method_missing" in line for line in serve.lines)
    finally:
        if serve.process.poll() is None:
            serve.process.send_signal(signal.SIGTERM)
            try:
                serve.process.wait(60)
            except subprocess.TimeoutExpired:
                serve.process.kill()
