"""/metrics of a real three-worker gunicorn with the scheduler: one truth per scrape, whichever worker answers.

docs/decisions/0126-metrics-one-truth-per-scrape.md. The test starts gunicorn as ``make run`` does
(``hardcount/gunicorn.conf.py``, ``HARDCOUNT_RUN_SCHEDULER=1``, the default roles and the webhook
executor in every worker), makes webhook deliveries (succeeded, retryable and failed attempts) and
HTTP requests while it scrapes ``/metrics`` over a fresh connection each time, stops one worker
halfway (gunicorn replaces it), and checks that

- every counter series (``*_total``, and a histogram's buckets, count and sum) never goes down
  and never disappears from one scrape to the next, the stopped worker's counts included;
- ``hardcount_leader_is_leader{role="billing"}`` and ``{role="dunning"}`` are 1 on every scrape,
  and ``hardcount_leader_holder`` names the lease row's holder;
- several workers answered (the access log carries the worker's pid), and the counters add up
  over all of them: the attempts counter equals the attempt rows, the request counter covers
  every request the test made.

Negative control: set ``HARDCOUNT_METRICS_CONTROL_DIR`` to a checkout of the code before
decision 0126 (``git archive 213181e | tar -x -C DIR``) and
``test_negative_control_the_code_before_finds_resets_and_flips`` runs the same scrape loop against it
and requires a counter decrease or a leader flip.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from tests.leases.helpers import wait_until
from tests.outbox.conftest import Answer, Receiver, emit, make_endpoint
from tests.system.harness import BASE_DIR, database_url, free_port, lease

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

WORKERS = 3
SCRAPES = 36
LEADER_ROLES = ("billing", "dunning")
# Sample suffixes of cumulative series: a counter's value, a histogram's buckets, count and sum.
CUMULATIVE = ("_total", "_bucket", "_count", "_sum")
ACCESS_LINE = re.compile(r'^pid=<?(\d+)>? "GET (\S+) ')

Series = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Scrape:
    """One ``/metrics`` answer: cumulative samples, every sample, the leader flags and holders."""

    cumulative: dict[Series, float]
    values: dict[Series, float]
    is_leader: dict[str, float]
    holders: dict[str, list[str]]


def parse(text: str) -> Scrape:
    cumulative, values, is_leader, holders = {}, {}, {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            values[key] = sample.value
            if family.type in ("counter", "histogram") and sample.name.endswith(CUMULATIVE):
                cumulative[key] = sample.value
            if family.name == "hardcount_leader_is_leader":
                is_leader[sample.labels["role"]] = sample.value
            if family.name == "hardcount_leader_holder" and sample.value == 1:
                holders.setdefault(sample.labels["role"], []).append(sample.labels["holder"])
    return Scrape(cumulative, values, is_leader, holders)


def get(port: int, path: str) -> bytes:
    """GET over a new connection (urllib sends ``Connection: close``), so any worker may answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        return exc.read()


def violations(scrapes: list[Scrape]) -> list[tuple[int, str, str]]:
    """``(scrape number, metric, what)`` for every counter series that went down or vanished between
    consecutive scrapes, and every scrape whose leader flag of a role is not 1."""
    found = []
    for i, (before, after) in enumerate(itertools.pairwise(scrapes), start=2):
        for key, value in before.cumulative.items():
            if key not in after.cumulative:
                found.append((i, key[0], f"{key} vanished (was {value})"))
            elif after.cumulative[key] < value:
                found.append((i, key[0], f"{key} went down {value} -> {after.cumulative[key]}"))
    for i, scrape in enumerate(scrapes, start=1):
        for role in LEADER_ROLES:
            if scrape.is_leader.get(role) != 1:
                found.append((i, "hardcount_leader_is_leader", f"{role} = {scrape.is_leader.get(role)}"))
    return found


@dataclass
class Run:
    """What one scrape loop saw: the scrapes, the pids that answered them, the requests the test made."""

    scrapes: list[Scrape] = field(default_factory=list)
    metrics_pids: set[int] = field(default_factory=set)
    requests: int = 0
    stopped_worker: int = 0
    lease_holders: dict[str, str] = field(default_factory=dict)
    log: str = ""


