"""``seed_demo``: the demo book is deterministic for a seed, has the mix it advertises, and is clean; what
``make run`` prints of it (seed line, progress line, drain summary) counts the same rows the same way."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime

import pytest
from django.core.management import CommandError, call_command

from billing.models import BillingRun, Customer, LedgerEntry, Subscription
from billing.periods import period_start
from billing.services.drain import drain_due
from devstack.demo_progress import DemoWatch, drain_summary, read_progress
from devstack.seed import CARD_DECLINES, CARD_OK, CARD_UNKNOWN_PREFIX, FAILING_WEBHOOK_URL
from hardcount.models import Tenant
from ops import doctor
from outbox.models import Delivery, Event, WebhookEndpoint
from tests.billing.conftest import localstripe_base, proxy_session, stripe_proxy  # noqa: F401 - fixtures

# March 1st: the 29th-31st anchors fall in January, and February clamps their next period to the 28th.
NOW = "2027-03-01T09:30:00Z"
NOW_AT = datetime(2027, 3, 1, 9, 30, tzinfo=UTC)
RECEIVER = "http://127.0.0.1:1/receiver"


def _seed(tenant: str, *extra: str) -> str:
    call_command(
        "seed_demo",
        "--subscriptions",
        "200",
        "--tenant",
        tenant,
        "--now",
        NOW,
        "--webhook-url",
        RECEIVER,
        *extra,
        stdout=io.StringIO(),
    )
    return Tenant.objects.get(name=tenant).id


def _book(tenant_id: str) -> list[tuple]:
    """Everything about a tenant's book except ids and creation times, in customer order."""
    rows = []
    for sub in (
        Subscription.objects.filter(tenant_id=tenant_id)
        .select_related("customer", "price")
        .order_by("customer__external_id")
    ):
        c, p = sub.customer, sub.price
        rows.append(
            (
                c.external_id, c.email, c.name, c.default_payment_method, c.currency, c.credit_balance,
                p.nickname, p.amount, p.currency, p.interval,
                sub.status, sub.billing_cycle_anchor, sub.next_billing_at, sub.trial_end,
            )
        )  # fmt: skip
    return rows


@pytest.mark.django_db
def test_same_seed_gives_the_same_book_and_another_seed_another():
    first = _book(_seed("First", "--seed", "1"))
    again = _book(_seed("Again", "--seed", "1"))
    other = _book(_seed("Other", "--seed", "2"))

    assert len(first) == 200
    assert first == again
    assert first != other


@pytest.mark.django_db
def test_book_has_the_advertised_mix():
    tenant_id = _seed("Mix", "--seed", "1")
    subs = list(Subscription.objects.filter(tenant_id=tenant_id).select_related("customer", "price"))
    cards = [s.customer.default_payment_method for s in subs]

    assert len(subs) == 200 and Customer.objects.filter(tenant_id=tenant_id).count() == 200
    assert cards.count(CARD_DECLINES) == 6  # 3%
    assert sum(card.startswith(CARD_UNKNOWN_PREFIX) for card in cards) == 2  # 1%
    assert cards.count(CARD_OK) == 192
    assert all(s.customer.name and "@" in s.customer.email for s in subs)
    assert {s.price.currency for s in subs} == {"usd", "eur", "jpy"}
    assert {s.price.interval for s in subs} == {"week", "month", "year"}
    assert all(s.customer.currency == s.price.currency for s in subs)

    due = [s for s in subs if s.next_billing_at <= NOW_AT]
    trialing = [s for s in subs if s.status == Subscription.TRIALING]
    assert len(due) == 184 and len(trialing) == 16  # most due now; trials end in the future
    assert all(s.trial_end > NOW_AT and s.next_billing_at == s.trial_end for s in trialing)
    # Every due subscription's first period has begun; a yearly or weekly one has exactly one period due.
    for s in due:
        assert s.billing_cycle_anchor <= NOW_AT and s.periods_billed == 0
        if s.price.interval != "month":
            assert period_start(s.billing_cycle_anchor, s.price.interval, 1, 1) > NOW_AT
    monthly_days = {s.billing_cycle_anchor.day for s in due if s.price.interval == "month"}
    assert {29, 30, 31} <= monthly_days and len(monthly_days) == 31

    credited = Customer.objects.filter(tenant_id=tenant_id, credit_balance__gt=0)
    assert credited.count() == 10  # 5%
    assert LedgerEntry.objects.filter(tenant_id=tenant_id, reason=LedgerEntry.GRANT).count() == 10

    endpoints = WebhookEndpoint.objects.filter(tenant_id=tenant_id, enabled=True)
    assert sorted(e.url for e in endpoints) == sorted([RECEIVER, FAILING_WEBHOOK_URL])
    events = Event.objects.filter(tenant_id=tenant_id)
    assert events.filter(type="customer.created").count() == 200
    assert events.filter(type="subscription.created").count() == 200
    assert Delivery.objects.filter(event__tenant_id=tenant_id).count() == 2 * events.count()


