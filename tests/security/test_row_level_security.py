"""Row-level security: with the views' tenant filter removed, the database still answers nothing of another tenant.

docs/decisions/0130-row-level-security.md. Every test runs the real API through Django's test client
(tenant role, row-level security on); the set-up writes rows with the ORM as the connecting role, the
tables' owner, which bypasses the policies.
"""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection, transaction
from django.test import Client

from billing.api import runs as runs_api
from billing.models import BillingAttempt, BillingRun, Customer, Invoice
from dunning.models import DunningRun
from hardcount import api as hardcount_api
from hardcount import tenancy
from hardcount.times import database_now
from outbox import api as outbox_api
from outbox.models import Delivery, Event, WebhookEndpoint
from tests.api import conftest as api_fixtures
from tests.api.conftest import Api, create_catalog, create_invoice

# The API tests' fixtures: tenants with real keys and their clients.
acme, globex = api_fixtures.acme, api_fixtures.globex
api, live_api, other_api = api_fixtures.api, api_fixtures.live_api, api_fixtures.other_api

# (kind, list path) of every resource the brief of this defence names; detail is "<path>/<id>".
RESOURCES = [
    ("customer", "/v1/customers"),
    ("price", "/v1/prices"),
    ("subscription", "/v1/subscriptions"),
    ("invoice", "/v1/invoices"),
    ("event", "/v1/events"),
    ("webhook_endpoint", "/v1/webhook_endpoints"),
    ("delivery", "/v1/webhook_deliveries"),
    ("billing_run", "/v1/billing/runs"),
    ("scheduler_run", "/v1/billing/runs"),
    ("dunning_run", "/v1/dunning_runs"),
]


@pytest.fixture
def acme_rows(api, acme):
    """One row of every resource in Acme's test mode: through the API where it makes them, else the ORM."""
    objects = create_catalog(api)
    ids = {kind: objects[kind]["id"] for kind in ("customer", "price", "subscription")}
    status, endpoint = api.post("/v1/webhook_endpoints", {"url": "https://example.com/hook", "enabled_events": ["*"]})
    assert status == 201, endpoint
    ids["webhook_endpoint"] = endpoint["id"]
    invoice = create_invoice(ids["subscription"])
    ids["invoice"] = invoice.id
    event = Event.objects.filter(tenant=acme.tenant, livemode=False).order_by("-pk").first()
    ids["event"] = event.id
    endpoint_row = WebhookEndpoint.objects.get(pk=endpoint["id"])
    ids["delivery"] = (
        Delivery.objects.filter(event=event).first() or Delivery.objects.create(event=event, endpoint=endpoint_row)
    ).id
    now = database_now()
    ids["billing_run"] = BillingRun.objects.create(
        trigger=BillingRun.MANUAL, tenant=acme.tenant, livemode=False, as_of=now, started_at=now
    ).id
    scheduler_run = BillingRun.objects.create(
        trigger=BillingRun.SCHEDULER, tenant=None, livemode=False, as_of=now, started_at=now
    )
    BillingAttempt.objects.create(
        run=scheduler_run, subscription_id=ids["subscription"], outcome=BillingAttempt.BILLED, created_at=now
    )
    ids["scheduler_run"] = scheduler_run.id
    ids["dunning_run"] = DunningRun.objects.create(
        tenant=acme.tenant, livemode=False, invoice=invoice, first_declined_at=now, schedule_anchor_at=now
    ).id
    return ids


@pytest.fixture
def unscoped_views(monkeypatch):
    """The application's tenant filter removed from every view: ``scoped`` (and so ``get_scoped``), the
    deliveries' and the billing runs' own scoping return every row of the table."""

    def scoped(self, queryset):
        return queryset.objects.all() if isinstance(queryset, type) else queryset

    monkeypatch.setattr(hardcount_api.ApiView, "scoped", scoped)
    monkeypatch.setattr(outbox_api, "_deliveries", lambda view: Delivery.objects.select_related("event"))
    monkeypatch.setattr(runs_api._RunsMixin, "visible_runs", lambda self: BillingRun.objects.all())


def _list_ids(client: Api, path: str) -> set[str]:
    status, body = client.get(path, {"limit": 100})
    assert status == 200, body
    return {row["id"] for row in body["data"]}