def start_gunicorn(base_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "hardcount.settings",
        "HARDCOUNT_BIND": f"127.0.0.1:{port}",
        "HARDCOUNT_WEB_WORKERS": str(WORKERS),
        "HARDCOUNT_RUN_SCHEDULER": "1",
        "HARDCOUNT_OUTBOX_POLL_S": "0.1",
        "HARDCOUNT_OUTBOX_WORKERS": "2",
        "HARDCOUNT_OUTBOX_BREAKER_THRESHOLD": "1000",  # /flaky and /refused keep being tried
        "HARDCOUNT_LEASE_POLL_S": "0.2",
        "HARDCOUNT_DEVSTACK": "1",  # development settings: production ones want a secret key, hosts and HTTPS
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("HARDCOUNT_ROLES", "HARDCOUNT_SERVICES", "PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH"):
        env.pop(name, None)  # the defaults: every role, the executor; the product's own metrics directory
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "hardcount/gunicorn.conf.py",
            "--no-control-socket",
            "--access-logformat",
            'pid=%(p)s "%(r)s" %(s)s',
            "hardcount.wsgi",
        ],
        cwd=base_dir,
        env=env,
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
    )


def stop(gunicorn: subprocess.Popen) -> None:
    gunicorn.send_signal(signal.SIGTERM)
    try:
        gunicorn.wait(30)
    except subprocess.TimeoutExpired:
        gunicorn.kill()
        gunicorn.wait(10)


BOOTED = re.compile(r"Booting worker with pid: (\d+)")


