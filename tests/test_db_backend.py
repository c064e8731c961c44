"""The database backend keeps nothing on the server session that a transaction pooler could lose or leak
(docs/decisions/0184-pgbouncer-transaction-pooling.md): no server-side prepared statement, no server-side cursor."""

from __future__ import annotations

import psycopg
from django.db import connection

from hardcount.models import Tenant


def _prepared_on_this_session() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        return cursor.fetchone()[0]


def test_a_statement_run_many_times_is_never_prepared_on_the_server(db):
    for n in range(20):  # psycopg's own default would prepare it after 5 runs
        list(Tenant.objects.filter(name=f"nobody {n}").values_list("id", flat=True))
        list(Tenant.objects.filter(name="nobody").values_list("id", flat=True))
    assert _prepared_on_this_session() == 0
    assert connection.connection.prepare_threshold is None
    assert not isinstance(connection.connection.cursor(), psycopg.ServerCursor)


def test_negative_control_psycopgs_default_prepares_a_repeated_statement(db):
    s = connection.settings_dict
    with psycopg.connect(host=s["HOST"], port=s["PORT"], user=s["USER"], dbname=s["NAME"]) as plain:
        for _ in range(10):
            plain.execute("SELECT count(*) FROM hardcount_tenant WHERE name = %s", ["nobody"])
        assert plain.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] >= 1


def test_iterating_a_queryset_declares_no_server_side_cursor(db):
    Tenant.objects.create(name="one")
    with connection.cursor() as cursor:
        rows = iter(Tenant.objects.values_list("id", flat=True).iterator(chunk_size=1))
        next(rows)
        cursor.execute("SELECT count(*) FROM pg_cursors")
        assert cursor.fetchone()[0] == 0


def test_a_bound_cursors_statements_are_counted_and_never_prepared(db):
    """The server-binding cursor (``billing.queries.bound_cursor``: the meter-event insert, the claim's mark) is of
    the class django-prometheus gives every cursor, so its statements count in ``django_db_execute_total``, and it
    prepares nothing on the server either."""
    from prometheus_client import REGISTRY

    from billing.queries import bound_cursor

    labels = {"alias": connection.alias, "vendor": connection.vendor}

    def executed() -> float:
        return REGISTRY.get_sample_value("django_db_execute_total", labels) or 0.0

    before = executed()
    for n in range(8):
        with bound_cursor() as cursor:
            cursor.execute("SELECT %s::int + 1", [n])
            assert cursor.fetchone() == (n + 1,)
    assert executed() == before + 8
    assert _prepared_on_this_session() == 0
