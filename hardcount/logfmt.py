"""Structured log lines in logfmt (``event=lease_acquired role=billing token=7``).

One line per event, keys in the order given, values quoted only when they need it, so the
lines read well in a terminal and parse with any logfmt tool (or ``str.split``).
"""

from __future__ import annotations

from typing import Any


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.3f}"
    else:
        text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def logfmt(event: str, **fields: Any) -> str:
    """``event=<event> k1=v1 k2=v2 …``: floats to 3 decimals, ``None`` as ``-``, quoted when needed."""
    return " ".join([f"event={_value(event)}", *(f"{key}={_value(value)}" for key, value in fields.items())])


def parse_logfmt(line: str) -> dict[str, str]:
    """The inverse of :func:`logfmt` for the ``key=value`` pairs in ``line`` (used by tests and tooling).

    Text before the first pair (a timestamp, a level) is ignored; quoted values are unescaped.
    """
    fields: dict[str, str] = {}
    i, n = 0, len(line)
    while i < n:
        eq = line.find("=", i)
        if eq < 0:
            break
        start = line.rfind(" ", 0, eq) + 1
        key = line[start:eq]
        j = eq + 1
        if j < n and line[j] == '"':
            j += 1
            chars = []
            while j < n and line[j] != '"':
                if line[j] == "\\" and j + 1 < n:
                    j += 1
                    chars.append({"n": "\n"}.get(line[j], line[j]))
                else:
                    chars.append(line[j])
                j += 1
            fields[key] = "".join(chars)
            i = j + 1
        else:
            end = line.find(" ", j)
            end = n if end < 0 else end
            fields[key] = line[j:end]
            i = end + 1
    return fields
