"""The host time vmem adds per engine round, on the CPU (issue #32; docs/serving.md, "Host cost
per round").

The real engine serves a tiny random model (the layer counts and head dims of the 8B-x8 and
1B-x16 shapes) under the engine's own paged cache and vmem's, interleaved in one process
(``harness/hostcost.py`` says what is measured and how). Per batch size (decode rounds of
``--batches`` requests) and for the prefill rounds before them: the rounds' wall time, and the
host time per round split into each vmem hook, the engine's own paged cache's hooks and the
rest of the engine; ``--profile`` adds cProfile of the engine thread for vmem at the largest
batch. Writes host_cost.txt, results.json (and profile-*.txt) to ``--out``.

    python python/benches/host_cost.py --out target/host-cost
    python python/benches/host_cost.py --batches 16 --shapes 1b-x16 --repeats 1 --new-tokens 8 --out /tmp/hc
    python python/benches/host_cost.py --device cuda --out OUT     # on a GPU (host_cost_gpu_run.sh)

Contenders (``--contenders``): ``native`` (the engine's paged cache: ``paged-sdpa-256`` on 5.17,
``sdpa-256`` on 5.19+) and any vmem contender of harness/contenders.py (``vmem-token-major``,
``vmem-per-layer``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness import cli
from harness import contenders as cont
from harness import hostcost as hc
from harness import hostcost_report as report
from harness.cli import int_list
from harness.log import log


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(hc.SHAPES), help="comma-separated: " + ", ".join(hc.SHAPES))
    ap.add_argument("--batches", type=int_list, default=[16, 64, 256], help="decode batch sizes (requests)")
    ap.add_argument("--contenders", default="native,vmem-token-major")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (order reversed every other)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=200)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="cProfile the engine thread (vmem, largest batch)")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (the measurement this bench is for) or cuda (the same on a GPU: round wall times)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in hc.SHAPES]
    if not shapes or unknown:
        ap.error(f"--shapes: unknown {unknown or 'none given'} (known: {', '.join(hc.SHAPES)})")
    args.shape_list = shapes
    names = [c for c in args.contenders.split(",") if c]
    offered = cont.offered()
    for c in names:
        if c != "native" and (c not in offered or not cont.is_vmem(cont.spec(c))):
            ap.error(f"--contenders: {c!r} is neither 'native' nor a vmem contender of this version "
                     f"({', '.join(n for n in offered if n.startswith('vmem-'))})")
    if not names:
        ap.error("--contenders: none given")
    args.contender_list = [hc.native_name() if c == "native" else c for c in names]
    cli.check_counts(ap, args, ["--repeats", "--new-tokens", "--prompt-min", "--max-batch-tokens", "--profile-top"],
                     most={"--repeats": 1000, "--max-batch-tokens": 1 << 20})
    if max(args.batches) > 4096:
        ap.error(f"--batches: at most 4096 requests, got {max(args.batches)}")
    if args.prompt_max < args.prompt_min or args.prompt_max + args.new_tokens > hc.MAX_CONTEXT:
        ap.error(f"--prompt-max must be at least --prompt-min and, with --new-tokens, at most {hc.MAX_CONTEXT}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here")
    cli.check_seconds(ap, "--timeout", args.timeout)
    cli.check_out(ap, args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import transformers

    hc.setup(args.device)
    os.makedirs(args.out, exist_ok=True)
    runs, failed = [], 0
    for shape in args.shape_list:
        model = hc.tiny_model(shape, args.device)
        for rep in range(args.repeats):
            for batch in args.batches:
                order = args.contender_list if rep % 2 == 0 else args.contender_list[::-1]
                for name in order:
                    for mode in ("plain", "hooks"):
                        try:
                            run = hc.run_one(model, name, batch, args, mode)
                        except Exception as e:  # noqa: BLE001 - one failed run is reported, the rest go on
                            log(f"{shape} b{batch} {name} {mode}: FAILED {e!r}")
                            failed += 1
                            continue
                        run["shape"] = shape
                        log(f"{shape} b{batch} {name} {mode}: {len(run['rounds'])} rounds, {run['wall_s']:.2f} s")
                        runs.append(run)
        if args.profile:
            name = next((c for c in args.contender_list if cont.is_vmem(cont.spec(c))), None)
            if name is not None:
                run = hc.run_one(model, name, max(args.batches), args, "plain", profile=True)
                with open(os.path.join(args.out, f"profile-{shape}-b{max(args.batches)}.txt"), "w") as f:
                    f.write(f"cProfile of the engine thread: {name}, {shape}, {max(args.batches)} requests\n")
                    f.write(run.pop("profile"))
    calls = hc.binding_costs()
    rows = report.summarize(runs)
    threads = ", torch 1 thread" if args.device == "cpu" else ""
    header = [f"host cost per engine round, {args.device}: transformers {transformers.__version__}{threads}, "
              f"shapes {args.shape_list}, batches {args.batches}, {args.repeats} repeats, "
              f"prompts {args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new each",
              "command: " + " ".join(["python", "python/benches/host_cost.py"] + sys.argv[1:] if argv is None
                                     else ["host_cost.py"] + argv)]
    txt = report.text(rows, header) + "\nRust calls the hooks make per candidate or loop turn (µs per call, " \
        "257 rows, 16 layers): " + "; ".join(f"{k} {v:.2f}" for k, v in calls.items()) + "\n"
    with open(os.path.join(args.out, "host_cost.txt"), "w") as f:
        f.write(txt)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": dict(vars(args)), "rows": rows, "binding_us": calls, "failed": failed}, f, indent=1)
    print(txt)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
