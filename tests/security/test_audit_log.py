"""The operators' audit log (hardcount.audit): every admin operation and credential change, append-only.

Each kind of action leaves exactly one entry per object it touched, naming who (the staff
user, the API key, or the command line's user), when (database time), what (action, object
type and id, a message) and from where (the client's address, ``cli`` for commands). The
table refuses UPDATE and DELETE in the database itself, and no entry holds a secret: every
secret the tests are given (API keys shown once, signing secrets, a new password) is looked
for in every entry.
"""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import Client
from django.urls import reverse

from hardcount import audit
from hardcount.admin import AuditedAdmin
from hardcount.models import ApiKey, AuditLogEntry, AuditLogImmutable, Tenant
from outbox.models import Delivery
from tests.admin import rows
from tests.api.conftest import Api, make_keys
from tests.outbox.conftest import emit, make_endpoint

OPERATOR_ADDRESS = "203.0.113.7"
API_ADDRESS = "198.51.100.23"
NEW_PASSWORD = "Correct-Horse-Battery-9-Staple"


@pytest.fixture
def operator_user(db):
    return User.objects.create_superuser("audited-operator", "op@example.com", "pw-for-tests-only")


@pytest.fixture
def operator(operator_user):
    client = Client(REMOTE_ADDR=OPERATOR_ADDRESS)
    client.force_login(operator_user)
    return client


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def entries(action: str) -> list[AuditLogEntry]:
    return list(AuditLogEntry.objects.filter(action=action).order_by("pk"))


def only(action: str) -> AuditLogEntry:
    found = entries(action)
    assert len(found) == 1, (action, found)
    return found[0]


def assert_by_operator(entry: AuditLogEntry, user: User, obj, *, tenant_id: str = "") -> None:
    assert (entry.actor_type, entry.actor_id, entry.actor_label) == ("user", str(user.pk), user.username)
    assert (entry.object_type, entry.object_id) == (obj._meta.label_lower, str(obj.pk))
    assert entry.tenant_id == tenant_id
    assert entry.remote_addr == OPERATOR_ADDRESS


def post_action(client: Client, model: str, action: str, pks: list, **extra):
    url = reverse(f"admin:{model}_changelist")
    return client.post(url, {"action": action, "_selected_action": pks, **extra}, follow=True)


# --- credentials ------------------------------------------------------------------------------------------------------


def test_creating_a_tenant_in_the_admin_records_the_tenant_and_each_key(operator, operator_user):
    before = db_now()
    response = operator.post(reverse("admin:hardcount_tenant_add"), {"name": "Initech"})
    after = db_now()
    assert response.status_code == 200

    tenant = Tenant.objects.get(name="Initech")
    created = only("tenant.created")
    assert_by_operator(created, operator_user, tenant, tenant_id="")
    assert before <= created.created_at <= after
    issued = entries("api_key.issued")
    assert sorted(e.object_id for e in issued) == sorted(
        ApiKey.objects.filter(tenant=tenant).values_list("pk", flat=True)
    )
    for entry, key in zip(issued, sorted(ApiKey.objects.filter(tenant=tenant), key=lambda k: k.pk), strict=True):
        assert_by_operator(entry, operator_user, key, tenant_id=tenant.pk)
        assert key.key_hint in entry.message
    assert AuditLogEntry.objects.count() == 3
    # Django's own history still records the addition.
    assert LogEntry.objects.filter(object_id=tenant.pk).count() == 1


def test_creating_a_key_in_the_admin_records_one_issue(operator, operator_user, tenant):
    response = operator.post(reverse("admin:hardcount_apikey_add"), {"tenant": tenant.pk, "mode": "live"})
    assert response.status_code == 200
    key = ApiKey.objects.get(tenant=tenant)
    entry = only("api_key.issued")
    assert_by_operator(entry, operator_user, key, tenant_id=tenant.pk)
    assert key.key_hint in entry.message and "live" in entry.message
    assert AuditLogEntry.objects.count() == 1


def test_revoking_keys_records_each_key_revoked(operator, operator_user, tenant):
    first, _ = ApiKey.issue(tenant, livemode=False)
    second, _ = ApiKey.issue(tenant, livemode=True)
    post_action(operator, "hardcount_apikey", "revoke", [first.pk, second.pk])
    assert sorted(e.object_id for e in entries("api_key.revoked")) == sorted([first.pk, second.pk])
    for entry in entries("api_key.revoked"):
        key = ApiKey.objects.get(pk=entry.object_id)
        assert_by_operator(entry, operator_user, key, tenant_id=tenant.pk)
        assert key.revoked_at is not None

    # Revoking a revoked key changes nothing and records nothing.
    post_action(operator, "hardcount_apikey", "revoke", [first.pk])
    assert len(entries("api_key.revoked")) == 2


