"""Named SQL: the statements kept in ``ops/sql/*.sql``, loaded by name.

A file holds one block per statement::

    -- name: invoice_one_per_period
    -- What the statement checks, in words (one or more comment lines).
    SELECT ...;

The comment lines right after ``-- name:`` are the statement's description, joined with single
spaces. The statement runs from the first line that is not a comment up to the next ``-- name:``
line, without its final ``;`` and without the comment lines that trail it (a file may separate
its sections with comments). Comment lines before the first block are the file's header.

The statements run with named parameters (``%(unknown_after_s)s``): a literal percent sign is
written ``%%``, in comments inside a statement too. Files are found next to this module, so the
working directory does not matter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent

_NAME_LINE = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$")


@dataclass(frozen=True)
class NamedStatement:
    """One block of a ``.sql`` file: its ``name``, the ``description`` comment and the ``sql`` (no final ``;``)."""

    name: str
    description: str
    sql: str


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("--")


def parse(text: str, *, source: str = "<string>") -> dict[str, NamedStatement]:
    """The named statements of ``text`` in file order, by name.

    Raises ``ValueError`` (naming ``source``) for a repeated name, a block without a
    description, a block without a statement, or a statement before the first ``-- name:`` line.
    """
    blocks: list[tuple[str, list[str]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _NAME_LINE.match(line)
        if match:
            blocks.append((match.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
        elif line.strip() and not _is_comment(line):
            raise ValueError(f"{source}:{number}: SQL before the first '-- name:' line")
    statements: dict[str, NamedStatement] = {}
    for name, lines in blocks:
        if name in statements:
            raise ValueError(f"{source}: statement {name!r} is named twice")
        description = []
        while lines and _is_comment(lines[0]):
            description.append(lines.pop(0).lstrip()[2:].strip())
        while lines and (not lines[-1].strip() or _is_comment(lines[-1])):
            lines.pop()
        sql = "\n".join(lines).strip().removesuffix(";").rstrip()
        if not description or not all(description):
            raise ValueError(f"{source}: statement {name!r} has no description comment")
        if not sql:
            raise ValueError(f"{source}: statement {name!r} is empty")
        statements[name] = NamedStatement(name, " ".join(description), sql)
    return statements


@cache
def load(file: str) -> dict[str, NamedStatement]:
    """The named statements of ``ops/sql/<file>.sql`` (``file`` without the suffix), in file order.

    Read once per process. Raises ``FileNotFoundError`` for a missing file and ``ValueError``
    for a malformed one (see :func:`parse`).
    """
    path = SQL_DIR / f"{file}.sql"
    return parse(path.read_text(encoding="utf-8"), source=str(path))


def statement(file: str, name: str) -> str:
    """The SQL of statement ``name`` in ``ops/sql/<file>.sql``; ``KeyError`` if the file has no such statement."""
    return load(file)[name].sql
