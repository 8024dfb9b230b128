"""``serving_suite.py --profile CONTENDER``: where a contender's engine steps spend their time.
Per step (one model forward): the wall time from its start to the next step's start, the host
time inside the forward (Python launching kernels), the GPU span of the forward (CUDA events
around it) and, from ``torch.profiler`` over the whole run, the kernels' own time. The
host-side share of a step is its wall time minus its GPU span: the time the device waits for
the engine (scheduling, input preparation, sampling, the result's copy back).

Under CUDA graphs a replay runs no forward hook, so the steps are also clocked per engine round
(:class:`harness.hostclock.HookClock`: one turn of the engine's loop) with the loop's three parts
timed exclusively: ``prepare`` (scheduling and batch preparation, vmem's hooks inside), ``compute``
(the forward or graph replay as the host launches it) and ``update`` (the output tokens' copy back,
where a synchronous engine waits for the GPU, and the requests' bookkeeping)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from harness.stats import percentile


class StepClock:
    """Forward pre- and post-hooks on ``model`` recording, per forward, the host clock at start
    and end and (on CUDA) an event pair."""

    def __init__(self, model: Any) -> None:
        self.cuda = torch.cuda.is_available()
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        # Left out of a compiled forward (varlen_compile_config), as the bench's round observer.
        self._pre = model.register_forward_pre_hook(torch.compiler.disable(self._before))
        self._post = model.register_forward_hook(torch.compiler.disable(self._after))

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
            contenders: dict[str, Any], top: int = 15) -> tuple[str, list[dict[str, Any]]]:
    """Serves ``prompts`` with contender ``name`` under the step clock and torch.profiler, then
    again without the profiler; returns profile.txt (per-step medians and totals, kernel time per
    step, the top kernels, and for both runs the round report, the TBT tail's gaps by the round
    they fall in (:mod:`harness.tailgaps`) and the slowest decode rounds with their probes
    (:mod:`harness.tailprobe`)) and every round of the run without the profiler (its kind,
    clock, loop parts and probes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from harness import serving, tailgaps, tailprobe

    serving.run_contender(model, name, prompts[:8], args, kv, contenders, new_tokens=4)  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    clock = StepClock(model)
    with round_clock() as rounds:
        tailprobe.attach(rounds)
        try:
            with torch_profile(activities=acts) as prof:
                r = serving.run_contender(model, name, prompts, args, kv, contenders, token_times=True)
        finally:
            clock.remove()
        rounds.close_round()
    steps = clock.steps()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    # The same run again without torch.profiler (whose buffers could make slow rounds of their
    # own): the round clock and the probes only.
    with round_clock() as plain:
        tailprobe.attach(plain)
        r2 = serving.run_contender(model, name, prompts, args, kv, contenders, token_times=True)
        plain.close_round()
    return "\n".join([report(name, r, steps, kernel_us / 1e3, prof, top), "", gpu_busy(prof, r2["wall_s"]), "",
                      round_report(rounds.rounds, kernel_us / 1e3), timeline(rounds, r), "",
                      tailgaps.report(r["token_times"], rounds.rounds), "",
                      tailprobe.slowest(rounds.rounds), "",
                      tailprobe.slowest(rounds.rounds, "prefill", 3), "",
                      f"again without torch.profiler: {r2['tok_s']:.0f} tok/s, TBT p50 {r2['tbt_p50_ms']:.2f} ms, "
                      f"p99 {r2['tbt_p99_ms']:.2f} ms, TTFT p99 {r2['ttft_p99_ms']:.0f} ms, "
                      f"{r2['preemptions']} preemptions, {r2['wall_s']:.2f} s",
                      round_report(plain.rounds, None), timeline(plain, r2), "",
                      tailgaps.report(r2["token_times"], plain.rounds), "", tailprobe.slowest(plain.rounds), "",
                      tailprobe.slowest(plain.rounds, "prefill", 3)]), plain.rounds


#: The name :func:`round_clock` counts the engine's CUDA graph captures under (``calls``).
CAPTURE = "capture"
#: The engine loop's parts :func:`round_clock` times, by method of ``ContinuousBatchProcessor``
#: (``compute`` is ``ModelRunner.compute_batch``).
LOOP_PARTS = (("prepare_next_batch", "prepare"), ("update_batch", "update"))


def round_clock() -> Any:
    """A :class:`~harness.hostclock.HookClock` on the engine's rounds and loop parts (a ``with``
    block puts the engine back)."""
    import importlib

    from harness.hostclock import HookClock

    api = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    runner = importlib.import_module("transformers.generation.continuous_batching.model_runner").ModelRunner
    ios = importlib.import_module("transformers.generation.continuous_batching.input_outputs")
    clock = HookClock()
    clock.wrap_all(api.ContinuousBatchProcessor, LOOP_PARTS)
    clock.wrap(runner, "compute_batch", "compute")
    # One call per CUDA graph the engine captured (async batching's IOs pass it to a pair's).
    clock.wrap(ios.ContinuousBatchingIOs, "set_graph", CAPTURE)
    clock.wrap_rounds(api.ContinuousBatchProcessor, runner)
    return clock


#: Kernel classes of :func:`gpu_busy`: a kernel is in the first class one of whose patterns its
#: name holds (lower case); vmem's Triton kernels by their function names (the slot kernel, the
#: merge). Attention comes first: FlashAttention's kernels are templated on CUTLASS
#: types (``cutlass::bfloat16_t``), which the GEMM class's ``cutlass`` would otherwise take.
#: Copies and index kernels are matched by ATen's kernel names only, so that Inductor's fused
#: kernels (``triton_poi_fused__to_copy_...``) stay ``other``.
KERNEL_CLASSES = (("attention", ("flash_fwd", "pytorch_flash", "flash::", "fmha", "attention", "sdpa",
                                "batchdecode", "batchprefill", "merge_state", "_combine_kernel", "_slot_kernel")),
                  ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
                  ("KV write / index", ("index_elementwise", "index_put", "index_copy", "index_fill",
                                        "indexfunc", "scatter")),
                  ("copy / fill", ("memcpy", "memset", "direct_copy", "copy_kernel", "fillfunctor")))


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of kernel ``name`` (``other`` where none matches)."""
    low = name.lower()
    return next((c for c, pats in KERNEL_CLASSES if any(p in low for p in pats)), "other")


def gpu_busy(prof: Any, plain_wall_s: float | None = None) -> str:
    """The GPU's busy time inside the timed phase of the profiled run (the
    :data:`harness.engine.TIMED_MARK` range): the union of its device events' intervals, and each
    kernel class's own time (:func:`kernel_class`), against the window and, where given, against
    ``plain_wall_s`` (the same run without the profiler: an estimate of the GPU's busy share
    there, as the work is the same; the profiler inflates kernel times a little, and copies on the
    copy engines may overlap kernels)."""
    from harness.engine import TIMED_MARK

    events = list(prof.events())
    marks = [e for e in events if e.name == TIMED_MARK]
    if not marks:
        return "GPU busy: no timed mark in the profile"
    lo, hi = marks[-1].time_range.start, marks[-1].time_range.end
    dev = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    spans = sorted((max(e.time_range.start, lo), min(e.time_range.end, hi), e.name) for e in dev
                   if e.time_range.end > lo and e.time_range.start < hi)
    if not spans:
        return f"GPU busy: no device events in the timed window ({(hi - lo) / 1e3:.0f} ms)"
    busy, end = 0.0, -math.inf
    for a, b, _ in spans:  # union of the intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    own: dict[str, float] = {}
    for a, b, n in spans:
        own[kernel_class(n)] = own.get(kernel_class(n), 0.0) + (b - a)
    window = (hi - lo) / 1e3
    line = (f"GPU busy in the timed window: {busy / 1e3:.0f} of {window:.0f} ms ({busy / 1e3 / window:.1%})")
    if plain_wall_s:
        plain = plain_wall_s * 1e3
        line += f"; of the run without the profiler ({plain:.0f} ms): {busy / 1e3 / plain:.1%}"
    parts = ", ".join(f"{c} {t / 1e3:.0f} ms" for c, t in sorted(own.items(), key=lambda kv: -kv[1]))
    return f"{line}\n  device time by class (own, overlaps counted in each): {parts}"


def timeline(clock: Any, run: dict[str, Any]) -> str:
    """Where the run's wall time (``run["t0_s"]`` on, ``run["wall_s"]`` long) went, clipped to it:
    the engine's rounds, its idle loop turns (``prepare_next_batch`` found nothing to run and the
    engine waited for requests), when its first round opened, and the rest: the run's time outside
    every turn (the wait before the first round included)."""
    t0 = run["t0_s"] * 1e9
    end = t0 + run["wall_s"] * 1e9

    def inside(start: int, wall: int) -> float:
        return max(0.0, min(start + wall, end) - max(start, t0)) / 1e6

    opened = [r["t_open_ns"] for r in clock.rounds if "t_open_ns" in r]
    rounds = sum(inside(r["t_open_ns"], r["wall_ns"]) for r in clock.rounds if "t_open_ns" in r)
    idle = [inside(a, w) for a, w in clock.idle if inside(a, w) > 0]
    first = ((min(t for t in opened if t >= t0) - t0) / 1e6) if any(t >= t0 for t in opened) else float("nan")
    wall = run["wall_s"] * 1e3
    return (f"the run's {wall:.0f} ms: engine rounds {rounds:.0f} ms, idle loop turns {len(idle)} "
            f"({sum(idle):.1f} ms, longest {max(idle, default=0.0):.1f}), first round opened at {first:.1f} ms, "
            f"outside every turn {wall - rounds - sum(idle):.1f} ms")


def round_report(rounds: list[dict[str, Any]], kernel_ms: float | None) -> str:
    """Per round kind: the rounds, their median, 90th and 99th percentile wall time (the tail is
    what time-between-tokens p99 sees), loop parts (medians each: they need not add up to the
    wall time), the requests and query tokens they carried (mean), the tokens the forward ran
    once padded for CUDA graphs (median) and the graphs the engine captured; for kinds of 20
    rounds or more, the parts of the slowest 1 % of rounds and how many of those captured a
    graph; and the kernels' share of all rounds' wall time (the GPU's busy share; ``kernel_ms``
    ``None``: a run without the profiler, no share)."""
    if not rounds:
        return "per engine round: no rounds clocked"
    wall = sum(r["wall_ns"] for r in rounds) / 1e6
    share = "" if kernel_ms is None else f"; kernels {kernel_ms / wall:.1%} of it"
    lines = [f"per engine round ({len(rounds)} rounds, {wall:.0f} ms{share}):",
             "kind     rounds  wall ms  p90 ms  p99 ms  prepare  compute  update  other  requests  tokens  "
             "padded tokens  graphs captured"]
    for kind in ("decode", "prefill"):
        rs = [r for r in rounds if r["kind"] == kind]
        if not rs:
            continue

        def med(f: Any) -> float:
            return statistics.median(f(r) for r in rs)

        parts = {p: med(lambda r, p=p: r["hooks"].get(p, 0) / 1e6) for p in ("prepare", "compute", "update")}
        other = med(lambda r: (r["wall_ns"] - sum(r["hooks"].get(p, 0) for p in parts)) / 1e6)
        mean_reqs = statistics.fmean(r["sequences"] for r in rs)
        mean_tokens = statistics.fmean(r["tokens"] for r in rs)
        padded = med(lambda r: r["padded_tokens"])
        walls = [r["wall_ns"] / 1e6 for r in rs]
        p90, p99 = (percentile(walls, q, "rank") for q in (90, 99))
        lines.append(f"{kind:<8} {len(rs):>6}  {med(lambda r: r['wall_ns'] / 1e6):>7.2f}  {p90:>6.2f}  {p99:>6.2f}  "
                     f"{parts['prepare']:>7.2f}  "
                     f"{parts['compute']:>7.2f}  {parts['update']:>6.2f}  {other:>5.2f}  "
                     f"{mean_reqs:>8.1f}  {mean_tokens:>6.1f}  {padded:>13.0f}  "
                     f"{sum(r.get('calls', {}).get(CAPTURE, 0) for r in rs):>15}")
        if len(rs) >= 20:  # where the tail's time goes: the slowest 1 % of rounds, their parts' medians
            slow = sorted(rs, key=lambda r: r["wall_ns"])[-max(1, len(rs) // 100):]
            tail = {p: statistics.median(r["hooks"].get(p, 0) / 1e6 for r in slow) for p in parts}
            rest = statistics.median((r["wall_ns"] - sum(r["hooks"].get(p, 0) for p in parts)) / 1e6 for r in slow)
            captured = sum(1 for r in slow if r.get("calls", {}).get(CAPTURE))
            lines.append(f"  slowest {len(slow)}: wall {statistics.median(r['wall_ns'] / 1e6 for r in slow):.2f} ms; "
                         f"prepare {tail['prepare']:.2f}, compute {tail['compute']:.2f}, update {tail['update']:.2f}, "
                         f"other {rest:.2f}; requests {statistics.fmean(r['sequences'] for r in slow):.1f}; "
                         f"{captured} captured a CUDA graph")
    return "\n".join(lines)


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
