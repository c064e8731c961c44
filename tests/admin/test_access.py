"""Who may use the console: staff only; acting needs the change permission; every POST needs its CSRF token."""

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

from billing.models import BillingRun, Subscription
from tests.admin import rows
from tests.admin.conftest import changelist_ids

pytestmark = pytest.mark.django_db

SUBSCRIPTIONS = reverse("admin:billing_subscription_changelist")


def test_anonymous_and_non_staff_users_are_sent_to_the_login_page(client, customer_user):
    for visitor in (client, customer_user):
        for url in ("/admin/", SUBSCRIPTIONS, reverse("admin:billing_ledgerentry_changelist")):
            response = visitor.get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith(reverse("admin:login")), url


def test_a_non_staff_user_cannot_run_an_action(tenant, customer_user):
    sub = rows.subscription(tenant)

    response = customer_user.post(
        SUBSCRIPTIONS, {"action": "cancel_now", "_selected_action": [sub.pk], "confirmed": "yes"}
    )

    assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))
    sub.refresh_from_db()
    assert sub.status == "active"


def test_a_staff_login_with_a_password_reaches_the_console(db):
    from django.contrib.auth.models import User

    User.objects.create_user("staff-login", password="pw-for-tests-only", is_staff=True, is_superuser=True)
    client = Client(enforce_csrf_checks=True)
    login_page = client.get(reverse("admin:login"))
    token = login_page.cookies["csrftoken"].value

    response = client.post(
        reverse("admin:login"),
        {"username": "staff-login", "password": "pw-for-tests-only", "csrfmiddlewaretoken": token, "next": "/admin/"},
    )

    assert response.status_code == 302 and response["Location"] == "/admin/"
    assert response.cookies["sessionid"]["httponly"] is True
    assert response.cookies["sessionid"]["samesite"] == "Lax"
    assert client.get("/admin/").status_code == 200


def test_staff_with_view_permission_only_see_lists_but_get_no_actions(tenant, viewer):
    sub = rows.parked(tenant)

    page = viewer.get(SUBSCRIPTIONS)
    assert page.status_code == 200
    assert sub.pk in {s.pk for s in page.context["cl"].result_list}
    assert b'value="retry_billing"' not in page.content

    response = viewer.post(SUBSCRIPTIONS, {"action": "retry_billing", "_selected_action": [sub.pk]}, follow=True)

    assert response.status_code == 200  # the list again: there is no action to run
    assert not BillingRun.objects.exists()
    sub.refresh_from_db()
    assert sub.billing_state == "parked"
    detail = viewer.get(reverse("admin:billing_subscription_change", args=[sub.pk]))
    assert detail.status_code == 200 and b"Retry billing now" not in detail.content


def test_an_action_posted_without_its_csrf_token_is_refused(tenant):
    from django.contrib.auth.models import User

    sub = rows.subscription(tenant)
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.create_superuser("csrf-op", "op@example.com", "pw-for-tests-only"))

    response = client.post(SUBSCRIPTIONS, {"action": "cancel_now", "_selected_action": [sub.pk], "confirmed": "yes"})

    assert response.status_code == 403
    sub.refresh_from_db()
    assert sub.status == "active"


def test_session_and_framing_settings_protect_the_console(operator):
    assert settings.SESSION_COOKIE_HTTPONLY and settings.SESSION_COOKIE_SAMESITE == "Lax"
    assert settings.SESSION_COOKIE_AGE <= 8 * 3600
    assert "django.middleware.csrf.CsrfViewMiddleware" in settings.MIDDLEWARE
    response = operator.get("/admin/")
    assert response["X-Frame-Options"] == "DENY"


def test_the_operator_sees_every_subscription(tenant, operator):
    subs = {rows.subscription(tenant).pk, rows.parked(tenant).pk}
    assert changelist_ids(operator, SUBSCRIPTIONS) == subs
    assert Subscription.objects.count() == 2