def scrape_loop(base_dir: Path, tmp_path: Path, receiver: Receiver, tenant) -> Run:
    """Start gunicorn from ``base_dir``, make deliveries and requests while scraping; stop it; what it saw.

    Halfway through, one worker that leads neither billing nor dunning is stopped (SIGTERM) and
    gunicorn starts another: the counters it had counted must stay in the sums.
    """
    receiver.behave("/flaky", lambda r, n: Answer(status=503))  # retryable: retried a minute later
    receiver.behave("/refused", lambda r, n: Answer(status=400))  # failed for good
    for path in ("/ok", "/ok2", "/flaky", "/refused"):
        make_endpoint(tenant, receiver.url(path))
    port, log_path = free_port(), tmp_path / "gunicorn.log"
    gunicorn = start_gunicorn(base_dir, port, log_path)
    run = Run()

    def booted() -> list[int]:
        return [int(pid) for pid in BOOTED.findall(log_path.read_text())]

    try:
        assert wait_until(lambda: len(booted()) >= WORKERS, timeout_s=30), log_path.read_text()
        held = wait_until(lambda: all((row := lease(r)) and row["live"] for r in LEADER_ROLES), timeout_s=30)
        assert held, log_path.read_text()
        assert wait_until(lambda: get(port, "/health/live").startswith(b"{"), timeout_s=30)
        for i in range(SCRAPES):
            if i % 3 == 0:
                emit(tenant, "customer.created")  # four deliveries: two succeed, one retries, one fails
            if i == SCRAPES // 2:
                leaders = {int(lease(role)["holder"].split(":")[1]) for role in LEADER_ROLES}
                run.stopped_worker = next(pid for pid in booted() if pid not in leaders)
                os.kill(run.stopped_worker, signal.SIGTERM)
            for path in ("/health/live", "/health/live", "/no-such-page"):
                get(port, path)
                run.requests += 1
            run.scrapes.append(parse(get(port, "/metrics").decode()))
            time.sleep(0.1)
        assert wait_until(lambda: len(booted()) > WORKERS, timeout_s=30), "the stopped worker was not replaced"
        settled = wait_until(lambda: deliveries_settled(4 * (SCRAPES // 3)), timeout_s=30)
        assert settled, f"{delivery_states()} attempts {attempt_rows()}\n{log_path.read_text()[-3000:]}"
        for _ in range(4):
            run.scrapes.append(parse(get(port, "/metrics").decode()))
        run.lease_holders = {role: lease(role)["holder"] for role in LEADER_ROLES}
    finally:
        stop(gunicorn)
        run.log = log_path.read_text()
    for line in run.log.splitlines():
        match = ACCESS_LINE.match(line)
        if match and match.group(2) == "/metrics":
            run.metrics_pids.add(int(match.group(1)))
    return run


def deliveries_settled(count: int) -> bool:
    """All ``count`` deliveries made and none due or in flight: every attempt so far is committed."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), count(*) FILTER (WHERE claimed_by IS NOT NULL"
            " OR (status IN ('pending', 'retrying') AND fire_after <= now())) FROM outbox_delivery"
        )
        made, unsettled = cursor.fetchone()
    return made == count and unsettled == 0


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def tenant():
    from hardcount.models import Tenant

    return Tenant.objects.create(name="Acme")


def delivery_states() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT status, count(*) FROM outbox_delivery GROUP BY status")
        return dict(cursor.fetchall())


def attempt_rows() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT outcome, count(*) FROM outbox_deliveryattempt GROUP BY outcome")
        return dict(cursor.fetchall())


def test_every_scrape_tells_one_truth_whichever_worker_answers(tmp_path, receiver, tenant):
    run = scrape_loop(BASE_DIR, tmp_path, receiver, tenant)
    assert len(run.metrics_pids) >= 2, f"one worker answered every scrape: {run.metrics_pids}\n{run.log[-3000:]}"
    assert violations(run.scrapes) == [], run.log[-3000:]

    last = run.scrapes[-1]
    for role in LEADER_ROLES:
        holders = {tuple(s.holders.get(role, [])) for s in run.scrapes}
        assert holders == {(run.lease_holders[role],)}, f"{role}: holders seen {holders}, lease {run.lease_holders}"

    rows = attempt_rows()
    assert rows.get("succeeded", 0) >= 2 * (SCRAPES // 3) - 2  # a request cut short by the stop may retry later
    assert rows.get("retryable", 0) >= 1 and rows.get("failed", 0) >= 1
    for outcome in ("succeeded", "failed", "retryable", "lease_lost", "canceled"):
        # Counted in whichever worker made the attempt (the stopped one too), summed by every worker.
        series = ("hardcount_outbox_delivery_attempts_total", (("outcome", outcome),))
        assert last.values[series] == rows.get(outcome, 0), outcome

    requests_seen = sum(
        value for (name, _), value in last.cumulative.items() if name == "django_http_requests_total_by_method_total"
    )
    assert requests_seen >= run.requests + SCRAPES  # ours, and the scrapes themselves (counted once answered)
    print(
        f"\n{len(run.scrapes)} scrapes answered by {len(run.metrics_pids)} workers; "
        f"{len(last.cumulative)} counter series, none went down through worker {run.stopped_worker}'s stop;"
        f" attempts {rows}; requests {requests_seen:.0f}"
    )


# The last commit before decision 0126: in-process counters and per-process leader flags.
CODE_BEFORE = "213181e"


def checkout_before(target: Path) -> Path:
    """The product as it was at :data:`CODE_BEFORE`, unpacked from this clone's history into ``target``."""
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(BASE_DIR), "archive", CODE_BEFORE], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def test_negative_control_the_code_before_finds_resets_and_flips(tmp_path, receiver, tenant):
    base_dir = Path(os.environ.get("HARDCOUNT_METRICS_CONTROL_DIR") or checkout_before(tmp_path / "before")).resolve()
    run = scrape_loop(base_dir, tmp_path, receiver, tenant)
    found = violations(run.scrapes)
    by_metric = Counter(metric for _, metric, _ in found)
    print(f"\nthe code before, {len(run.scrapes)} scrapes by {len(run.metrics_pids)} workers: {len(found)} violations")
    for metric in ("hardcount_outbox_delivery_attempts_total", "hardcount_leader_is_leader"):
        print(f"  {metric}: {by_metric[metric]}, e.g. " + "; ".join(w for _, m, w in found if m == metric)[:400])
    print("  django_http_*: " + str(sum(n for m, n in by_metric.items() if m.startswith("django_http_"))))
    assert by_metric["hardcount_leader_is_leader"] or by_metric["hardcount_outbox_delivery_attempts_total"], (
        "the scrape loop found nothing wrong with the code before: it proves nothing"
    )
