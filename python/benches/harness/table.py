"""The one text-table printer of the benchmarks, and its ratio cells."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(v: Any) -> str:
    """One value as a table cell: floats with one decimal from 10 up, three below; ``None`` as
    ``-``; anything else as ``str``."""
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
    if v is None:
        return "-"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]], cols: Sequence[str], title: str = "") -> str:
    """``rows`` over ``cols`` as a text table: a header, a rule, one line per row, cells right
    aligned to the widest of their column and separated by `` | ``; a missing key is ``-``.
    ``title``, when given, is the first line. No columns is a ValueError."""
    if not cols:
        raise ValueError("a table needs at least one column")
    cells: list[list[str]] = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(cols)]
    header = " | ".join(c.rjust(w) for c, w in zip(cols, widths))
    lines = [title] if title else []
    lines += [header, "-" * len(header)]
    lines += [" | ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def ratio(a: Any, b: Any, missing: str = "n/a") -> str:
    """``a / b`` as a cell, ``2.50x``; ``missing`` when either is missing (or no number) or ``b`` is 0."""
    try:
        return f"{float(a) / float(b):.2f}x"
    except (TypeError, ValueError, ZeroDivisionError):
        return missing
