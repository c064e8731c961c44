"""``hardcount.bulk.array_literal``: the server reads back the values given, as it reads psycopg's own arrays."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.db import connection
from psycopg.types.json import Jsonb

from hardcount.bulk import array_literal

AWKWARD_TEXT = [
    "",
    "plain",
    'a "quoted" word',
    'back\\slash and \\" both',
    "{braces}, commas; and spaces ",
    " leading and trailing ",
    "NULL",
    "null",
    "tab\tnew\nline",
    "ünïcødé — 😀",
    "\\",
    '"',
    None,
]


def _read_back(literal: str | list, sql_type: str) -> list:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT %s::{sql_type}[]", [literal])
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_awkward_text_reads_back_as_given_and_as_psycopg_sends_it():
    ours = _read_back(array_literal(AWKWARD_TEXT), "text")
    assert ours == AWKWARD_TEXT
    assert ours == _read_back(AWKWARD_TEXT, "text")


@pytest.mark.django_db
def test_json_documents_read_back_as_given_and_none_is_json_null():
    documents = [
        {"id": "in_1", "lines": [{"description": 'Pro "annual"', "amount": 1999}], "note": "a\\b"},
        [1, "two", {"three": None}],
        'a bare "string"',
        None,
        {},
    ]
    # Django's connection reads jsonb as its text: parse it here.
    ours = [json.loads(d) for d in _read_back(array_literal(documents, json_values=True), "jsonb")]
    assert ours == documents
    assert ours == [json.loads(d) for d in _read_back([Jsonb(d) for d in documents], "jsonb")]
    with connection.cursor() as cursor:
        cursor.execute("SELECT x IS NULL FROM unnest(%s::jsonb[]) AS x", [array_literal([None], json_values=True)])
        assert cursor.fetchall() == [(False,)]  # JSON null, not SQL NULL: as Jsonb(None)


@pytest.mark.django_db
def test_typed_values_read_back_as_given():
    moment = datetime(2026, 12, 5, 9, 30, 15, 123456, tzinfo=UTC)
    elsewhere = datetime(2026, 12, 5, 1, 30, tzinfo=timezone(timedelta(hours=-8)))
    assert _read_back(array_literal([moment, elsewhere, None]), "timestamptz") == [
        moment,
        elsewhere.astimezone(UTC),
        None,
    ]
    assert _read_back(array_literal([True, False, None]), "boolean") == [True, False, None]
    assert _read_back(array_literal([0, -5, 2**62, None]), "bigint") == [0, -5, 2**62, None]
    assert _read_back(array_literal([Decimal("12.3400"), Decimal("-0.01")]), "numeric") == [
        Decimal("12.3400"),
        Decimal("-0.01"),
    ]
    assert _read_back(array_literal([0.5, -2.25]), "float8") == [0.5, -2.25]
    assert _read_back(array_literal([date(2027, 2, 28)]), "date") == [date(2027, 2, 28)]
    key = uuid.uuid4()
    assert _read_back(array_literal([key]), "uuid") == [key]
    assert array_literal([]) == "{}"


def test_an_unknown_element_type_is_refused_not_guessed():
    with pytest.raises(TypeError, match="timedelta"):
        array_literal([timedelta(seconds=1)])
