"""Draws the serving suite's plot (harness/suite_report.svg: tok/s and the fraction of the
roofline bound per contender and workload) from the table a suite run printed in its log, for
runs whose suite.json is missing; several logs in one plot, each workload's model tagged
with the log's transformers version (its ``transformers X`` line) when it names one.

    python3 python/benches/suite_plot.py LOG [LOG ...] --out OUT_SVG

The numbers are the log's, as printed (one decimal or three significant digits).
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import cli, suite_report

#: The columns a row needs for the plot.
NEEDED = ("contender", "trace", "model", "budget", "tok_s", "roofline")


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("", "-"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def rows_of(text: str) -> list[dict[str, Any]]:
    """The rows of the last suite table in ``text`` (a header line holding ``contender |`` and
    the ``tok_s`` column, a line of dashes, then one ``|``-separated line per row); the
    ``model`` of each is tagged `` (X)`` when ``text`` names ``transformers X``. ValueError
    when it holds no such table."""
    lines = text.splitlines()
    version = next((ln.split()[1] for ln in lines if ln.startswith("transformers ") and len(ln.split()) == 2), None)
    heads = [i for i, ln in enumerate(lines) if "contender |" in ln and "tok_s" in ln]
    if not heads:
        raise ValueError("no suite table (a 'contender | ... tok_s' header line)")
    start = heads[-1]
    names = [c.strip() for c in lines[start].split("|")]
    missing = [n for n in NEEDED if n not in names]
    if missing:
        raise ValueError(f"the table lacks the columns {', '.join(missing)}")
    rows = []
    for ln in lines[start + 2:]:
        cells = ln.split("|")
        if len(cells) != len(names):
            break
        row = dict(zip(names, (_value(c) for c in cells)))
        for key in ("tok_s", "roofline"):
            if row[key] is not None and not isinstance(row[key], float):
                raise ValueError(f"the table's {key} {row[key]!r} is not a number")
        if version and row.get("model"):
            row["model"] = f"{row['model']} ({version})"
        rows.append(row)
    if not rows:
        raise ValueError("the suite table has no rows")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", metavar="LOG", help="a suite run's log (its table in the last lines)")
    ap.add_argument("--out", required=True, metavar="OUT_SVG", help="the plot to write")
    args = ap.parse_args(argv)
    for log in args.logs:
        cli.check_in_file(ap, log, "LOG")
    cli.check_out_file(ap, args.out)
    rows: list[dict[str, Any]] = []
    for log in args.logs:
        try:
            with open(log, errors="replace") as f:
                rows += rows_of(f.read())
        except (OSError, ValueError) as e:
            ap.error(f"LOG {log!r}: {e}")
    text = suite_report.svg(rows) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(f"{len(rows)} rows from {len(args.logs)} logs -> {args.out}")
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
