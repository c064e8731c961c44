"""Writing many model rows at once: ``COPY … FROM STDIN``, and one ``INSERT``/``UPDATE`` over ``unnest`` arrays.

``Model.objects.bulk_create`` builds one ``INSERT`` with a parameter per value; for the demo
book's hundreds of thousands of rows most of its time goes to assembling and converting that
statement. ``COPY`` streams the same rows in a fraction of the time (:func:`copy_models`), but
the statement stays open while the client streams: a process stopped mid-``COPY`` holds its locks
until someone kills it, since PostgreSQL's ``idle_in_transaction_session_timeout`` does not apply
to a running statement. Inside a fenced transaction (decision 0020), where a stopped leader must
not hold the lease row, rows go in one statement sent whole: :func:`insert_models` and
:func:`update_models` send one typed array per column. No ``RETURNING``: the instances must carry
their primary keys already (Hardcount's prefixed ids are made in Python).

Each array goes as the text of an array literal built by :func:`array_literal`, not as a Python
list: psycopg escapes a list's elements with a regular-expression substitution per double quote,
and a page close's JSON payloads (events, invoices) are mostly double quotes, so that escaping
alone took a quarter of the drain's time (docs/decisions/0227-array-literals.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from django.db import connection, models
from psycopg import sql
from psycopg.types.json import Jsonb


def array_literal(values: Iterable[Any], *, json_values: bool = False) -> str:
    """PostgreSQL's text input form of a one-dimensional array of ``values``, e.g. ``{"a","b\\"c",NULL}``.

    Send it as one parameter cast to the array's type (``%s::text[]``, ``%s::jsonb[]`` …): the
    server parses it with the element type's own input function, exactly as it would parse the
    array psycopg builds from a list (https://www.postgresql.org/docs/current/arrays.html#ARRAYS-IO).
    Elements: ``None`` is ``NULL``; ``str``, ``int``, ``float``, ``Decimal``, ``bool``, ``datetime``
    and ``date`` (ISO 8601, with their offset), ``UUID``; with ``json_values`` every element is
    JSON-encoded first (``json.dumps``, as psycopg's ``Jsonb``: ``None`` is JSON ``null``). Every element but
    ``NULL`` is double-quoted, with backslashes and double quotes backslash-escaped. Raises
    ``TypeError`` for any other element type.
    """
    parts = []
    for value in values:
        if json_values:
            text = json.dumps(value)
        elif value is None:
            parts.append("NULL")
            continue
        elif isinstance(value, str):
            text = value
        elif isinstance(value, bool):
            text = "t" if value else "f"
        elif isinstance(value, int | float | Decimal | uuid.UUID):
            text = str(value)
        elif isinstance(value, datetime | date):
            text = value.isoformat()
        else:
            raise TypeError(f"array_literal cannot write a {type(value).__name__}")
        if "\\" in text:
            text = text.replace("\\", "\\\\")
        if '"' in text:
            text = text.replace('"', '\\"')
        parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


# Values the database takes as they are: Django's conversion (get_db_prep_save) returns these unchanged,
# at ~10 µs a value, which was a tenth of a page close. Exact types: an enum member or a naive
# datetime still goes through Django.
_AS_THEY_ARE = frozenset((str, int, bool, type(None)))


def _db_values(field: models.Field, objs: list[models.Model], *, add: bool) -> Iterator[Any]:
    """``field``'s database values of ``objs``, as ``save`` takes them (``pre_save``, then
    ``get_db_prep_save`` unless the value is already one the database takes as it is)."""
    for obj in objs:
        value = field.pre_save(obj, add)
        if type(value) in _AS_THEY_ARE or (type(value) is datetime and value.tzinfo is not None):
            yield value
        else:
            yield field.get_db_prep_save(value, connection)


def copy_models(model: type[models.Model], objs: Iterable[models.Model]) -> int:
    """COPY ``objs`` (instances of ``model``, primary keys set) into the model's table; returns the row count.

    Runs on the default connection, inside the caller's transaction. Values go through each
    field's ``pre_save`` (``auto_now_add`` times are set, as ``save`` would); JSON fields are sent
    as ``jsonb``. Columns with a database default (``db_default``) are left to the database. Raises
    the database's error (a constraint violation aborts the whole COPY).
    """
    fields = [f for f in model._meta.concrete_fields if f.db_default is models.NOT_PROVIDED]
    json_fields = {i for i, f in enumerate(fields) if isinstance(f, models.JSONField)}
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(model._meta.db_table), sql.SQL(", ").join(sql.Identifier(f.column) for f in fields)
    )
    count = 0
    with connection.cursor() as cursor, cursor.cursor.copy(statement) as copy:
        for obj in objs:
            row = [f.pre_save(obj, True) for f in fields]
            for i in json_fields:
                row[i] = Jsonb(row[i])
            copy.write_row(row)
            count += 1
    return count


def insert_models(model: type[models.Model], objs: list[models.Model]) -> int:
    """INSERT ``objs`` (instances of ``model``, primary keys set) in one ``INSERT … SELECT … FROM unnest(…)``.

    The same values as :func:`copy_models` (``pre_save`` as for an insert; JSON as ``jsonb``;
    ``db_default`` columns left to the database), sent as one typed array per column in one
    statement. Runs inside the caller's transaction; raises the database's error (a constraint
    violation inserts nothing). Returns the row count.
    """
    if not objs:
        return 0
    fields = [f for f in model._meta.concrete_fields if f.db_default is models.NOT_PROVIDED]
    arrays = []
    for f in fields:
        if isinstance(f, models.JSONField):
            arrays.append(array_literal((f.pre_save(obj, True) for obj in objs), json_values=True))
        else:
            arrays.append(array_literal(_db_values(f, objs, add=True)))
    statement = sql.SQL("INSERT INTO {} ({}) SELECT * FROM unnest({})").format(
        sql.Identifier(model._meta.db_table),
        sql.SQL(", ").join(sql.Identifier(f.column) for f in fields),
        sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(f.db_type(connection))) for f in fields),
    )
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(connection.connection), arrays)
        return cursor.rowcount


def update_models(model: type[models.Model], objs: list[models.Model], field_names: Iterable[str]) -> int:
    """Write ``field_names`` of ``objs`` (saved instances of ``model``) in one ``UPDATE … FROM unnest(…)``.

    The values are taken from the instances as ``save(update_fields=…)`` would take them
    (``auto_now`` fields are stamped and written too); each column is sent as one typed array, so
    the statement is the same whatever the number of rows. Runs inside the caller's transaction;
    the caller holds the rows' locks. Returns the number of rows updated.
    """
    if not objs:
        return 0
    opts = model._meta
    fields = [opts.get_field(name) for name in field_names]
    fields += [f for f in opts.concrete_fields if getattr(f, "auto_now", False) and f not in fields]
    if any(isinstance(f, models.JSONField) for f in fields):
        raise ValueError("update_models does not write JSON fields")
    pk = opts.pk
    columns = [pk, *fields]
    arrays = [array_literal(pk.get_db_prep_save(obj.pk, connection) for obj in objs)]
    arrays += [array_literal(_db_values(f, objs, add=False)) for f in fields]
    statement = sql.SQL(
        "UPDATE {table} AS t SET {sets} FROM unnest({arrays}) AS v({names}) WHERE t.{pk} = v.{pk}"
    ).format(
        table=sql.Identifier(opts.db_table),
        sets=sql.SQL(", ").join(sql.SQL("{c} = v.{c}").format(c=sql.Identifier(f.column)) for f in fields),
        arrays=sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(f.db_type(connection))) for f in columns),
        names=sql.SQL(", ").join(sql.Identifier(f.column) for f in columns),
        pk=sql.Identifier(pk.column),
    )
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(connection.connection), arrays)
        return cursor.rowcount