def test_every_tenant_table_has_row_level_security_and_its_policy(db):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'tenant_id' AND NOT a.attisdropped"
            # A partitioned table's policy is its own (docs/reference/partitions.md); its partitions are
            # reachable only through it, the next test shows.
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
        )
        with_tenant = {row[0] for row in cursor.fetchall()}
        cursor.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_policy p ON p.polrelid = c.oid AND p.polname = 'tenant_isolation'"
            " WHERE n.nspname = 'public' AND c.relrowsecurity"
        )
        protected = {row[0] for row in cursor.fetchall()}
        cursor.execute(
            "SELECT rolsuper, rolbypassrls, rolcanlogin FROM pg_roles WHERE rolname = %s", [tenancy.TENANT_ROLE]
        )
        role = cursor.fetchone()
    children = {"billing_invoicelineitem", "billing_billingattempt", "outbox_delivery", "outbox_deliveryattempt"}
    assert with_tenant - protected == set()
    assert children - protected == set()
    assert "hardcount_tenant" in protected
    assert role == (False, False, False)


def test_the_tenant_role_reaches_only_tables_under_row_level_security(db):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, c.relrowsecurity FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind = 'r'"
            " AND has_table_privilege(%s, c.oid, 'SELECT, INSERT, UPDATE, DELETE')",
            [tenancy.TENANT_ROLE],
        )
        reachable = dict(cursor.fetchall())
    assert reachable, "the tenant role reaches no table"
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_class WHERE relispartition AND relname LIKE 'billing_meterevent_p%'")
        assert cursor.fetchone()[0] > 0  # partitions are among the tables looked at, and none is reachable
    # A new table the API uses needs a policy (or a reason and a grant of its own): this says which.
    assert {table for table, protected in reachable.items() if not protected} == set()
    assert "auth_user" not in reachable and "django_session" not in reachable


@pytest.mark.parametrize(("kind", "path"), RESOURCES)
def test_without_the_views_filter_another_tenant_still_reads_nothing(acme_rows, other_api, unscoped_views, kind, path):
    assert acme_rows[kind] not in _list_ids(other_api, path)
    status, body = other_api.get(f"{path}/{acme_rows[kind]}")
    assert status == 404, body
    assert body["error"]["code"] == "resource_missing"


def test_without_the_views_filter_the_other_mode_reads_nothing(acme_rows, live_api, unscoped_views):
    for kind, path in RESOURCES:
        assert acme_rows[kind] not in _list_ids(live_api, path), kind
        assert live_api.get(f"{path}/{acme_rows[kind]}")[0] == 404, kind


@pytest.mark.parametrize(("kind", "path"), RESOURCES)
def test_negative_control_without_row_level_security_the_same_views_leak(
    acme_rows, other_api, unscoped_views, monkeypatch, kind, path
):
    # The request stays the connecting role, which bypasses the policies: this test would see a leak.
    monkeypatch.setattr(tenancy, "enter", lambda tenant_id, livemode, using="default": None)
    assert acme_rows[kind] in _list_ids(other_api, path)
    status, body = other_api.get(f"{path}/{acme_rows[kind]}")
    assert status == 200, body
    assert body["id"] == acme_rows[kind]


def test_the_owner_still_sees_its_rows_under_row_level_security(acme_rows, api):
    for kind, path in RESOURCES:
        assert acme_rows[kind] in _list_ids(api, path), kind
        status, body = api.get(f"{path}/{acme_rows[kind]}")
        assert (status, body["id"]) == (200, acme_rows[kind]), kind


def test_a_write_through_the_api_gets_the_callers_tenant_and_mode(other_api, globex):
    status, body = other_api.post("/v1/customers", {"email": "b@example.com"})
    assert status == 201, body
    row = Customer.objects.get(pk=body["id"])
    assert (row.tenant_id, row.livemode) == (globex.tenant.pk, False)


def test_a_crafted_write_of_another_tenants_id_is_refused(acme, globex, acme_rows):
    tenancy.enter(globex.tenant.pk, False)
    try:
        assert tenancy.current_role() == tenancy.TENANT_ROLE
        with pytest.raises(DatabaseError, match="row-level security"), transaction.atomic():
            Customer.objects.create(tenant_id=acme.tenant.pk, livemode=False, email="x@example.com")
        with pytest.raises(DatabaseError, match="row-level security"), transaction.atomic():
            Customer.objects.create(tenant_id=globex.tenant.pk, livemode=True, email="x@example.com")
        # Another tenant's row is invisible to updates and deletes.
        assert Customer.objects.filter(pk=acme_rows["customer"]).update(email="stolen@example.com") == 0
        assert Invoice.objects.filter(pk=acme_rows["invoice"]).delete()[0] == 0
        # Moving an own row to another tenant is refused too.
        own = Customer.objects.create(tenant_id=globex.tenant.pk, livemode=False, email="own@example.com")
        with pytest.raises(DatabaseError, match="row-level security"), transaction.atomic():
            Customer.objects.filter(pk=own.pk).update(tenant_id=acme.tenant.pk)
    finally:
        tenancy.leave()
    assert Customer.objects.get(pk=acme_rows["customer"]).email == "buyer@example.com"
    assert Invoice.objects.filter(pk=acme_rows["invoice"]).exists()