def test_createtenant_records_the_tenant_and_its_keys_from_the_command_line(db):
    out = StringIO()
    call_command("createtenant", "Hooli", "--json", stdout=out)
    result = json.loads(out.getvalue())

    created = only("tenant.created")
    assert (created.actor_type, created.remote_addr) == ("cli", "cli")
    assert created.actor_id  # the operating-system user
    assert (created.object_type, created.object_id) == ("hardcount.tenant", result["tenant"]["id"])
    issued = entries("api_key.issued")
    assert {e.object_id for e in issued} == {result["test_key"]["id"], result["live_key"]["id"]}
    assert {(e.actor_type, e.remote_addr, e.tenant_id) for e in issued} == {("cli", "cli", result["tenant"]["id"])}


def test_setting_and_clearing_a_tenants_rate_limit_is_recorded(tenant):
    call_command("ratelimit", tenant.pk, "write", "--per-s", "5", "--burst", "10", stdout=StringIO())
    call_command("ratelimit", tenant.pk, "write", "--default", stdout=StringIO())
    set_, cleared = only("rate_limit.set"), only("rate_limit.cleared")
    for entry in (set_, cleared):
        assert (entry.actor_type, entry.remote_addr, entry.tenant_id) == ("cli", "cli", tenant.pk)
        assert (entry.object_type, entry.object_id) == ("hardcount.ratelimit", f"{tenant.pk}:write")
    assert "5/s, burst 10" in set_.message


# --- webhook endpoints through the API ----------------------------------------------------------------------------


def test_webhook_endpoint_creation_change_and_deletion_record_the_key_that_made_them(db):
    keys = make_keys("Acme")
    key = ApiKey.objects.get(tenant=keys.tenant, livemode=False)
    api = Api(keys.test)
    api.client.defaults["REMOTE_ADDR"] = API_ADDRESS
    body = {"url": "https://hooks.example.com/in?token=receivers-own", "enabled_events": ["invoice.*"]}
    headers = {"Idempotency-Key": "create-once"}

    status, endpoint = api.post("/v1/webhook_endpoints", body, headers=headers)
    assert status == 201
    assert api.post("/v1/webhook_endpoints", body, headers=headers)[0] == 201  # a replay executes nothing
    assert api.post(f"/v1/webhook_endpoints/{endpoint['id']}", {"enabled": False})[0] == 200
    assert api.response("delete", f"/v1/webhook_endpoints/{endpoint['id']}").status_code == 200

    for action in ("webhook_endpoint.created", "webhook_endpoint.updated", "webhook_endpoint.deleted"):
        entry = only(action)
        assert (entry.actor_type, entry.actor_id, entry.actor_label) == ("api_key", key.pk, key.key_hint)
        assert (entry.object_type, entry.object_id, entry.tenant_id) == (
            "outbox.webhookendpoint",
            endpoint["id"],
            keys.tenant.pk,
        )
        assert entry.remote_addr == API_ADDRESS
        assert "https://hooks.example.com/in" in entry.message
        assert "receivers-own" not in entry.message, "the URL's query may hold the receiver's credentials"
    assert "enabled" in only("webhook_endpoint.updated").message


def test_a_refused_endpoint_change_records_nothing(db):
    keys = make_keys("Acme")
    api = Api(keys.test)
    status, _ = api.post("/v1/webhook_endpoints", {"url": "http://127.0.0.1/hook", "enabled_events": ["*"]})
    assert status == 422
    assert not AuditLogEntry.objects.exists()


# --- admin actions on billing and the outbox --------------------------------------------------------------------


