"""What the per-layer kernel benches (mixed_round.py, prefill_round.py) share: a call's time
from CUDA events, contenders timed interleaved in a shuffled order, and the agreement verdict
that ends a run."""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch


def time_us(fn: Callable[[], Any], inner: int) -> float:
    """Microseconds a call of ``fn``, CUDA events around ``inner`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / inner


def interleaved(calls: dict[str, Callable[[], Any]], reps: int, inner: int, rng: random.Random) -> dict[str, float]:
    """Each contender's median microseconds a call over ``reps`` repetitions, every repetition
    timing all of them in a shuffled order (so that the GPU's drift falls on each alike)."""
    times: dict[str, list[float]] = {c: [] for c in calls}
    for _ in range(reps):
        for c in rng.sample(list(calls), len(calls)):
            times[c].append(time_us(calls[c], inner))
    return {c: statistics.median(t) for c, t in times.items()}


def verdict(worst: float, bound: float, what: str) -> int:
    """The run's exit code: 1 with a ``FAIL`` line on standard error when the largest difference
    ``worst`` between ``what`` is above ``bound``, else 0 with an ``agreement`` line."""
    if worst > bound:
        print(f"FAIL: {what} differ by {worst:.3g} (more than {bound:g})", file=sys.stderr)
        return 1
    print(f"agreement: largest difference {worst:.2e} (at most {bound:g})")
    return 0
