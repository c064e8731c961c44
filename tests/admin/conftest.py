"""Admin fixtures: logged-in clients (superuser operator, view-only staff, non-staff), billing's book, outbox receivers.

The billing fixtures (localstripe behind the fault proxy, the :class:`~tests.billing.conftest.Book`
builder, the doctor sweep after each test that uses ``book``) and the outbox's (real executors and
HTTP receivers) are those apps' own, imported here.
"""

from __future__ import annotations

import pytest
from django.test import Client

from tests.billing.conftest import (  # noqa: F401 - fixtures used by this package's tests
    book,
    localstripe_base,
    make_card,
    no_doctor,
    proxy_session,
    stripe_client,
    stripe_proxy,
)
from tests.outbox.conftest import make_executor, receiver  # noqa: F401 - the outbox's fixtures: executors, receivers

PASSWORD = "pw-for-tests-only"


def _client(user, *, enforce_csrf_checks: bool = False) -> Client:
    client = Client(enforce_csrf_checks=enforce_csrf_checks)
    client.force_login(user)
    return client


@pytest.fixture
def operator(db):
    """A superuser's logged-in client: may see and operate everything."""
    from django.contrib.auth.models import User

    return _client(User.objects.create_superuser("operator-admin-test", "op@example.com", PASSWORD))


@pytest.fixture
def viewer(db):
    """A staff user with only the view permissions of billing's and the outbox's models."""
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user("viewer-admin-test", "viewer@example.com", PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(codename__startswith="view_", content_type__app_label__in=["billing", "outbox"])
    )
    return _client(user)


@pytest.fixture
def customer_user(db):
    """An active, logged-in user who is not staff (say, a support agent's account without admin rights)."""
    from django.contrib.auth.models import User

    return _client(User.objects.create_user("not-staff-admin-test", "user@example.com", PASSWORD))


@pytest.fixture
def tenant(db):
    from hardcount.models import Tenant

    return Tenant.objects.create(name="Acme")


def changelist_ids(client: Client, url: str, params: dict | None = None) -> set[str]:
    """The primary keys a changelist page lists (its ``result_list``), after asserting it rendered."""
    response = client.get(url, params or {})
    assert response.status_code == 200, response.content[:500]
    return {obj.pk for obj in response.context["cl"].result_list}


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]