def test_each_billing_action_records_one_entry_per_row_with_its_outcome(operator, operator_user, tenant):
    healthy = rows.subscription(tenant)
    doomed = rows.subscription(tenant)
    paid = rows.invoice(rows.subscription(tenant), status="paid")
    open_ = rows.invoice(rows.subscription(tenant))

    post_action(operator, "billing_subscription", "retry_billing", [healthy.pk])
    post_action(operator, "billing_subscription", "cancel_now", [doomed.pk])  # the confirmation page only
    assert not entries("subscription.cancel")
    post_action(operator, "billing_subscription", "cancel_now", [doomed.pk], confirmed="yes")
    post_action(operator, "billing_invoice", "retry_payment", [paid.pk])
    post_action(operator, "billing_invoice", "void", [open_.pk], confirmed="yes")

    retried = only("subscription.retry_billing")
    assert_by_operator(retried, operator_user, healthy, tenant_id=tenant.pk)
    assert retried.message.startswith("Refused:")
    canceled = only("subscription.cancel")
    assert_by_operator(canceled, operator_user, doomed, tenant_id=tenant.pk)
    assert canceled.message == "Canceled now."
    charged = only("invoice.retry_payment")
    assert_by_operator(charged, operator_user, paid, tenant_id=tenant.pk)
    assert "only open invoices can be paid" in charged.message
    voided = only("invoice.void")
    assert_by_operator(voided, operator_user, open_, tenant_id=tenant.pk)
    assert voided.message == "Voided."
    assert AuditLogEntry.objects.count() == 4


def test_replaying_a_delivery_records_the_new_delivery(operator, operator_user, tenant):
    make_endpoint(tenant, "https://example.com/hook")
    emit(tenant, "invoice.paid")
    original = Delivery.objects.get()
    Delivery.objects.filter(pk=original.pk).update(status=Delivery.FAILED)

    post_action(operator, "outbox_delivery", "replay", [original.pk])
    replay = Delivery.objects.get(replay_of=original)
    post_action(operator, "outbox_delivery", "replay", [replay.pk])  # still queued: refused

    replayed, refused = entries("delivery.replay")
    assert_by_operator(replayed, operator_user, original, tenant_id=tenant.pk)
    assert replayed.message == f"Replayed as {replay.pk}."
    assert_by_operator(refused, operator_user, replay, tenant_id=tenant.pk)
    assert refused.message.startswith("Refused:")


# --- Django's own add, change, delete ---------------------------------------------------------------------------


