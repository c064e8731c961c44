"""Oversized and malformed requests get the API's JSON error body, never an HTML page.

The product's limits (hardcount.limits.RequestLimitsMiddleware) are checked through Django's
test client; then every attack of the red-team pass is sent with raw sockets to a real
gunicorn started with hardcount/gunicorn.conf.py, where what gunicorn itself refuses is
answered by hardcount.limits.JsonErrorWorker.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from django.test import Client

ERROR_KEYS = {"type", "code", "message", "param"}


def _assert_error(status: int, content_type: str, body: bytes, expected_status: int, code: str, param=None):
    assert status == expected_status, body
    assert content_type.startswith("application/json"), (content_type, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert error["message"]


# --- the middleware, through Django's test client ------------------------------------------------------------------


def test_a_10000_character_bearer_key_is_431(db):
    response = Client().get("/v1/customers", HTTP_AUTHORIZATION="Bearer sk_test_" + "k" * 10_000)
    _assert_error(
        response.status_code,
        response["Content-Type"],
        response.content,
        431,
        "request_header_fields_too_large",
        "Authorization",
    )


def test_a_request_target_over_4_kib_is_414(db):
    response = Client().get("/v1/customers?limit=1&" + "a" * 5000)
    _assert_error(response.status_code, response["Content-Type"], response.content, 414, "uri_too_long")


def test_more_than_100_header_fields_is_431(db):
    headers = {f"HTTP_X_FILLER_{i}": "x" for i in range(120)}
    response = Client().get("/v1/customers", **headers)
    _assert_error(
        response.status_code, response["Content-Type"], response.content, 431, "request_header_fields_too_large"
    )


@pytest.mark.parametrize("value", ["a\x7fb", "a\x00b", "a\nb", "\x1b[31m"])
def test_a_control_character_in_a_header_is_400_naming_it(db, value):
    response = Client().post("/v1/customers", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=value)
    _assert_error(
        response.status_code, response["Content-Type"], response.content, 400, "invalid_header", "Idempotency-Key"
    )


def test_requests_within_the_limits_are_untouched(db):
    response = Client().get("/v1/customers?" + "limit=1&" * 10, HTTP_X_LONG="v" * 8000, HTTP_X_TAB="a\tb")
    assert response.status_code == 401  # the request reached authentication


# --- a real gunicorn, raw sockets ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gunicorn(django_db_setup, tmp_path_factory):
    """gunicorn with hardcount/gunicorn.conf.py on a free port (one worker, no scheduler, no executor)."""
    from tests.system.harness import BASE_DIR, database_url, free_port

    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "HARDCOUNT_BIND": f"127.0.0.1:{port}",
        "HARDCOUNT_WEB_WORKERS": "1",
        "HARDCOUNT_RUN_SCHEDULER": "0",
        "HARDCOUNT_SERVICES": "",
    }
    log = (tmp_path_factory.mktemp("gunicorn") / "gunicorn.log").open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "hardcount/gunicorn.conf.py", "--no-control-socket", "hardcount.wsgi"],
        cwd=BASE_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _, _ = raw_request(port, b"GET /health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                if status == 200:
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"gunicorn did not start:\n{log.read()}")
            time.sleep(0.2)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def raw_request(port: int, data: bytes) -> tuple[int, str, bytes]:
    """Send ``data`` as it is; returns ``(status, content type, body)`` of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading everything: the answer is still there
        response = http.client.HTTPResponse(sock, method="GET")
        response.begin()
        return response.status, response.getheader("Content-Type", ""), response.read()


def _get(target: bytes, *headers: bytes) -> bytes:
    return (
        b"GET "
        + target
        + b" HTTP/1.1\r\nHost: t\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"Connection: close\r\n\r\n"
    )


ATTACKS = [
    # (name, request, status, code, param)
    (
        "10,000-character bearer key",
        _get(b"/v1/customers", b"Authorization: Bearer " + b"k" * 10_000),
        431,
        "request_header_fields_too_large",
        "Authorization",
    ),
    ("request line over 4 KB", _get(b"/v1/customers?" + b"a" * 5000), 414, "uri_too_long", None),
    ("request line over gunicorn's maximum", _get(b"/v1/customers?" + b"a" * 9000), 414, "uri_too_long", None),
    (
        "DEL byte in Idempotency-Key",
        b"POST /v1/customers HTTP/1.1\r\nHost: t\r\nIdempotency-Key: a\x7fb\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        400,
        "invalid_header",
        "Idempotency-Key",
    ),
    ("NUL byte in a header", _get(b"/v1/customers", b"X-Note: a\x00b"), 400, "invalid_header", "X-Note"),
    (
        "a 40 KB header",
        _get(b"/v1/customers", b"X-Big: " + b"b" * 40_000),
        431,
        "request_header_fields_too_large",
        None,
    ),
    (
        "150 header fields",
        _get(b"/v1/customers", *(b"X-F%d: v" % i for i in range(150))),
        431,
        "request_header_fields_too_large",
        None,
    ),
    (
        "2,000 header fields",
        _get(b"/v1/customers", *(b"X-F%d: v" % i for i in range(2000))),
        431,
        "request_header_fields_too_large",
        None,
    ),
    ("a header name with a space", _get(b"/v1/customers", b"Bad Name: v"), 400, "invalid_header", None),
    ("garbage request line", b"HELLO\r\n\r\n", 400, "invalid_request_line", None),
]


@pytest.mark.system
@pytest.mark.parametrize(("name", "request_bytes", "status", "code", "param"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_gunicorn_answers_every_attack_with_the_json_error(gunicorn, name, request_bytes, status, code, param):
    got_status, content_type, body = raw_request(gunicorn, request_bytes)
    _assert_error(got_status, content_type, body, status, code, param)
    assert b"<html" not in body.lower()


@pytest.mark.system
def test_gunicorn_still_serves_ordinary_requests(gunicorn):
    status, content_type, body = raw_request(gunicorn, _get(b"/v1/customers", b"Authorization: Bearer sk_test_nope"))
    assert status == 401 and content_type.startswith("application/json")
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert raw_request(gunicorn, _get(b"/health/live"))[0] == 200


@pytest.mark.parametrize(
    "path",
    [
        "/admin/billing/invoice/%00/change/",
        "/admin/billing/customer/cus_%00/change/",
        "/admin/outbox/event/%00/change/",
        "/admin/hardcount/tenant/%00/change/",
        "/v1/customers/%00",
    ],
)
def test_a_nul_in_the_path_is_a_json_404_even_for_a_logged_in_operator(db, path):
    from django.contrib.auth.models import User

    client = Client()
    client.force_login(User.objects.create_superuser("nul-path-operator", "op@example.com", "pw-for-tests-only"))
    response = client.get(path)
    _assert_error(response.status_code, response["Content-Type"], response.content, 404, "resource_missing")