def _session_state() -> tuple[str, str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_user, current_setting(%s, true), current_setting(%s, true)",
            [tenancy.TENANT_SETTING, tenancy.LIVEMODE_SETTING],
        )
        user, tenant_id, livemode = cursor.fetchone()
    return user, tenant_id or "", livemode or ""


def test_the_request_runs_as_the_tenant_role_and_gives_the_connection_back_clean(api, acme, monkeypatch):
    owner = _session_state()
    assert owner[0] != tenancy.TENANT_ROLE
    seen = []

    def spy(self, queryset):
        seen.append(_session_state())
        return queryset.objects.none() if isinstance(queryset, type) else queryset.none()

    monkeypatch.setattr(hardcount_api.ApiView, "scoped", spy)
    assert api.get("/v1/customers")[0] == 200
    assert seen == [(tenancy.TENANT_ROLE, acme.tenant.pk, "false")]
    assert _session_state() == (owner[0], "", "")


def test_the_connection_goes_back_clean_after_an_unhandled_exception(acme, monkeypatch):
    owner = _session_state()

    def boom(self, queryset):
        raise RuntimeError("a bug in a view")

    monkeypatch.setattr(hardcount_api.ApiView, "scoped", boom)
    client = Client(raise_request_exception=False)
    response = client.get("/v1/customers", HTTP_AUTHORIZATION=f"Bearer {acme.test}")
    assert response.status_code == 500
    assert _session_state() == (owner[0], "", "")


def test_unauthenticated_requests_never_switch_role(db):
    owner = _session_state()
    assert Client().get("/v1/customers").status_code == 401
    assert Client().get("/v1/customers", HTTP_AUTHORIZATION="Bearer hc_test_" + "x" * 32).status_code == 401
    assert _session_state() == owner


def test_a_background_connection_is_the_cross_tenant_owner_not_the_tenant_role(api):
    roles = []

    def background():
        try:
            roles.append(tenancy.current_role())
        finally:
            connection.close()

    tenancy.enter("ten_nobody", False)
    try:
        # Even while this thread's connection is the tenant, another thread's is its own, the owner's.
        thread = threading.Thread(target=background)
        thread.start()
        thread.join()
    finally:
        tenancy.leave()
    assert roles and roles[0] != tenancy.TENANT_ROLE
    assert roles[0] == tenancy.current_role()


@pytest.mark.django_db(transaction=True)
def test_the_tenant_holds_in_every_transaction_yet_nothing_is_left_on_the_session(acme):
    """Transaction pooling hands each transaction any server connection: the switch must live in transactions only."""

    def session_level() -> tuple[str, str]:
        # The raw connection, past Django's execute wrappers: what the session itself carries.
        row = connection.connection.execute(
            "SELECT current_user, COALESCE(current_setting(%s, true), '')", [tenancy.TENANT_SETTING]
        ).fetchone()
        return row[0], row[1]

    owner = tenancy.current_role()
    tenancy.enter(acme.tenant.pk, False)
    try:
        assert _session_state() == (tenancy.TENANT_ROLE, acme.tenant.pk, "false")  # a statement on its own
        for _ in range(2):  # one committed transaction, then the next one
            with transaction.atomic():
                assert _session_state() == (tenancy.TENANT_ROLE, acme.tenant.pk, "false")
        assert session_level() == (owner, "")
        # The control: a session-level switch is what the probe above would see.
        connection.connection.execute("SELECT set_config(%s, %s, false)", [tenancy.TENANT_SETTING, acme.tenant.pk])
        assert session_level() == (owner, acme.tenant.pk)
        connection.connection.execute(f"RESET {tenancy.TENANT_SETTING}")
    finally:
        tenancy.leave()
    assert _session_state() == (owner, "", "")
