"""Fixtures for lease tests."""

import pytest
from django.db import connection


@pytest.fixture
def scratch_table(transactional_db):
    """A table a fenced transaction writes to, dropped afterwards."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS lease_scratch (id serial PRIMARY KEY, token bigint, note text)")
    yield "lease_scratch"
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS lease_scratch")