def test_admin_add_change_and_delete_are_recorded_with_the_address(operator, operator_user):
    staff = User.objects.create_user("support", "support@example.com", "old-password-1", is_staff=True)

    response = operator.post(reverse("admin:auth_group_add"), {"name": "support"})
    assert response.status_code == 302
    group = Group.objects.get(name="support")
    response = operator.post(
        reverse("admin:auth_user_password_change", args=[staff.pk]),
        {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"},
    )
    assert response.status_code == 302, response.content[:2000]
    response = operator.post(reverse("admin:auth_group_delete", args=[group.pk]), {"post": "yes"})
    assert response.status_code == 302

    added, changed, deleted = only("admin.add"), only("admin.change"), only("admin.delete")
    assert_by_operator(added, operator_user, group)
    assert_by_operator(changed, operator_user, staff)
    assert "password" in changed.message.lower()
    assert (deleted.object_type, deleted.object_id, deleted.remote_addr) == (
        "auth.group",
        str(group.pk),
        OPERATOR_ADDRESS,
    )
    assert not Group.objects.exists()


def test_every_admin_is_audited():
    unaudited = [m._meta.label for m, a in admin.site._registry.items() if not isinstance(a, AuditedAdmin)]
    assert unaudited == []


# --- append-only, no secrets, visible in the admin -------------------------------------------------------------


def test_the_database_refuses_to_change_or_delete_an_entry(tenant):
    entry = audit.record("tenant.created", obj=tenant, actor=audit.Actor.cli(), message="original")
    for statement in (
        lambda: AuditLogEntry.objects.filter(pk=entry.pk).update(message="rewritten"),
        lambda: AuditLogEntry.objects.filter(pk=entry.pk).delete(),
        lambda: AuditLogEntry.objects.all().delete(),
    ):
        with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
            statement()
    for sql in ("UPDATE hardcount_auditlogentry SET actor_id = 'someone-else'", "DELETE FROM hardcount_auditlogentry"):
        with pytest.raises(IntegrityError, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    with pytest.raises(AuditLogImmutable):
        entry.save()
    with pytest.raises(AuditLogImmutable):
        entry.delete()
    entry.refresh_from_db()
    assert (entry.message, entry.actor_type) == ("original", "cli")


def test_unregistered_actions_and_actorless_entries_are_refused(tenant):
    with pytest.raises(ValueError, match="Unregistered"):
        audit.record("tenant.renamed", obj=tenant, actor=audit.Actor.cli())
    with pytest.raises(ValueError):
        audit.record("tenant.created", obj=tenant)
    assert not AuditLogEntry.objects.exists()


def test_no_entry_holds_a_secret(operator, operator_user, tenant):
    secrets: list[str] = []
    # Keys issued by the admin (read from its page shown once), by createtenant and by ApiKey.issue.
    page = operator.post(reverse("admin:hardcount_tenant_add"), {"name": "Initech"})
    secrets += [secret for _key, secret in page.context["keys"]]
    page = operator.post(reverse("admin:hardcount_apikey_add"), {"tenant": tenant.pk, "mode": "test"})
    secrets += [secret for _key, secret in page.context["keys"]]
    out = StringIO()
    call_command("createtenant", "Hooli", "--json", stdout=out)
    result = json.loads(out.getvalue())
    secrets += [result["test_key"]["secret"], result["live_key"]["secret"]]
    keys = make_keys("Acme")
    secrets += [keys.test, keys.live]
    # A signing secret, shown once by the API, and the endpoint's changes.
    status, endpoint = Api(keys.test).post(
        "/v1/webhook_endpoints", {"url": "https://hooks.example.com/in", "enabled_events": ["*"]}
    )
    assert status == 201
    secrets.append(endpoint["secret"])
    Api(keys.test).post(f"/v1/webhook_endpoints/{endpoint['id']}", {"description": "changed"})
    Api(keys.test).response("delete", f"/v1/webhook_endpoints/{endpoint['id']}")
    # A password set in the admin; then every key revoked.
    staff = User.objects.create_user("support", "support@example.com", "old-password-1", is_staff=True)
    operator.post(
        reverse("admin:auth_user_password_change", args=[staff.pk]),
        {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"},
    )
    secrets.append(NEW_PASSWORD)
    post_action(operator, "hardcount_apikey", "revoke", list(ApiKey.objects.values_list("pk", flat=True)))
    # A caller that slips a secret into a message gets it masked.
    audit.record("admin.change", obj=tenant, request=None, actor=audit.Actor.cli(), message=f"pasted {keys.test}")

    hashes = list(ApiKey.objects.values_list("key_hash", flat=True))
    assert len(secrets) == 9 and AuditLogEntry.objects.count() >= 15
    for entry in AuditLogEntry.objects.all():
        text = " ".join(str(value) for value in AuditLogEntry.objects.filter(pk=entry.pk).values().get().values())
        for secret in [*secrets, *hashes]:
            assert secret not in text, (entry.action, entry.message)
    assert "pasted [secret]" in AuditLogEntry.objects.get(message__startswith="pasted").message
    for log in LogEntry.objects.all():
        for secret in secrets:
            assert secret not in f"{log.object_repr} {log.change_message}"


def test_the_admin_lists_and_filters_the_log_and_nobody_can_edit_it(operator, operator_user, tenant):
    subscription = rows.subscription(tenant)
    post_action(operator, "billing_subscription", "retry_billing", [subscription.pk])
    call_command("createtenant", "Hooli", stdout=StringIO())
    url = reverse("admin:hardcount_auditlogentry_changelist")

    def listed(params=None) -> set[str]:
        response = operator.get(url, params or {})
        assert response.status_code == 200
        return {entry.action for entry in response.context["cl"].result_list}

    everything = {"subscription.retry_billing", "tenant.created", "api_key.issued"}
    assert listed() == everything
    assert listed({"actor": f"user:{operator_user.pk}"}) == {"subscription.retry_billing"}
    assert listed({"actor": "cli"}) == {"tenant.created", "api_key.issued"}
    assert listed({"action": "tenant.created"}) == {"tenant.created"}
    assert listed({"object_type": "billing.subscription"}) == {"subscription.retry_billing"}
    today = db_now().date()
    assert listed({"created_at__gte": str(today), "created_at__lt": str(today + timedelta(days=1))}) == everything
    assert listed({"created_at__gte": str(today + timedelta(days=1))}) == set()
    assert listed({"q": subscription.pk}) == {"subscription.retry_billing"}
    page = operator.get(url)
    for choice in ("subscription.retry_billing", "webhook_endpoint.created", "invoice.void", "billing.invoice"):
        assert choice.encode() in page.content, "filters offer every registered action and model"

    entry = AuditLogEntry.objects.first()
    assert operator.get(reverse("admin:hardcount_auditlogentry_change", args=[entry.pk])).status_code == 200
    assert operator.get(reverse("admin:hardcount_auditlogentry_add")).status_code == 403
    assert operator.get(reverse("admin:hardcount_auditlogentry_delete", args=[entry.pk])).status_code == 403
    change = operator.post(reverse("admin:hardcount_auditlogentry_change", args=[entry.pk]), {"message": "x"})
    assert change.status_code == 403
    response = operator.get(url)
    assert "delete_selected" not in response.context["cl"].model_admin.get_actions(response.wsgi_request)
