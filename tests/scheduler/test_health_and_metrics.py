"""/health/live, /health/ready and /metrics: every metric of docs/reference/metrics.md, computed from the rows."""

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from billing.models import BillingAttempt, BillingRun, Customer, Price, Subscription, TestClock
from hardcount.metrics import measure_clock_skew_s
from hardcount.models import Tenant
from hardcount.scheduler import Runtime
from leases import services as leases
from outbox.models import Delivery, Event, WebhookEndpoint
from tests.leases.helpers import expire, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def intervals(settings):
    settings.HARDCOUNT_ROLES = ["billing.loops.BillingRole", "billing.loops.DunningRole"]
    settings.HARDCOUNT_BILLING_INTERVAL_S = 3600
    settings.HARDCOUNT_DUNNING_INTERVAL_S = 60
    settings.HARDCOUNT_LEASE_POLL_S = 0.05


def set_stamp(role: str, seconds_ago: float, *, tick: bool = True) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE leases_leaderlease SET last_stamp_at = now() - make_interval(secs => %s),"
            " last_tick_at = CASE WHEN %s THEN now() - make_interval(secs => %s) ELSE last_tick_at END"
            " WHERE role = %s",
            [seconds_ago, tick, seconds_ago, role],
        )


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_live_answers_200_without_touching_anything(client):
    response = client.get("/health/live")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/health/live", "/health/ready", "/metrics"])
def test_a_write_to_a_probe_is_a_405_naming_get_not_a_csrf_page(db, path):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)  # as a browser or a scraper without a session would meet it
    for method in (client.post, client.put, client.delete):
        response = method(path)
        assert (response.status_code, response["Allow"]) == (405, "GET"), (method, path)
        assert b"CSRF" not in response.content
    assert client.get(path).status_code in (200, 503)


def test_ready_lists_each_roles_holder_token_stamp_and_staleness(client):
    leases.acquire("billing", "host:1:aaaa", ttl_s=10)
    set_stamp("billing", 30)  # interval 1 h: fresh
    leases.acquire("dunning", "host:2:bbbb", ttl_s=10)
    leases.release("dunning", "host:2:bbbb", 1)
    set_stamp("dunning", 121)  # interval 60 s: older than 2 × interval

    response = client.get("/health/ready")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"] == "ok"
    billing, dunning = body["roles"]["billing"], body["roles"]["dunning"]
    assert (billing["holder"], billing["token"], billing["held"], billing["stale"]) == ("host:1:aaaa", 1, True, False)
    assert billing["stamp_age_s"] == pytest.approx(30, abs=2)
    assert billing["last_stamp_at"].endswith("Z")
    assert billing["interval_s"] == 3600
    assert (dunning["holder"], dunning["held"], dunning["stale"]) == (None, False, True)


def test_ready_reports_a_role_that_never_ran_as_stale(client):
    body = client.get("/health/ready").json()
    assert body["roles"]["billing"]["stale"] is True
    assert body["roles"]["billing"]["token"] is None


