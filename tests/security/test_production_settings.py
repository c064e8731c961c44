"""Production settings refuse to start unsafe, and pass ``manage.py check --deploy`` (docs/operations.md).

Production is ``HARDCOUNT_DEVSTACK=0`` (the Procfile's processes). Each test loads the settings in
a process of its own with exactly the environment it states; ``DATABASE_URL`` names a server that
does not exist, which proves nothing here connects to a database.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "x7Qm2-vRt9LpZk4Wn8Hs3Jd6Fb1Yc5Ga0Ue2Ti7Oo9Pl4Mk8Nj3Bh6Vg1Cf5Dx0Sz"
PRODUCTION = {
    "HARDCOUNT_DEVSTACK": "0",
    "SECRET_KEY": SECRET,
    "HARDCOUNT_ALLOWED_HOSTS": "billing.example.com",
    # A Fernet key (url-safe base64 of 32 bytes) for the gateway secrets.
    "HARDCOUNT_SECRETS_KEYS": "bXktMzItYnl0ZS1wcm9kdWN0aW9uLWtleS0wMDAwMDA=",
    "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nothing",
}
# drf-spectacular's deploy check builds the OpenAPI document and reports its enum-naming
# collisions (fields named "object" and "status" with different choices): a matter of the
# document's component names, not of the deployment.
SCHEMA_NAMING = "drf_spectacular.W001"


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python <args>`` in the repository with only ``env`` (and PATH/HOME) for configuration."""
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**base, "DJANGO_SETTINGS_MODULE": "hardcount.settings", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def check_ids(output: str) -> list[tuple[str, str]]:
    """The (check id, line) pairs of a ``manage.py check`` report."""
    return [(m.group(1), line) for line in output.splitlines() if (m := re.search(r"\(([\w.]+\.[EW]\d+)\)", line))]


def test_check_deploy_passes_under_the_documented_production_settings():
    done = run(["manage.py", "check", "--deploy"], PRODUCTION)
    assert done.returncode == 0, done.stderr
    found = check_ids(done.stdout + done.stderr)
    assert [line for check, line in found if check != SCHEMA_NAMING] == []
    assert all("enum naming" in line for _, line in found)


def test_check_deploy_fails_with_the_development_security_settings():
    # The negative control: development's cookies and headers are what --deploy warns about.
    done = run(
        ["manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        {**PRODUCTION, "HARDCOUNT_SECURE_COOKIES": "0", "HARDCOUNT_SSL_REDIRECT": "0", "HARDCOUNT_HSTS_SECONDS": "0"},
    )
    assert done.returncode != 0
    ids = {check for check, _ in check_ids(done.stdout + done.stderr)}
    assert {"security.W004", "security.W008", "security.W012", "security.W016"} <= ids


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        (("SECRET_KEY",), ["SECRET_KEY is not set"]),
        (("HARDCOUNT_ALLOWED_HOSTS",), ["HARDCOUNT_ALLOWED_HOSTS is not set"]),
        (("SECRET_KEY", "HARDCOUNT_ALLOWED_HOSTS"), ["SECRET_KEY is not set", "HARDCOUNT_ALLOWED_HOSTS is not set"]),
    ],
)
def test_production_without_its_secret_key_or_hosts_exits_naming_what_is_missing(missing, named):
    env = {k: v for k, v in PRODUCTION.items() if k not in missing}
    done = run(["manage.py", "check", "--deploy"], env)
    assert done.returncode != 0
    assert "Production settings (HARDCOUNT_DEVSTACK=0) refuse to start" in done.stderr
    for message in named:
        assert message in done.stderr
    for other in {"SECRET_KEY is not set", "HARDCOUNT_ALLOWED_HOSTS is not set"} - set(named):
        assert other not in done.stderr


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"SECRET_KEY": "hardcount-development-key-not-for-production"}, "SECRET_KEY is the development key"),
        ({"SECRET_KEY": ""}, "SECRET_KEY is not set"),
        ({"HARDCOUNT_ALLOWED_HOSTS": ""}, "HARDCOUNT_ALLOWED_HOSTS is not set"),
        ({"HARDCOUNT_DEBUG": "1"}, "HARDCOUNT_DEBUG is on"),
        ({"HARDCOUNT_SECRETS_KEYS": ""}, "HARDCOUNT_SECRETS_KEYS is not set"),
        ({"HARDCOUNT_SECRETS_KEYS": "not-a-fernet-key"}, "every key must be a Fernet key"),
    ],
)
def test_production_refuses_development_values(override, named):
    done = run(["manage.py", "check"], {**PRODUCTION, **override})
    assert done.returncode != 0
    assert named in done.stderr


