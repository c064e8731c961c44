"""The report table of ``make correctness``: rows the failure-correctness tests recorded, as Markdown.

``python -m tests.system.correctness_report ROWS.jsonl [--out FILE] [--status N] [--command CMD]``
reads the JSON lines :func:`tests.system.correctness.record_row` appended (one per experiment that
held), prints the table with the machine it ran on, and writes it to ``FILE`` when given. ``--status``
is pytest's exit status: non-zero means some experiment failed, and a failed experiment has no row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

COLUMNS = (
    ("experiment", "experiment"),
    ("runs", "runs"),
    ("kill points", "kill_points"),
    ("invoices", "invoices"),
    ("duplicates", "duplicates"),
    ("lost periods", "lost"),
    ("doctor violations", "doctor_violations"),
    ("wall time", "wall_s"),
    ("notes", "note"),
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def render(rows: list[dict], *, status: int | None, command: str) -> str:
    """The Markdown block: machine line, command, table, verdict."""
    lines = [
        f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores ({_cpu_model()}), "
        f"load average at the end {_load()}; PostgreSQL embedded (pgserver), "
        "localstripe behind devstack/strict_stripe.py.",
        "",
        f"Command: `{command}`",
        "",
        "| " + " | ".join(title for title, _ in COLUMNS) + " |",
        "|" + "|".join("---" if key in ("experiment", "kill_points", "note") else "---:" for _, key in COLUMNS) + "|",
    ]
    for row in rows:
        cells = []
        for _, key in COLUMNS:
            value = row.get(key, "")
            cells.append(f"{value:.0f} s" if key == "wall_s" else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    total = sum(row.get("wall_s", 0) for row in rows)
    lines.append("")
    if status is None:
        lines.append(f"{len(rows)} experiments recorded, {total:.0f} s in all.")
    elif status == 0:
        lines.append(f"All {len(rows)} experiments held ({total:.0f} s in all; pytest exit status 0).")
    else:
        lines.append(
            f"pytest exit status {status}: an experiment failed (a failed experiment records no row); "
            "see the test output."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--status", type=int)
    parser.add_argument("--command", default="make correctness")
    args = parser.parse_args()
    text = args.rows.read_text() if args.rows.exists() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    text = render(rows, status=args.status, command=args.command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
