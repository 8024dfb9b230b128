"""Command-line pieces the benches share: name lists, flag checks (usage errors,
exit 2, one line, before any model is built) and where a run goes (GPU, or ``--tiny`` on the CPU)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import vmem
from harness.trace import load_trace


def int_list(text: str) -> list[int]:
    """An ``argparse`` type: comma-separated integers of at least 1 (``"256,16"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be at least 1: {text!r}")
    return values


def check_int_list(ap: argparse.ArgumentParser, flag: str, text: str) -> None:
    """Refuses, as a usage error, ``text`` of ``flag`` that :func:`int_list` refuses."""
    try:
        int_list(text)
    except argparse.ArgumentTypeError as e:
        ap.error(f"{flag}: {e}")


def names(ap: argparse.ArgumentParser, flag: str, spec: str, known: Sequence[str],
          allow_none: bool = False) -> list[str]:
    """The comma-separated names of ``spec`` for ``flag``; one not in ``known``, or none (unless
    ``allow_none``), is a usage error."""
    out = [n.strip() for n in spec.split(",") if n.strip()]
    for n in out:
        if n not in known:
            ap.error(f"{flag}: unknown {n!r} (known: {list(known)})")
    if not out and not allow_none:
        ap.error(f"{flag} names none (known: {list(known)})")
    return out


def check_counts(ap: argparse.ArgumentParser, args: Any, positive: Sequence[str],
                 at_least_zero: Sequence[str] = ()) -> None:
    """Refuses, as a usage error (exit 2, one line naming the flag), a count in ``positive``
    below 1 or in ``at_least_zero`` below 0 (a ``None`` default passes)."""
    for flag in [*positive, *at_least_zero]:
        v = getattr(args, flag[2:].replace("-", "_"))
        least = 1 if flag in positive else 0
        if v is not None and v < least:
            ap.error(f"{flag} must be at least {least}, got {v}")


def check_fraction(ap: argparse.ArgumentParser, flag: str, value: float) -> None:
    """Refuses, as a usage error, ``value`` of ``flag`` outside (0, 1] (NaN included)."""
    if not 0 < value <= 1:
        ap.error(f"{flag} must be a fraction in (0, 1], got {value}")


def check_seconds(ap: argparse.ArgumentParser, flag: str, value: float) -> None:
    """Refuses, as a usage error, ``value`` of ``flag`` not above 0 seconds (NaN included)."""
    if not value > 0:
        ap.error(f"{flag} must be more than 0 seconds, got {value}")


def check_flags(ap: argparse.ArgumentParser, args: Any, positive: Sequence[str],
                at_least_zero: Sequence[str] = ()) -> None:
    """Refuses, as usage errors (exit 2, one line naming the flag), before any model is built,
    what a serving bench cannot run: :func:`check_counts`, ``--memory-percent`` outside (0, 1],
    ``--timeout`` not above 0, a ``--page-size`` that is not one of vmem's, a ``--trace`` that is
    no file, an ``--out`` that cannot be created."""
    check_counts(ap, args, positive, at_least_zero)
    check_fraction(ap, "--memory-percent", args.memory_percent)
    check_seconds(ap, "--timeout", args.timeout)
    if args.page_size is not None:
        page_bytes(ap, args.page_size)
    if not os.path.isfile(args.trace):
        ap.error(f"--trace {args.trace!r} is not a file")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out!r} cannot be created: {e.strerror}")


def page_bytes(ap: argparse.ArgumentParser, text: Any) -> int:
    """``--page-size``'s bytes: one of vmem's page sizes, else a usage error (exit 2, one line)."""
    from vmem.transformers import PAGE_SIZES

    try:
        page = int(vmem.parse_bytes(text))
    except (vmem.VmemError, TypeError) as e:
        ap.error(f"--page-size {text!r}: {e}")
    if page not in PAGE_SIZES:
        ap.error(f"--page-size {text!r} is not one of vmem's page sizes "
                 f"({', '.join(f'{p >> 10}K' for p in PAGE_SIZES)})")
    return page


def trace_lengths(ap: argparse.ArgumentParser, path: str, n: int, cap: int) -> list[int]:
    """The first ``n`` prompt lengths of ``path`` capped at ``cap``; a trace that cannot give
    them is a usage error."""
    try:
        return [r.prompt_len for r in load_trace(path, n, cap)]
    except (OSError, ValueError) as e:
        ap.error(f"--trace {path!r}: {e}")
        raise  # not reached: ap.error exits


def place(ap: argparse.ArgumentParser, args: Any) -> None:
    """Sets ``args.device`` and ``args.dtype``: bf16 on the GPU, or with ``--tiny`` fp32 on the CPU
    with small pages, context and batch (a smoke test); no GPU without ``--tiny`` is a usage error.
    ``args.page_size`` given is kept; else 2M on the GPU, 64K with ``--tiny``."""
    import torch

    from harness.engine import fake_cpu_memory

    if args.tiny:
        args.device, args.dtype = "cpu", torch.float32
        args.page_size = args.page_size or "64K"
        args.max_context = min(args.max_context, 2048)
        args.max_batch_tokens = args.max_batch_tokens or 256
        args.max_requests = min(args.max_requests, 8)  # eager Flex on the CPU materializes rows x context scores
        fake_cpu_memory()
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU: use --tiny for a CPU smoke test")
        args.device, args.dtype = "cuda", torch.bfloat16
        args.page_size = args.page_size or "2M"
