"""The web side as real processes: /health/ready without a database, and the runtime inside gunicorn workers."""

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from django.db import connection

from tests.leases.helpers import wait_until
from tests.system.harness import BASE_DIR, database_url, free_port, lease, scratch_rows
from tests.system.roles import CREATE_TABLE

pytestmark = pytest.mark.system

PROBE = """
import django
django.setup()
from django.test import Client
client = Client()
for path in ("/health/live", "/health/ready"):
    response = client.get(path)
    print(path, response.status_code, response.content.decode())
"""


def test_ready_answers_503_and_live_200_when_the_database_is_unreachable():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "hardcount.settings",
        # A real server, a database that does not exist: every connection attempt fails.
        "DATABASE_URL": database_url().replace(f"/{connection.settings_dict['NAME']}?", "/no_such_database?"),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    lines = {line.split(" ", 1)[0]: line.split(" ", 2)[1:] for line in result.stdout.splitlines()}
    assert lines["/health/live"][0] == "200", result.stdout + result.stderr
    assert lines["/health/ready"][0] == "503"
    body = json.loads(lines["/health/ready"][1])
    assert body["status"] == "unavailable"
    assert body["database"] == "unreachable"


@pytest.fixture
def scratch(transactional_db):
    with connection.cursor() as cursor:
        cursor.execute(CREATE_TABLE)
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS system_scratch")


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_gunicorn_workers_run_the_runtime_one_leader_among_them_and_release_on_stop(scratch, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "HARDCOUNT_BIND": f"127.0.0.1:{port}",
        "HARDCOUNT_WEB_WORKERS": "2",
        "HARDCOUNT_RUN_SCHEDULER": "1",
        "HARDCOUNT_ROLES": "tests.system.roles.ScratchRole",
        "HARDCOUNT_SERVICES": "",
        "SCRATCH_INTERVAL_S": "0.5",
    }
    log = (tmp_path / "gunicorn.log").open("w+")
    gunicorn = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "hardcount/gunicorn.conf.py", "hardcount.wsgi"],
        cwd=BASE_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert wait_until(lambda: len(scratch_rows()) >= 3, timeout_s=30), "no worker ever ticked"
        holders = {row[0] for row in scratch_rows()}
        assert len(holders) == 1  # two workers, one leader
        (holder,) = holders
        worker_pid = int(holder.split(":")[1])
        assert worker_pid != gunicorn.pid  # the runtime runs in a worker, not the arbiter

        status, body = get_json(f"http://127.0.0.1:{port}/health/ready")
        assert status == 200
        assert body["roles"]["scratch"]["holder"] == holder
        assert body["roles"]["scratch"]["stale"] is False
    finally:
        gunicorn.send_signal(signal.SIGTERM)
        try:
            gunicorn.wait(30)
        finally:
            if gunicorn.poll() is None:
                gunicorn.kill()
    log.seek(0)
    output = log.read()
    assert gunicorn.returncode == 0, output
    assert "event=lease_released role=scratch" in output
    assert lease("scratch")["holder"] is None  # released by the worker on its way out, not left to expire
