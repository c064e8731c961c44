"""Rate limits per API key (docs/decisions/0128-api-rate-limits.md): a token bucket per key in PostgreSQL.

Attacks: one key firing requests as fast as it can (reads, writes, billing runs), with a
retry under the same ``Idempotency-Key``; from two connections at once, as two workers or
replicas would. Time is the database's: tests that need time to pass move the bucket's
``updated_at`` back instead of sleeping, except the one that checks the real clock.
"""

from __future__ import annotations

import threading
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from billing.models import Customer
from hardcount import ratelimit
from hardcount.models import ApiKey, IdempotencyRecord, RateLimit, RateLimitBucket
from tests.api.conftest import Api, make_keys

# Slow enough that no token comes back while a test runs (one per 1000 s).
NO_REFILL = 0.001


@pytest.fixture
def acme(db):
    return make_keys("Acme")


@pytest.fixture
def globex(db):
    return make_keys("Globex")


def limit(settings, bucket: str, *, per_s: float, burst: int) -> None:
    settings.HARDCOUNT_RATE_LIMITS = {**settings.HARDCOUNT_RATE_LIMITS, bucket: {"per_s": per_s, "burst": burst}}


def backdate(key: str, bucket: str, seconds: float) -> None:
    """Make ``seconds`` pass for the bucket of ``key`` (the full secret) without waiting."""
    api_key = ApiKey.objects.get(key_hint=key[:14])
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE hardcount_ratelimitbucket SET updated_at = updated_at - make_interval(secs => %s)"
            " WHERE api_key_id = %s AND bucket = %s",
            [seconds, api_key.pk, bucket],
        )


def statuses(api: Api, n: int, path: str = "/v1/customers") -> list[int]:
    return [api.get(path)[0] for _ in range(n)]


def test_a_burst_over_the_limit_is_429_with_retry_after_and_the_error_body(acme, settings):
    limit(settings, "read", per_s=NO_REFILL, burst=3)
    api = Api(acme.test)
    assert statuses(api, 3) == [200, 200, 200]

    response = api.response("get", "/v1/customers")
    assert response.status_code == 429
    assert response["Content-Type"] == "application/json"
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= 1000
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "rate_limited", None)
    assert f"Retry after {retry_after} s" in error["message"]
    # Every path of the key shares the read bucket; refused requests take nothing more from it.
    assert api.get("/v1/prices")[0] == 429
    bucket = RateLimitBucket.objects.get(api_key__key_hint=acme.test[:14], bucket="read")
    assert bucket.tokens < 1 and not bucket.allowed


def test_a_refused_write_writes_nothing_and_its_idempotency_key_stays_free(acme, settings):
    limit(settings, "write", per_s=NO_REFILL, burst=1)
    api = Api(acme.test)
    assert api.post("/v1/customers", {"email": "first@example.com"})[0] == 201
    headers = {"Idempotency-Key": "retry-me"}

    status, body = api.post("/v1/customers", {"email": "second@example.com"}, headers=headers)
    assert (status, body["error"]["code"]) == (429, "rate_limited")
    assert Customer.objects.count() == 1
    assert not IdempotencyRecord.objects.exists()

    # Once the bucket has a token, the retry under the same key executes (the 429 was never stored).
    backdate(acme.test, "write", 1 / NO_REFILL)
    status, created = api.post("/v1/customers", {"email": "second@example.com"}, headers=headers)
    assert status == 201
    assert created["email"] == "second@example.com"
    assert IdempotencyRecord.objects.get(key="retry-me").response_status == 201


def test_another_key_is_not_slowed(acme, globex, settings):
    limit(settings, "read", per_s=NO_REFILL, burst=2)
    limit(settings, "write", per_s=NO_REFILL, burst=2)
    acme_api = Api(acme.test)
    assert statuses(acme_api, 3) == [200, 200, 429]

    assert statuses(Api(globex.test), 2) == [200, 200], "another tenant's key"
    assert statuses(Api(acme.live), 2) == [200, 200], "the same tenant's other key"
    assert acme_api.post("/v1/customers", {"email": "a@example.com"})[0] == 201, "writes have their own bucket"


def test_the_bucket_refills_with_database_time_up_to_its_burst(acme, settings):
    limit(settings, "read", per_s=0.1, burst=2)  # a token every 10 s
    api = Api(acme.test)
    assert statuses(api, 3) == [200, 200, 429]

    backdate(acme.test, "read", 10)
    assert statuses(api, 2) == [200, 429], "10 s give one token back"

    backdate(acme.test, "read", 3600)
    assert statuses(api, 3) == [200, 200, 429], "an hour fills the bucket to its burst, no further"