@pytest.mark.django_db
def test_seeded_book_passes_the_doctor():
    _seed("Clean", "--seed", "3")

    failing = {r.name: r.examples for r in doctor.run_checks() if r.status != doctor.OK}

    assert failing == {}


@pytest.mark.django_db
def test_a_tenant_with_a_book_is_left_alone_unless_forced():
    tenant_id = _seed("Twice", "--seed", "1")

    with pytest.raises(CommandError, match="already has test-mode subscriptions"):
        _seed("Twice", "--seed", "1")
    assert Subscription.objects.filter(tenant_id=tenant_id).count() == 200

    _seed("Twice", "--seed", "1", "--force")
    assert Subscription.objects.filter(tenant_id=tenant_id).count() == 400
    # The endpoints are reused, not doubled.
    assert WebhookEndpoint.objects.filter(tenant_id=tenant_id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_seed_line_progress_line_and_drain_summary_agree_and_survive_a_restart(stripe_proxy):  # noqa: F811
    tenant = Tenant.objects.create(name="Demo")
    lines: list[str] = []
    watch = DemoWatch(tenant.id, write=lines.append, done_lines=lambda: ["  admin …"])

    assert watch.start(webhook_url=None, subscriptions=60)
    seeded = re.search(r"(\d+) due now \((\d+) with a card that declines, (\d+) with one that fails", lines[-1])
    due, declining, failing = map(int, seeded.groups())
    before = read_progress(tenant.id)
    assert before.due == due and before.billed == 0 and before.failed == 0
    assert watch.line().startswith(f"billing  due {due} · billed 0 (paid 0, declined 0)")

    run = drain_due(livemode=False, trigger=BillingRun.SCHEDULER)
    printed = watch.line().splitlines()
    after = read_progress(tenant.id)
    summary = drain_summary(tenant.id, run, since=watch.since)

    # One set of words: the drain's billed are the invoices paid or declined, its failed the ladder.
    assert (summary.attempted, summary.billed, summary.failed) == (run.attempted, run.billed, run.failed)
    assert (summary.paid, summary.declined, summary.failed) == (after.paid, after.declined, after.failed)
    assert summary.attempted == due == summary.billed + summary.failed
    assert 0 < after.declined <= declining and 0 < after.failed <= failing  # credit may pay a few in full
    assert printed[0] == f"billing  {after.text().splitlines()[0]}"
    assert printed[2].startswith(
        f"First drain completed: {due} attempted, {after.billed} billed (paid {after.paid}, declined "
        f"{after.declined}), {after.failed} failed (retry ladder)"
    )
    assert printed[3] == "  admin …"
    # The always-down endpoint's deliveries are counted apart (nothing delivers in this test).
    assert after.delivered == 0 and after.down_pending > 0 and after.down_circuit_open is False

    # A restarted serve reads the same counts from the rows: nothing is kept in memory.
    restarted = DemoWatch(tenant.id, write=lines.append, done_lines=list)
    assert not restarted.start(webhook_url=None, subscriptions=60)
    assert restarted.line().splitlines()[:2] == f"billing  {after.text()}".splitlines()
