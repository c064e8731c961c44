"""Bulk books for the admin's scale tests: ``INSERT … SELECT … FROM generate_series`` (seconds for 100k).

Columns not given are filled with the model field's default, so a field added later with a
default does not break the insert. Row ``g`` of a book gets ids ``<prefix>_bulk<g, 10 digits>``.
"""

from __future__ import annotations

from django.db import connection
from django.db.models import Model


def insert_series(
    model: type[Model], start: int, stop: int, columns: dict[str, str], params: dict | None = None
) -> None:
    """Insert one ``model`` row per ``g`` in ``start..stop``; ``columns`` maps attnames to SQL over ``g``.

    Every other concrete field takes its Python default (``None`` when it has none).
    """
    names, values, args = [], [], dict(params or {})
    for field in model._meta.concrete_fields:
        names.append(connection.ops.quote_name(field.column))
        if field.attname in columns:
            values.append(columns[field.attname])
        else:
            key = f"default_{field.attname}"
            args[key] = field.get_db_prep_save(field.get_default(), connection)
            values.append(f"%({key})s")
    args.update(start=start, stop=stop)
    sql = (
        f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({', '.join(names)}) "
        f"SELECT {', '.join(values)} FROM generate_series(%(start)s, %(stop)s) AS g"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, args)


def bulk_id(prefix: str) -> str:
    """SQL for row ``g``'s id: ``<prefix>_bulk`` and ``g`` zero-padded to 10 digits."""
    return f"'{prefix}_bulk' || lpad(g::text, 10, '0')"


def bulk_subscriptions(start: int, stop: int, *, tenant_ids: tuple[str, str], price_ids: dict[bool, str]) -> None:
    """Customers and subscriptions ``start..stop``, spread over two tenants and both modes.

    Row ``g``: tenant ``tenant_ids[g % 2]``, live when ``g % 3 = 0``; parked when ``g % 100 = 0``,
    waiting when ``g % 50 = 1``, canceled when ``g % 20 = 2``, otherwise active and billed ahead.
    ``price_ids`` gives the price per livemode (each belongs to ``tenant_ids[0]``; prices are not
    checked against the subscription's tenant by the database).
    """
    from billing.models import Customer, Subscription

    tenant = "CASE WHEN g %% 2 = 0 THEN %(tenant0)s ELSE %(tenant1)s END"
    live = "(g %% 3 = 0)"
    params = {"tenant0": tenant_ids[0], "tenant1": tenant_ids[1], "live_price": price_ids[True]}
    params["test_price"] = price_ids[False]
    insert_series(
        Customer,
        start,
        stop,
        {
            "id": bulk_id("cus"),
            "tenant_id": tenant,
            "livemode": live,
            "email": "'bulk' || g || '@example.com'",
            "external_id": "'ext-' || g",
            "currency": "'usd'",
            "created_at": "now()",
        },
        params,
    )
    insert_series(
        Subscription,
        start,
        stop,
        {
            "id": bulk_id("sub"),
            "tenant_id": tenant,
            "livemode": live,
            "customer_id": bulk_id("cus"),
            "price_id": f"CASE WHEN {live} THEN %(live_price)s ELSE %(test_price)s END",
            "status": "CASE WHEN g %% 20 = 2 THEN 'canceled' ELSE 'active' END",
            "billing_cycle_anchor": "now() - interval '10 days'",
            "next_billing_at": "CASE WHEN g %% 20 = 2 THEN NULL ELSE now() + interval '20 days' END",
            "billing_failure_count": "CASE WHEN g %% 100 = 0 THEN 8 WHEN g %% 50 = 1 THEN 2 ELSE 0 END",
            "billing_parked_at": "CASE WHEN g %% 100 = 0 THEN now() - interval '1 hour' END",
            "next_billing_attempt_at": "CASE WHEN g %% 50 = 1 THEN now() + interval '1 hour' END",
            "last_billing_error": "CASE WHEN g %% 100 = 0 OR g %% 50 = 1 THEN 'gateway: 503 Service Unavailable' "
            "ELSE '' END",
            "created_at": "now()",
            "updated_at": "now()",
        },
        params,
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE billing_customer")
        cursor.execute("ANALYZE billing_subscription")
