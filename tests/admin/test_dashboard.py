"""The dashboard on the admin index: due, oldest due, waiting, parked, dunning, backlog, leaders and tick ages."""

from datetime import timedelta

import pytest
from django.db import connection

from dunning.models import DunningRun
from leases.models import LeaderLease
from ops.dashboard import dashboard, format_age
from outbox.models import Delivery
from tests.admin import rows
from tests.outbox.conftest import emit, make_endpoint

pytestmark = pytest.mark.django_db


def _db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@pytest.fixture
def trouble(tenant):
    """A book with something in every figure: 2 due (oldest 2 h), 1 waiting, 2 parked, 1 dunning, 1 backlog."""
    now = _db_now()
    rows.subscription(tenant, next_billing_at=now - timedelta(hours=2))
    rows.subscription(tenant, next_billing_at=now - timedelta(minutes=5))
    rows.subscription(tenant, next_billing_at=now + timedelta(days=3))  # not due yet
    rows.subscription(tenant, next_billing_at=now - timedelta(days=9), status="canceled")  # never billed again
    rows.waiting(tenant, next_billing_at=now - timedelta(hours=5))  # due, but waiting: not counted as due
    rows.parked(tenant, next_billing_at=now - timedelta(days=4))
    rows.parked(tenant, livemode=True)
    declined = rows.invoice(rows.subscription(tenant, livemode=True, status="past_due"))
    DunningRun.objects.create(
        tenant=tenant, livemode=True, invoice=declined, first_declined_at=now, schedule_anchor_at=now
    )
    make_endpoint(tenant, "https://example.com/hook")
    emit(tenant)
    Delivery.objects.update(fire_after=now - timedelta(seconds=1))
    LeaderLease.objects.create(
        role="billing",
        holder="web-1:4242:abcd",
        token=3,
        heartbeat_at=now,
        expires_at=now + timedelta(seconds=10),
        last_stamp_at=now - timedelta(seconds=20),
    )
    LeaderLease.objects.create(
        role="dunning",
        holder="web-2:7:beef",
        token=9,
        expires_at=now - timedelta(hours=1),
        last_stamp_at=now - timedelta(hours=1),
    )


def test_dashboard_figures_match_the_book(trouble):
    dash = dashboard()

    modes = {m.mode: m for m in dash.modes}
    test, live = modes["test"], modes["live"]
    assert (test.due, test.waiting, test.parked, test.dunning_in_progress) == (2, 1, 1, 0)
    assert (live.due, live.waiting, live.parked, live.dunning_in_progress) == (0, 0, 1, 1)
    assert 2 * 3600 <= test.oldest_due_age_s < 2 * 3600 + 60 and live.oldest_due_age_s == 0
    assert dash.delivery_backlog == 1
    roles = {r.role: r for r in dash.roles}
    assert (roles["billing"].holder, roles["billing"].token, roles["billing"].held) == ("web-1:4242:abcd", 3, True)
    assert 20 <= roles["billing"].tick_age_s < 80
    assert roles["dunning"].held is False and roles["dunning"].holder is None
    assert roles["dunning"].stale is True  # an hour old against a one-minute interval


def test_admin_index_renders_the_dashboard_with_links_to_the_lists_behind_it(trouble, operator):
    response = operator.get("/admin/")

    assert response.status_code == 200
    text = response.content.decode()
    assert 'id="billing-dashboard"' in text
    assert "web-1:4242:abcd" in text and "no leader" in text and "stale" in text
    assert "?mode=test&amp;billing_state=parked&amp;status__in=trialing,active,past_due" in text
    parked = operator.get(
        "/admin/billing/subscription/?mode=test&billing_state=parked&status__in=trialing,active,past_due"
    )
    assert len(parked.context["cl"].result_list) == 1  # the list behind the dashboard's number
    backlog = operator.get("/admin/outbox/delivery/?status__in=pending,retrying")
    assert len(backlog.context["cl"].result_list) == 1


def test_dashboard_reports_a_database_error_instead_of_failing_the_page(operator, monkeypatch):
    from outbox import metrics

    monkeypatch.setattr(metrics, "DELIVERY_BACKLOG", "SELECT count(*) FROM no_such_table")

    assert dashboard().error.startswith("The database did not answer")
    response = operator.get("/admin/")
    assert response.status_code == 200 and b"Dashboard unavailable" in response.content


def test_ages_read_like_an_operator_would_say_them():
    ages = (None, 42, 300, 3600, 5 * 3600 + 12 * 60, 2 * 86400 + 4 * 3600, 3 * 86400)
    assert [format_age(s) for s in ages] == ["—", "42 s", "5 min", "1 h", "5 h 12 min", "2 d 4 h", "3 d"]