def test_the_bucket_refills_in_real_time_after_retry_after(acme, settings):
    limit(settings, "read", per_s=5, burst=1)
    api = Api(acme.test)
    for _ in range(50):
        response = api.response("get", "/v1/customers")
        if response.status_code == 429:
            break
    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    time.sleep(1)
    assert api.get("/v1/customers")[0] == 200


def test_billing_runs_are_limited_hardest_with_the_shipped_defaults(acme):
    from django.conf import settings

    limits = settings.HARDCOUNT_RATE_LIMITS
    run = limits["billing_run"]
    assert run["per_s"] < limits["write"]["per_s"] and run["per_s"] < limits["read"]["per_s"]
    assert run["per_s"] * 60 <= 5, "a few runs a minute"
    assert run["burst"] < limits["write"]["burst"]

    api = Api(acme.test)
    assert [api.post("/v1/billing/run", {})[0] for _ in range(run["burst"])] == [200] * run["burst"]
    response = api.response("post", "/v1/billing/run", data="{}", content_type="application/json")
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 10
    assert "billing run" in response.json()["error"]["message"]
    # Other writes and reads of the key go on.
    assert api.post("/v1/customers", {"email": "a@example.com"})[0] == 201
    assert api.get("/v1/billing/runs")[0] == 200


def test_a_tenants_own_limit_replaces_the_default(acme, globex, settings):
    limit(settings, "read", per_s=NO_REFILL, burst=50)
    out = StringIO()
    call_command("ratelimit", acme.tenant.pk, "read", "--per-s", str(NO_REFILL), "--burst", "2", stdout=out)
    assert "read: 0.001/s, burst 2 (its own)" in out.getvalue()
    assert RateLimit.objects.get(tenant=acme.tenant, bucket="read").burst == 2

    assert statuses(Api(acme.test), 3) == [200, 200, 429]
    assert statuses(Api(globex.test), 3) == [200, 200, 200]
    message = Api(acme.test).get("/v1/customers")[1]["error"]["message"]
    assert "at most 2 at once" in message

    call_command("ratelimit", acme.tenant.pk, "read", "--default", stdout=StringIO())
    assert not RateLimit.objects.exists()
    backdate(acme.test, "read", 50 / NO_REFILL)
    assert statuses(Api(acme.test), 3) == [200, 200, 200], "the default (50 at once) applies again"


def test_the_command_refuses_impossible_limits(acme):
    for args in (["read", "--per-s", "0", "--burst", "5"], ["read", "--per-s", "1", "--burst", "0"], ["read"]):
        with pytest.raises(CommandError):
            call_command("ratelimit", acme.tenant.pk, *args, stdout=StringIO())
    assert not RateLimit.objects.exists()


def test_unauthenticated_requests_and_the_switch(acme, settings):
    limit(settings, "read", per_s=NO_REFILL, burst=1)
    assert [Api(None).get("/v1/customers")[0] for _ in range(3)] == [401] * 3
    assert not RateLimitBucket.objects.exists()

    settings.HARDCOUNT_RATE_LIMIT = False
    assert statuses(Api(acme.test), 3) == [200, 200, 200]


def test_every_operation_documents_429(db):
    document = Api(None).client.get("/v1/openapi.json").json()
    for path, item in document["paths"].items():
        if not path.startswith("/v1/"):
            continue  # Stripe's webhook endpoint has no API key, so no key's bucket (docs/reference/payments.md)
        for method, operation in item.items():
            assert "429" in operation["responses"], (method, path)


def test_two_connections_share_one_bucket(transactional_db, settings):
    """Two workers (or replicas) are two connections to the database: together they get ``burst`` requests."""
    limit(settings, "write", per_s=NO_REFILL, burst=6)
    keys = make_keys("Shared")
    key = ApiKey.objects.get(key_hint=keys.test[:14])
    start = threading.Barrier(2)
    allowed: list[bool] = []
    sessions: set[int] = set()

    def worker():
        conn = connections.create_connection("default")
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                sessions.add(cursor.fetchone()[0])
            start.wait()
            for _ in range(10):
                decision = ratelimit.take(api_key_id=key.pk, tenant_id=keys.tenant.pk, bucket="write", using=conn)
                allowed.append(decision.allowed)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(sessions) == 2, "two database sessions"
    assert len(allowed) == 20
    assert allowed.count(True) == 6

    # The web process's own connection sees the same, emptied bucket.
    assert Api(keys.test).post("/v1/customers", {"email": "a@example.com"})[0] == 429
    assert Api(keys.test).get("/v1/customers")[0] == 200, "reads are another bucket"
