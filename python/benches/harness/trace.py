"""The one trace loader of the benchmarks: Azure LLM inference trace CSVs (columns TIMESTAMP,
ContextTokens, GeneratedTokens), and the random prompts drawn to their lengths."""

from __future__ import annotations

import csv
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: the bundled Azure traces (first 2,000 requests each) by short name, relative to the repository root
TRACES = {"conv": os.path.join("vmem-cli", "data", "traces", "azure-conv-2023-first2000.csv"),
          "code": os.path.join("vmem-cli", "data", "traces", "azure-code-2023-first2000.csv")}


def repo_root() -> str:
    """The repository root (this file is python/benches/harness/trace.py)."""
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def trace_path(name: str) -> str:
    """The absolute path of bundled trace ``name`` (:data:`TRACES`); an unknown name is a ValueError."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r} (known: {sorted(TRACES)})")
    return os.path.join(repo_root(), TRACES[name])


def default_trace() -> str:
    """The absolute path of the conversation trace, the default of every bench."""
    return trace_path("conv")


@dataclass(frozen=True)
class TraceRequest:
    """One trace row: its index, the prompt length a bench serves (the trace's context capped,
    at least 1 token), the trace's own context and generated lengths, and its ``TIMESTAMP`` as
    seconds since the epoch (UTC; ``None`` unless :func:`load_trace` was asked for them)."""

    index: int
    prompt_len: int
    context: int
    generated: int
    timestamp: float | None = None


def parse_timestamp(text: str) -> float:
    """An Azure trace ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``, UTC) as seconds since the
    epoch; digits past microseconds are dropped. Anything else is a ValueError."""
    head, dot, frac = text.strip().partition(".")
    when = datetime.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    if dot and not frac.isdigit():
        raise ValueError(f"not a timestamp: {text!r}")
    return when.timestamp() + (int(frac[:6].ljust(6, "0")) / 1e6 if dot else 0.0)


def load_trace(path: str | None = None, n: int | None = 256, cap: int = 4000,
               timestamps: bool = False) -> list[TraceRequest]:
    """The first ``n`` requests (``None``: all, at least one) of the trace at ``path`` (default
    :func:`default_trace`), prompt lengths ``max(1, min(ContextTokens, cap))``; with
    ``timestamps``, each with its ``TIMESTAMP`` (then a required column). A missing column, a field
    that is not an integer, a negative length, a timestamp that does not parse or goes back in
    time, ``n`` or ``cap`` below 1, or fewer than ``n`` rows is a ValueError naming the file (and row)."""
    path = path or default_trace()
    if (n is not None and n < 1) or cap < 1:
        raise ValueError(f"n and cap must be at least 1, got n={n}, cap={cap}")
    out: list[TraceRequest] = []
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        missing = {"ContextTokens", "GeneratedTokens", *(["TIMESTAMP"] if timestamps else [])} \
            - set(rows.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)} (has {rows.fieldnames})")
        for i, row in enumerate(rows):
            if n is not None and len(out) >= n:
                break
            try:
                ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: row {i + 2}: {e}") from e
            if ctx < 0 or gen < 0:
                raise ValueError(f"{path}: row {i + 2}: negative length ({ctx}, {gen})")
            when = None
            if timestamps:
                try:
                    when = parse_timestamp(row["TIMESTAMP"] or "")
                except ValueError as e:
                    raise ValueError(f"{path}: row {i + 2}: {e}") from e
                if out and out[-1].timestamp is not None and when < out[-1].timestamp:
                    raise ValueError(f"{path}: row {i + 2}: timestamp {row['TIMESTAMP']} is before the row above")
            out.append(TraceRequest(i, max(1, min(ctx, cap)), ctx, gen, when))
    if len(out) < (n or 1):
        raise ValueError(f"{path}: {len(out)} requests, {n or 1} asked")
    return out


def prompt_lengths(path: str | None = None, n: int = 256, cap: int = 4000) -> list[int]:
    """The prompt lengths of :func:`load_trace`."""
    return [r.prompt_len for r in load_trace(path, n, cap)]


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0, low: int = 3) -> list[Any]:
    """One prompt of random token ids in ``[low, vocab)`` per length, drawn in order from one
    ``torch.Generator`` seeded with ``seed`` (the same ids for every contender)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]
