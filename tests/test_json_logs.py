"""HARDCOUNT_LOG_FORMAT=json: every log line is one JSON object with its time, level, logger, message and context."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from hardcount.logs import ContextFilter, JsonLineFormatter, bound, logging_config
from tests.api.conftest import Api, make_keys

ROOT = Path(__file__).resolve().parent.parent

# Logged by a process configured only by the environment, as production is: plain, with extra fields,
# inside a scheduler tick's context, with an exception, and a message with a newline and quotes.
SCRIPT = r"""
import logging
import django
django.setup()
from hardcount.logs import bound
log = logging.getLogger("hardcount.scheduler")
log.info("event=tick_completed role=billing token=7 duration_s=0.120 live_billed=3")
log.warning("two\nlines \"quoted\"", extra={"invoice": "in_123", "amount": 1000})
with bound(role="billing"):
    log.info("inside a tick")
log.debug("a detail")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("failed")
"""


def _run(log_format: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env = {**base, "DJANGO_SETTINGS_MODULE": "hardcount.settings", "HARDCOUNT_LOG_FORMAT": log_format}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_each_line_under_the_json_setting_is_one_json_object():
    done = _run("json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["message"] for line in lines] == [
        "event=tick_completed role=billing token=7 duration_s=0.120 live_billed=3",
        'two\nlines "quoted"',
        "inside a tick",
        "failed",
    ]  # the DEBUG line is below the default level
    for line in lines:
        assert {"timestamp", "level", "logger", "message"} <= set(line)
        assert line["logger"] == "hardcount.scheduler"
        stamp = datetime.fromisoformat(line["timestamp"])
        assert stamp.utcoffset() == timedelta(0)
    assert [line["level"] for line in lines] == ["INFO", "WARNING", "INFO", "ERROR"]
    assert (lines[1]["invoice"], lines[1]["amount"]) == ("in_123", 1000)
    assert lines[2]["role"] == "billing" and "role" not in lines[0]
    assert "ZeroDivisionError" in lines[3]["exc_info"]


def test_negative_control_the_default_text_lines_are_not_json():
    done = _run("text")
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert " INFO hardcount.scheduler event=tick_completed" in first
    with pytest.raises(json.JSONDecodeError):
        json.loads(first)


def test_an_unknown_format_refuses_to_configure():
    with pytest.raises(ImproperlyConfigured, match="HARDCOUNT_LOG_FORMAT"):
        logging_config("xml", "INFO")
    assert logging_config("json", "INFO")["handlers"]["console"]["formatter"] == "json"


@pytest.fixture
def json_lines():
    """Lines of the ``django.request`` logger, formatted as under HARDCOUNT_LOG_FORMAT=json."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLineFormatter())
    handler.addFilter(ContextFilter())
    logger = logging.getLogger("django.request")
    logger.addHandler(handler)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)


def test_a_request_line_names_its_request_id_tenant_mode_and_key(db, json_lines):
    from hardcount.models import ApiKey

    acme = make_keys("Acme")

    status, _ = Api(acme.test).get(
        "/v1/customers/cus_0000000000000000000000000a", headers={"X-Request-Id": "req-42.edge"}
    )
    assert status == 404
    (line,) = json_lines()
    key = ApiKey.objects.get(tenant=acme.tenant, livemode=False)
    assert line["level"] == "WARNING" and line["logger"] == "django.request"
    assert (line["request_id"], line["tenant"], line["livemode"], line["api_key"]) == (
        "req-42.edge",
        acme.tenant.id,
        False,
        key.pk,
    )
    assert acme.test not in json.dumps(line)


def test_a_request_without_a_usable_request_id_gets_a_new_one_and_no_tenant(db, json_lines):
    status, _ = Api(None).get("/v1/customers", headers={"X-Request-Id": "forged level=ERROR"})
    assert status == 401
    (line,) = json_lines()
    assert len(line["request_id"]) == 32 and " " not in line["request_id"]
    assert "tenant" not in line


def test_context_ends_with_the_request_and_with_the_block(db, json_lines):
    Api(None).get("/v1/customers")
    logging.getLogger("django.request").warning("after the request")
    with bound(role="dunning"):
        logging.getLogger("django.request").warning("in a tick")
    _, after, in_tick = json_lines()
    assert "request_id" not in after
    assert in_tick["role"] == "dunning" and "request_id" not in in_tick