def make_book():
    """A live and a test book whose due, waiting, parked and clock subscriptions the metrics must tell apart."""
    now = timezone.now()
    tenant = Tenant.objects.create(name="Acme")
    books = {}
    for livemode in (True, False):
        customer = Customer.objects.create(tenant=tenant, livemode=livemode, email="a@example.com")
        price = Price.objects.create(tenant=tenant, livemode=livemode, amount=1000, currency="usd", interval="month")
        books[livemode] = (customer, price)

    def sub(livemode, next_billing_at, **fields):
        customer, price = books[livemode]
        fields.setdefault("status", "active")
        return Subscription.objects.create(
            tenant=tenant,
            livemode=livemode,
            customer=customer,
            price=price,
            billing_cycle_anchor=next_billing_at,
            next_billing_at=next_billing_at,
            **fields,
        )

    # live: 3 due (oldest 2 h), 1 waiting, 1 parked, 1 in the future, 1 canceled
    due = sub(True, now - timedelta(hours=2))
    sub(True, now - timedelta(minutes=30), status="trialing")
    sub(True, now - timedelta(hours=1), billing_failure_count=1, next_billing_attempt_at=now - timedelta(minutes=1))
    sub(True, now - timedelta(hours=3), billing_failure_count=2, next_billing_attempt_at=now + timedelta(hours=1))
    sub(True, now - timedelta(hours=5), billing_failure_count=8, billing_parked_at=now - timedelta(hours=4))
    sub(True, now + timedelta(days=1))
    sub(True, now - timedelta(hours=10), status="canceled")
    # test: 1 due (10 min), 1 due by the wall clock but on a test clock (billed only by its clock)
    sub(False, now - timedelta(minutes=10))
    clock = TestClock.objects.create(tenant=tenant, livemode=False, frozen_time=now)
    sub(False, now - timedelta(days=3), test_clock=clock)

    def run(livemode, trigger, duration_s, outcomes=()):
        started = now - timedelta(hours=1)
        finished = None if duration_s is None else started + timedelta(seconds=duration_s)
        r = BillingRun.objects.create(
            trigger=trigger, livemode=livemode, as_of=started, started_at=started, finished_at=finished
        )
        for outcome in outcomes:
            BillingAttempt.objects.create(run=r, subscription=due, outcome=outcome, created_at=started)
        return r

    run(True, "scheduler", 0.2, ["billed", "billed", "failed"])
    run(False, "scheduler", 3, ["declined"])
    run(True, "scheduler", 100)
    run(True, "scheduler", None)  # still running: no duration yet
    run(True, "manual", 50, ["billed"])  # API-triggered: counted as an outcome, not a cycle

    endpoint = WebhookEndpoint.objects.create(
        tenant=tenant, livemode=True, url="https://example.com/hook", enabled_events=["*"], secret="whsec_x"
    )
    event = Event.objects.create(tenant=tenant, livemode=True, type="invoice.paid", data={})

    def delivery(**fields):
        Delivery.objects.create(event=event, endpoint=endpoint, **fields)

    delivery(status="pending", fire_after=now - timedelta(minutes=1))
    delivery(status="retrying", fire_after=now - timedelta(minutes=5))
    delivery(
        status="pending",
        fire_after=now - timedelta(minutes=5),
        claimed_by="x",
        claim_expires_at=now - timedelta(seconds=5),
    )
    delivery(
        status="pending",
        fire_after=now - timedelta(minutes=5),
        claimed_by="y",
        claim_expires_at=now + timedelta(seconds=30),
    )
    delivery(status="pending", fire_after=now + timedelta(minutes=5))
    delivery(status="succeeded", fire_after=now - timedelta(minutes=5))


def test_metrics_expose_every_spec_metric_with_values_computed_from_the_rows(client):
    make_book()
    leases.acquire("billing", "elsewhere:1:aaaa", ttl_s=10)
    leases.complete_tick("billing", "elsewhere:1:aaaa", 1)
    set_stamp("billing", 42, tick=False)  # a drain page 42 s ago; the last completed tick is newer
    leases.acquire("expired-role", "gone:1:cccc", ttl_s=10)
    expire("expired-role")  # the holder is still written, but its lease ran out by the database's clock
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXTRACT(EPOCH FROM last_tick_at)::float8 FROM leases_leaderlease WHERE role = 'billing'")
        last_tick_epoch = cursor.fetchone()[0]

    class Local:
        name = "local-role"
        interval_s = 3600

        def tick(self, ctx):
            return {}

    runtime = Runtime([Local()], [])
    runtime.start()
    try:
        assert wait_until(lambda: runtime.leadership()["local-role"])
        m = scrape(client)
    finally:
        runtime.stop(5)

    def value(name, **labels):
        return m[(name, tuple(sorted(labels.items())))]

    assert value("hardcount_scheduler_last_run_timestamp_seconds", role="billing") == pytest.approx(last_tick_epoch)
    assert value("hardcount_leader_last_tick_age_seconds", role="billing") == pytest.approx(42, abs=2)
    # From the lease table, so the same whichever process is scraped: billing is held elsewhere.
    assert value("hardcount_leader_is_leader", role="local-role") == 1
    assert value("hardcount_leader_is_leader", role="billing") == 1
    assert value("hardcount_leader_is_leader", role="dunning") == 0  # configured, never held
    # A lease that is not a configured role is shown only while held: once its holder is gone it
    # leaves no "no leader" series behind (a tenant's manual run takes such a lease).
    assert ("hardcount_leader_is_leader", (("role", "expired-role"),)) not in m
    holders = {labels: v for (name, labels), v in m.items() if name == "hardcount_leader_holder"}
    assert holders == {
        (("holder", "elsewhere:1:aaaa"), ("role", "billing")): 1,
        (("holder", runtime.holder), ("role", "local-role")): 1,
    }

    assert value("hardcount_billing_due_subscriptions", mode="live") == 3
    assert value("hardcount_billing_due_subscriptions", mode="test") == 1
    assert value("hardcount_billing_oldest_due_age_seconds", mode="live") == pytest.approx(7200, abs=5)
    assert value("hardcount_billing_oldest_due_age_seconds", mode="test") == pytest.approx(600, abs=5)
    assert value("hardcount_billing_failing_subscriptions", mode="live", state="waiting") == 2
    assert value("hardcount_billing_failing_subscriptions", mode="live", state="parked") == 1
    assert value("hardcount_billing_failing_subscriptions", mode="test", state="waiting") == 0
    assert value("hardcount_billing_paused_subscriptions", mode="live") == 0
    assert value("hardcount_billing_paused_subscriptions", mode="test") == 0

    assert value("hardcount_billing_cycle_duration_seconds_count") == 3
    assert value("hardcount_billing_cycle_duration_seconds_sum") == pytest.approx(103.2)
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="0.1") == 0
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="0.5") == 1
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="5.0") == 2
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="60.0") == 2
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="300.0") == 3
    assert value("hardcount_billing_cycle_duration_seconds_bucket", le="+Inf") == 3

    assert value("hardcount_billing_invoices_total", mode="live", outcome="billed") == 3
    assert value("hardcount_billing_invoices_total", mode="live", outcome="failed") == 1
    assert value("hardcount_billing_invoices_total", mode="test", outcome="declined") == 1

    assert value("hardcount_outbox_deliveries_due_backlog") == 3
    assert abs(value("hardcount_clock_skew_seconds")) < 1  # one machine, one clock


