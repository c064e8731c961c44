"""Test-clock fixtures: the billing suite's localstripe and book (helpers in :mod:`tests.clocks.helpers`).

Advances run on background threads with their own connections, so every test here uses the
``book`` fixture (``transactional_db``: committed rows) and waits for the threads before the
database is flushed.
"""

from __future__ import annotations

from datetime import UTC

import pytest
from psycopg.types.datetime import TimestamptzLoader

from tests.billing.conftest import (  # noqa: F401  (fixtures re-exported for this directory)
    book,
    localstripe_base,
    make_card,
    no_doctor,
    proxy_session,
    stripe_client,
    stripe_proxy,
    tenant,
)


@pytest.fixture(autouse=True)
def _advances_finish():
    """No advance thread may outlive its test (the next test flushes the tables under it)."""
    from billing.services.clocks import wait_for_advances

    yield
    assert wait_for_advances(timeout_s=600), "a test clock advance was still running after the test"


class _InstantLoader(TimestamptzLoader):
    """Reads a ``timestamptz`` as the instant it is, whatever the session's zone, in UTC.

    Django's own loader assumes every session speaks UTC and *replaces* the zone of what it
    reads with UTC; in a New York session that would shift every instant by 4 or 5 hours. This
    one converts instead, so a New York session is read correctly and the test shows only what
    the session's zone does to the SQL itself (day arithmetic, truncation, casts to dates).
    """

    timezone = UTC  # what Django compares with before installing its own loader on a cursor

    def load(self, data):
        return super().load(data).astimezone(UTC)


def _speak_new_york(django_connection) -> None:
    django_connection.ensure_connection()
    django_connection.connection.adapters.register_loader("timestamptz", _InstantLoader)
    with django_connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'America/New_York'")


@pytest.fixture
def new_york_sessions():
    """Every database session of the test speaks America/New_York: the test's own and every one a
    thread opens (the advance's walk, the drain's closes), set after Django's own UTC set-up."""
    from django.db import connection
    from django.db.backends.signals import connection_created

    opened = []

    def on_connect(sender, connection, **kwargs):
        _speak_new_york(connection)
        opened.append(connection.alias)

    connection_created.connect(on_connect)
    _speak_new_york(connection)
    try:
        yield opened
    finally:
        connection_created.disconnect(on_connect)
        connection.close()  # the next query reconnects with Django's UTC set-up
