"""Shared fixtures: a real PostgreSQL (embedded unless DATABASE_URL is set) through pytest-django."""

import pytest


@pytest.fixture
def tenant(db):
    from hardcount.models import Tenant

    return Tenant.objects.create(name="Acme")
