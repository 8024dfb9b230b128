"""The serving suite: one command runs every workload and writes the table and the plot.

Workloads: two traces (the bundled Azure conversation and code traces, first ``--requests``,
prompts capped at ``--max-prompt``, random token ids of those lengths), three models (the
headline first: Llama-3-8B shapes at its full 32 layers; the same shapes x 8 layers;
Llama-3.2-1B shapes at its full 16 layers; random bf16 weights), two KV budgets (``fits``:
every request at once; ``tenth``: ``--tenth`` of the working set, memory bound), and the
contenders of harness/contenders.py the running transformers version offers (all by default),
interleaved per workload in one process, and the engine's best again in a process where vmem was
never imported (``NAME@clean``, harness/clean.py; any engine contender can be named so). Before
any run the bf16 matmul peak and the copy bandwidth are measured; each row carries its roofline
lower bound (harness/roofline.py) and the fraction of it reached, its device memory as
``cudaMemGetInfo`` sees it (the peak sampled during the run minus the idle level before it), and
its tok/s over the engine's best native contender's (with vmem installed, without it, the
better of the two) and over ``fi-paged``'s. A few requests per contender are first checked
against a plain forward (top-1 agreement, ``--check-requests``).

Writes suite.json, suite.txt and suite.svg to ``--out``. ``--only KEY=A,B`` (KEY: trace, model,
budget, contender; repeatable) runs a part, ``--merge OUT1 OUT2 ...`` combines parts into
``--out``. ``--profile CONTENDER`` profiles that contender on the first selected workload
instead (profile.txt, whose kernel table lists ``--profile-top`` kernels; rounds.jsonl, every
round of its run without the profiler). ``--tiny`` runs each
model's tiny fp32 stand-in on the CPU (a smoke test).
``--schedule`` runs the stand-ins on the CPU under the GPU run's limits (rows, context, batch
tokens; each stand-in has the layers that make its 64K token-major page hold as many tokens as
its model's 2M page): the engine meets the GPU run's workload under its limits, so the rounds,
requests at once and preemptions of a run are read without a GPU (where every round costs about
the same, as when memory is short, rounds predict the tok/s ratio), except that the CPU finishes
each round before scheduling the next, where asynchronous batching schedules a round ahead; its
times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

DEFAULT_OUT = os.path.join("target", "serving-suite")
#: where Linux says how many memory mappings a process may hold (``--schedule``'s check)
MAP_COUNT = "/proc/sys/vm/max_map_count"
ONLY_KEYS = ("trace", "model", "budget", "contender")


def parse_only(ap: argparse.ArgumentParser, specs: list[str], known: dict[str, list[str]]) -> dict[str, list[str]]:
    """``--only KEY=A,B`` flags as ``{KEY: [A, B]}`` (in the suite's order); an unknown key or
    name, or none named, is a usage error."""
    from harness import cli

    only: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, names = spec.partition("=")
        if not sep or key not in ONLY_KEYS:
            ap.error(f"--only {spec!r}: expected KEY=NAME[,NAME...] with KEY one of {list(ONLY_KEYS)}")
        picked = cli.names(ap, f"--only {key}", names, known[key])
        only[key] = [n for n in known[key] if n in picked or n in only.get(key, [])]
    return only


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="KEY=A,B",
                    help=f"run a part: KEY one of {list(ONLY_KEYS)} (repeatable)")
    ap.add_argument("--merge", nargs="+", metavar="OUT", help="combine these outputs' suite.json into --out")
    ap.add_argument("--profile", metavar="CONTENDER", help="profile one contender on the first selected workload")
    ap.add_argument("--profile-top", type=int, default=15, metavar="N",
                    help="--profile's kernel table: the N kernels of most device time")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=4000)
    ap.add_argument("--tenth", type=float, default=0.1, help="the memory-bound budget's share of the working set")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--max-requests", type=int, default=256, help="vmem rows (requests holding KV at once)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--page-size", default=None, help="one of vmem's page sizes (default 2M, --tiny 64K)")
    ap.add_argument("--memory-percent", type=float, default=0.9, help="the engine's activation headroom check")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per contender and model")
    ap.add_argument("--no-graph-warmup", dest="graph_warmup", action="store_false",
                    help="capture CUDA graphs while serving, not at each engine's start (the engine's warmup, "
                         "and every decode graph: vmem.transformers.warmup)")
    ap.add_argument("--check-requests", type=int, default=4, help="requests of the top-1 check per contender (0: off)")
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models on the CPU (smoke test)")
    ap.add_argument("--schedule", action="store_true",
                    help="each model's tiny stand-in on the CPU under the GPU run's limits (rows, context, batch "
                         "tokens): the engine's schedule as on the GPU (rounds, requests at once, preemptions); "
                         "its times mean nothing")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.tiny = args.tiny or args.schedule

    from harness import cli, outfiles, suite_report

    if args.merge:
        try:
            os.makedirs(args.out, exist_ok=True)
            parts, rows, checks = suite_report.merge(args.merge)
        except (OSError, ValueError) as e:
            ap.error(f"--merge: {e}")
        from harness.suite import add_ratios

        add_ratios(rows)
        try:
            suite_report.save(args.out, parts, rows, checks)
        except outfiles.WriteError as e:
            print(f"serving_suite: --merge: {e}", file=sys.stderr)
            return 1
        print(suite_report.table(rows, checks))
        return 0

    from harness import clean, suite
    from harness import contenders as ct

    args.trace = suite.TRACES["conv"]  # what cli.check_flags looks at; every trace is checked below
    reg = suite.registry()
    known = {"trace": list(suite.TRACES), "model": list(suite.MODELS), "budget": list(suite.BUDGETS),
             "contender": list(reg)}
    only = parse_only(ap, args.only, known)
    cli.check_flags(ap, args, ["--requests", "--new-tokens", "--rounds", "--max-prompt", "--max-batch-tokens",
                               "--max-requests", "--max-context", "--check-tokens", "--profile-top"],
                    ["--warmup", "--check-requests"])
    cli.check_fraction(ap, "--tenth", args.tenth)
    for t in only.get("trace", known["trace"]):
        cli.trace_lengths(ap, suite.TRACES[t], args.requests, args.max_prompt)
    if args.profile is not None:
        cli.names(ap, "--profile", args.profile, [n for n in known["contender"] if not clean.is_clean(n)])
    names = only.get("contender", suite.default_contenders())
    cli.place(ap, args)
    if args.schedule and cli.page_bytes(ap, args.page_size) != 64 << 10:
        ap.error(f"--schedule --page-size {args.page_size}: the stand-ins' 64K pages hold as many tokens as the "
                 "GPU run's 2M pages; no other size does")
    if any(ct.is_vmem(suite.registry()[n]) for n in names):
        cli.check_fits(ap, args)
        if args.schedule:
            check_map_count(ap, args, only.get("model", list(suite.MODELS)))
    from harness import roofline

    import vmem.transformers as vt

    vt.install()
    if args.profile:
        return profile(args, only)
    t = time.perf_counter()
    small = {"n": 256, "copy_mib": 16, "reps": 3} if args.tiny else {}
    peaks = roofline.measure_peaks(args.device, args.dtype, **small)
    print(f"peaks: matmul {peaks.matmul_flops / 1e12:.1f} TFLOP/s, copy {peaks.copy_bytes / 1e9:.0f} GB/s "
          f"({time.perf_counter() - t:.1f} s)", flush=True)
    part = {**run_meta(args), "peaks": {"matmul_flops": peaks.matmul_flops, "copy_bytes": peaks.copy_bytes},
            "only": only, "contenders": names}

    def save(rows: list, checks: list) -> None:
        suite_report.save(args.out, [part], rows, checks)

    try:
        rows = suite.run_suite(args, names, only, peaks, save)
    except outfiles.WriteError as e:  # the last whole suite.json, .txt and .svg stay as they were
        print(f"serving_suite: {e}", file=sys.stderr)
        return 1
    text = suite_report.table(rows, [])
    print(text)
    failed = [r for r in rows if r.get("error")]
    return 1 if failed or not rows else 0


def check_map_count(ap: argparse.ArgumentParser, args: argparse.Namespace, models: list[str]) -> None:
    """``--schedule`` with a vmem contender: on the CPU vmem maps a zero page at every page slot
    of its rows, one memory mapping each; more than the OS allows (``vm.max_map_count``, less 4,096
    for the rest of the process) is a usage error naming the fix, before anything runs."""
    from harness import cli, suite
    from harness import roofline as rf

    page = cli.page_bytes(ap, args.page_size)
    worst = max(rf.ModelShape.from_config(suite.model_config(m, True, args.max_context, True), 4).token_kv_bytes
                for m in models)
    need = -(-(args.max_requests + 1) * args.max_context * worst // page) + 4096
    try:
        with open(MAP_COUNT) as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return  # not Linux's limit: vmem's own check speaks when the cache is made
    if need > limit:
        ap.error(f"--schedule: vmem's rows on the CPU need about {need} memory mappings (--max-requests "
                 f"{args.max_requests}, --max-context {args.max_context}, {args.page_size} pages) and "
                 f"vm.max_map_count is {limit}: raise it (as root: sysctl -w vm.max_map_count={1 << 20}) "
                 f"or lower --max-requests")


def profile(args: argparse.Namespace, only: dict[str, list[str]]) -> int:
    """``--profile``: the contender on the first selected model, trace and budget."""
    from harness import outfiles, stepprofile, suite

    model, w = _first_workload(args, only)
    try:
        body, rounds = stepprofile.profile(model, args.profile, w.prompts, args, w.kv, suite.registry(),
                                           top=args.profile_top)
    except Exception as e:  # the engine's refusal (async batching without CUDA, ...): one line, exit 1
        print(f"serving_suite: --profile {args.profile} on {w.trace}/{w.model}/{w.budget} failed: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    text = f"{w.trace}/{w.model}/{w.budget}\n" + body
    files = {os.path.join(args.out, name): data for name, data in (
        ("profile.txt", text + "\n"), ("rounds.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rounds)))}
    try:  # both or neither: a full disk leaves a run before's files as they were
        outfiles.replace(files)
    except outfiles.WriteError as e:
        print(f"serving_suite: --profile: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _first_workload(args: argparse.Namespace, only: dict[str, list[str]]) -> tuple[Any, Any]:
    """The model and :class:`harness.suite.Workload` of the first selected model, trace, budget."""
    from harness import roofline as rf
    from harness import suite
    from harness.models import random_model
    from harness.trace import load_trace, random_prompts

    model_name, trace = only.get("model", list(suite.MODELS))[0], only.get("trace", list(suite.TRACES))[0]
    budget = only.get("budget", list(suite.BUDGETS))[0]
    config = suite.model_config(model_name, args.tiny, args.max_context, args.schedule)
    model = random_model(config, args.dtype, args.device)
    shape = rf.ModelShape.from_config(config, model.dtype.itemsize)
    lens = [r.prompt_len for r in load_trace(suite.TRACES[trace], args.requests, args.max_prompt)]
    prompts = random_prompts(lens, config.vocab_size, args.seed)
    return model, suite.workload(trace, model_name, budget, prompts, shape, args, suite._page_bytes(args.page_size))


def run_meta(args: argparse.Namespace) -> dict:
    """The part's arguments, device and versions."""
    import torch
    import transformers

    return {"args": {k: str(v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}


if __name__ == "__main__":
    from harness import cli

    cli.exit_with(main)
