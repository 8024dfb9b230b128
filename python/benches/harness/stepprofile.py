"""``serving_suite.py --profile CONTENDER``: where a contender's engine steps spend their time.
Per step (one model forward): the wall time from its start to the next step's start, the host
time inside the forward (Python launching kernels), the GPU span of the forward (CUDA events
around it) and, from ``torch.profiler`` over the whole run, the kernels' own time. The
host-side share of a step is its wall time minus its GPU span: the time the device waits for
the engine (scheduling, input preparation, sampling, the result's copy back)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class StepClock:
    """Forward pre- and post-hooks on ``model`` recording, per forward, the host clock at start
    and end and (on CUDA) an event pair."""

    def __init__(self, model: Any) -> None:
        self.cuda = torch.cuda.is_available()
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        self._pre = model.register_forward_pre_hook(self._before)
        self._post = model.register_forward_hook(self._after)

    def _before(self, module: Any, args: Any) -> None:
        self.starts.append(time.perf_counter())
        if self.cuda and torch.cuda.is_current_stream_capturing():
            self.events.append((None, None))  # an event recorded into a graph has no time to read
        elif self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((e, None))

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self.ends.append(time.perf_counter())
        if self.cuda and self.events[-1][0] is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events[-1] = (self.events[-1][0], e)

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()

    def steps(self) -> list[dict[str, float | None]]:
        """Per forward but the last: ``wall_ms`` (to the next forward's start), ``host_fwd_ms``
        (the forward's host time), ``gpu_ms`` (its GPU span; ``None`` on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: list[dict[str, float | None]] = []
        for i in range(len(self.starts) - 1):
            start, end = self.events[i] if self.cuda else (None, None)
            gpu = start.elapsed_time(end) if start is not None and end is not None else None
            out.append({"wall_ms": (self.starts[i + 1] - self.starts[i]) * 1e3,
                        "host_fwd_ms": (self.ends[i] - self.starts[i]) * 1e3, "gpu_ms": gpu})
        return out


def profile(model: Any, name: str, prompts: list[list[int]], args: Any, kv: dict[str, int],
            contenders: dict[str, Any], top: int = 15) -> str:
    """Serves ``prompts`` with contender ``name`` under the step clock and torch.profiler;
    returns profile.txt: per-step medians and totals, kernel time per step, the top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from harness import serving

    serving.run_contender(model, name, prompts[:8], args, kv, contenders, new_tokens=4)  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    clock = StepClock(model)
    try:
        with torch_profile(activities=acts) as prof:
            r = serving.run_contender(model, name, prompts, args, kv, contenders)
    finally:
        clock.remove()
    steps = clock.steps()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return report(name, r, steps, kernel_us / 1e3, prof, top)


def report(name: str, run: dict[str, Any], steps: list[dict[str, float | None]], kernel_ms: float, prof: Any,
           top: int) -> str:
    """The text of profile.txt."""
    n = max(1, len(steps))
    wall = sum(s["wall_ms"] or 0.0 for s in steps)
    gpu = [s["gpu_ms"] for s in steps if s["gpu_ms"] is not None]
    host_fwd = sum(s["host_fwd_ms"] or 0.0 for s in steps)
    lines = [f"profile of {name}: {run['requests']} requests, {run['generated_tokens']} tokens, "
             f"{run['wall_s']:.2f} s, {run['tok_s']:.0f} tok/s, {len(steps) + 1} steps (forwards)",
             "(under torch.profiler: absolute times are inflated; the shares are what to read)", "",
             f"per step, median: wall {statistics.median(s['wall_ms'] or 0.0 for s in steps) if steps else 0:.2f} ms, "
             f"host in forward {statistics.median(s['host_fwd_ms'] or 0.0 for s in steps) if steps else 0:.2f} ms, "
             f"GPU span {statistics.median(gpu) if gpu else float('nan'):.2f} ms",
             f"per step, mean: wall {wall / n:.2f} ms, host in forward {host_fwd / n:.2f} ms, "
             f"GPU span {sum(gpu) / n if gpu else float('nan'):.2f} ms, kernels {kernel_ms / n:.2f} ms"]
    if gpu:
        lines += [f"share of step wall time: kernels {kernel_ms / wall:.1%}, GPU idle inside forwards "
                  f"{(sum(gpu) - kernel_ms) / wall:.1%}, "
                  f"host between forwards (GPU waits) {(wall - sum(gpu)) / wall:.1%}"]
    else:
        lines += [f"share of step wall time: host in forward {host_fwd / wall:.1%} (CPU run: no device times)"
                  if wall else "no steps"]
    sort = "self_device_time_total" if gpu else "self_cpu_time_total"
    lines += ["", f"top {top} by {sort}:", prof.key_averages().table(sort_by=sort, row_limit=top)]
    return "\n".join(lines)