def test_the_web_application_itself_refuses_to_load():
    # What gunicorn imports: the worker fails to boot, so the master stops instead of serving.
    env = {k: v for k, v in PRODUCTION.items() if k != "SECRET_KEY"}
    done = run(["-c", "import hardcount.wsgi"], env)
    assert done.returncode != 0
    assert "SECRET_KEY is not set" in done.stderr


PROBE = """
import json, django
django.setup()
from django.conf import settings
from django.test import Client
client = Client()
plain = client.get("/admin/login/", HTTP_HOST="billing.example.com")
https = client.get("/admin/login/", HTTP_HOST="billing.example.com", HTTP_X_FORWARDED_PROTO="https")
health = client.get("/health/live", HTTP_HOST="billing.example.com")
print(json.dumps({
    "settings": {name: getattr(settings, name) for name in (
        "DEBUG", "ALLOWED_HOSTS", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT",
        "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD", "SECURE_PROXY_SSL_HEADER",
        "SECURE_CONTENT_TYPE_NOSNIFF", "X_FRAME_OPTIONS", "HARDCOUNT_PRODUCTION")},
    "plain": [plain.status_code, plain.get("Location")],
    "https": [https.status_code, https.get("Strict-Transport-Security"), https.get("X-Frame-Options"),
              https.get("X-Content-Type-Options"), str(https.cookies.get("csrftoken", ""))],
    "health": health.status_code,
    "other_host": client.get("/health/live", HTTP_HOST="evil.example.net").status_code,
}))
"""


def probe(env: dict[str, str]) -> dict:
    done = run(["-c", PROBE], env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_production_serves_over_https_only():
    seen = probe(PRODUCTION)
    assert seen["settings"] == {
        "DEBUG": False,
        "ALLOWED_HOSTS": ["billing.example.com"],
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_SSL_REDIRECT": True,
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
        "SECURE_CONTENT_TYPE_NOSNIFF": True,
        "X_FRAME_OPTIONS": "DENY",
        "HARDCOUNT_PRODUCTION": True,
    }
    assert seen["plain"] == [301, "https://billing.example.com/admin/login/"]
    status, hsts, frame, nosniff, csrf_cookie = seen["https"]
    assert status == 200
    assert hsts == "max-age=31536000; includeSubDomains; preload"
    assert (frame, nosniff) == ("DENY", "nosniff")
    assert "secure" in csrf_cookie.lower() and "httponly" not in csrf_cookie.lower()
    assert seen["health"] == 200  # probes speak plain HTTP inside the deployment: not redirected
    assert seen["other_host"] == 400


def test_development_needs_no_environment_and_keeps_its_defaults():
    seen = probe({"DATABASE_URL": PRODUCTION["DATABASE_URL"]})  # only so that no embedded server starts
    assert seen["settings"]["HARDCOUNT_PRODUCTION"] is False
    assert seen["settings"]["ALLOWED_HOSTS"] == ["*"]
    assert seen["settings"]["SESSION_COOKIE_SECURE"] is False
    assert seen["settings"]["SECURE_SSL_REDIRECT"] is False
    assert seen["settings"]["SECURE_HSTS_SECONDS"] == 0
    assert seen["settings"]["SECURE_PROXY_SSL_HEADER"] is None
    assert seen["plain"][0] == 200
