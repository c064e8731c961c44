"""ops/sql's loader: ``-- name:`` blocks, their description comments, and files found from any directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ops import doctor
from ops import sql as named_sql

ROOT = Path(__file__).resolve().parents[2]


def test_blocks_keep_their_order_description_and_statement():
    text = """-- A header: not a statement.

-- name: first
-- What the first one checks,
-- over two lines.
SELECT 1 AS ref,
       'a %% b' AS detail;

-- ---------------- a section comment between blocks
-- name: second
-- The second.
SELECT 2
"""
    statements = named_sql.parse(text)
    assert list(statements) == ["first", "second"]
    assert statements["first"].description == "What the first one checks, over two lines."
    assert statements["first"].sql == "SELECT 1 AS ref,\n       'a %% b' AS detail"
    assert statements["second"].sql == "SELECT 2"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- name: a\n-- A.\nSELECT 1;\n-- name: a\n-- Again.\nSELECT 2;\n", "named twice"),
        ("-- name: a\nSELECT 1;\n", "no description"),
        ("-- name: a\n-- A.\n;\n", "empty"),
        ("SELECT 1;\n-- name: a\n-- A.\nSELECT 2;\n", "before the first"),
    ],
)
def test_malformed_files_are_refused(text, error):
    with pytest.raises(ValueError, match=error):
        named_sql.parse(text)


def test_every_check_file_is_loaded_and_every_statement_of_it_is_a_check():
    in_files = [name for file in doctor.CHECK_FILES for name in named_sql.load(file)]
    assert in_files == [c.name for c in doctor.CHECKS]
    assert doctor.GATEWAY_CHECK.name in named_sql.load("gateway")


def test_the_files_are_found_from_any_working_directory(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from ops import doctor; print(len(doctor.CHECKS))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert int(out.stdout) == len(doctor.CHECKS)