def test_metrics_expose_the_delivery_attempts_counter_of_the_executor(client):
    from outbox.metrics import DELIVERY_ATTEMPTS

    before = scrape(client).get(("hardcount_outbox_delivery_attempts_total", (("outcome", "succeeded"),)), 0)
    DELIVERY_ATTEMPTS.labels("succeeded").inc()
    after = scrape(client)[("hardcount_outbox_delivery_attempts_total", (("outcome", "succeeded"),))]
    assert after == before + 1


def test_clock_skew_is_the_app_clock_minus_the_database_clock(monkeypatch):
    import time as real_time

    import hardcount.metrics

    class AheadClock:
        @staticmethod
        def time():
            return real_time.time() + 100

    monkeypatch.setattr(hardcount.metrics, "time", AheadClock)
    assert measure_clock_skew_s() == pytest.approx(100, abs=1)


def test_a_database_error_drops_the_database_metrics_and_the_scrape_still_answers(client, monkeypatch):
    from django.db import DatabaseError

    import hardcount.metrics

    class BrokenStore:
        def lease_statuses(self):
            raise DatabaseError("the database went away")

    monkeypatch.setattr(hardcount.metrics, "lease_store", BrokenStore)
    names = {name for name, _ in scrape(client)}
    assert not {n for n in names if n.startswith("hardcount_leader_") or n.startswith("hardcount_billing_")}
    assert "hardcount_outbox_delivery_attempts_total" in names  # a process counter: still there


def write_worker_counter(directory, pid: int, outcome: str, value: float) -> None:
    """What a gunicorn worker's counter leaves in the multiprocess directory (prometheus_client's file format)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from outbox.metrics import DELIVERY_ATTEMPTS

    name = "hardcount_outbox_delivery_attempts"
    worker_file = MmapedDict(str(directory / f"counter_{pid}.db"))
    worker_file.write_value(
        mmap_key(name, f"{name}_total", ["outcome"], [outcome], DELIVERY_ATTEMPTS._documentation), value, 0.0
    )
    worker_file.close()


def test_in_multiprocess_mode_every_worker_serves_the_sum_of_all_workers_counters(client, monkeypatch, tmp_path):
    import hardcount.metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(hardcount.metrics, "_registry", None)  # built again, in multiprocess mode
    write_worker_counter(tmp_path, 101, "succeeded", 12)
    write_worker_counter(tmp_path, 102, "succeeded", 8)  # a second worker, or one that has exited
    write_worker_counter(tmp_path, 102, "retryable", 3)
    leases.acquire("billing", "elsewhere:1:aaaa", ttl_s=10)

    m = scrape(client)
    assert m[("hardcount_outbox_delivery_attempts_total", (("outcome", "succeeded"),))] == 20
    assert m[("hardcount_outbox_delivery_attempts_total", (("outcome", "retryable"),))] == 3
    assert m[("hardcount_leader_is_leader", (("role", "billing"),))] == 1  # the collector is served too
    assert not any(name.startswith("process_") for name, _ in m)  # per-process collectors are left out
