"""vmem-serve against ``transformers serve --continuous-batching`` (the engine's own paged cache)
on one model directory and one KV budget, over request rates from light to past saturation; and
vmem-serve against the same engine in-process at the same load (harness/serve_compare.py).

    python3 python/benches/serve_compare.py --servers tf --rates 0.5x,1x,1.5x,2x --out target/cmp-tf
    python3 python/benches/serve_compare.py --servers vmem --capacity 0.9 --rates inf,1x,2x,4x --out target/cmp-vmem
    python3 python/benches/serve_compare.py --parts overhead --out target/cmp-overhead
    python3 python/benches/serve_compare.py --merge target/cmp-tf target/cmp-vmem target/cmp-overhead --out target/cmp

The model: ``--shape`` (default Llama-3-8B shapes at full depth, 32 layers, random bf16
weights), made with its tokenizer in ``--model-dir`` unless there already (make_model_dir.py).
Both servers load that directory on the GPU with ``--kv-memory`` of KV each: vmem-serve with
``--memory``, transformers serve with ``--cb-num-blocks`` blocks of ``--block-size`` tokens
holding the same bytes. Requests: the trace's rows (prompts capped at ``--max-prompt``, answers
at ``--max-output``, forced to length), text prompts of exact length, streamed.

Part ``sweep`` (per server of ``--servers``, transformers serve first): each of ``--rates``,
``inf`` first (every request queued at once: the server's saturation rate, the requests/s it
sustains at most), then Poisson arrivals; a rate ``Nx`` is N times transformers serve's
saturation rate, given with ``--capacity`` or measured by an ``inf`` run of transformers serve
that this command then makes first. A run at rate r sends about
``--rate-seconds`` of arrivals (``--min-prompts`` to ``--num-prompts`` requests). Part
``overhead``: ``--overhead-requests`` prompts x ``--overhead-tokens`` tokens, all at once,
through vmem-serve and through the engine in-process with vmem (``--inproc-contender``); the
target is the server at 0.9x the in-process tokens/s or more.

Writes ``serve_compare.json`` (every run, every request), ``.txt`` (table and the targets'
lines) and ``.svg`` (output tokens/s against TTFT p99, one line per server, a point per rate)
under ``--out``, after every run. Parts go in separate commands and are joined with ``--merge``.
A bad flag is a usage error (exit 2, one line) before any model or server; a server that does
not start is exit 1 with its log's end. ``--tiny``: a tiny model on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from harness import cli, serve_drivers, serve_run
from harness import serve_compare as sc
from harness.log import log

DEFAULT_OUT = os.path.join("target", "serve-compare")
PARTS = ("sweep", "overhead")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="sweep", help=f"comma list of {PARTS}")
    ap.add_argument("--servers", default="tf,vmem", help=f"comma list of {serve_drivers.KINDS} (sweep)")
    ap.add_argument("--rates", default="0.5x,1x,1.5x,2x", help="comma list: req/s, inf, or Nx (N times transformers "
                                                                "serve's saturation rate)")
    ap.add_argument("--capacity", type=float, default=None, help="transformers serve's saturation rate (req/s), for "
                                                                 "Nx rates without a tf run in this command")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run at most (all of them at inf)")
    ap.add_argument("--min-prompts", type=int, default=16, help="requests per run at least")
    ap.add_argument("--rate-seconds", type=float, default=45.0, help="seconds of arrivals a run at a rate aims at")
    ap.add_argument("--overhead-requests", type=int, default=64)
    ap.add_argument("--overhead-tokens", type=int, default=128)
    ap.add_argument("--inproc-contender", default="vmem-token-major-graphs-async",
                    help="the in-process engine's vmem contender (harness/contenders.py): what vmem-serve runs")
    ap.add_argument("--inproc-max-requests", type=int, default=64)
    ap.add_argument("--inproc-max-context", type=int, default=8192)
    ap.add_argument("--inproc-page-size", default=None, help="vmem page size in process (default 2M, --tiny 64K)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR", help="join these parts' outputs into --out")
    serve_drivers.add_flags(ap, "llama3-8b", None, "3GiB")
    ap.set_defaults(max_output=256, max_time=150.0, drain=90.0, warmup=2, goodput=["ttft:2000", "tpot:100"])
    args = ap.parse_args(argv)
    if args.merge:
        serve_drivers.check_merge(ap, args, sc.NAME, DEFAULT_OUT, sc.merge)
        return args
    serve_drivers.check_flags(ap, args, DEFAULT_OUT)
    args.part_list = cli.names(ap, "--parts", args.parts, PARTS)
    args.server_list = cli.names(ap, "--servers", args.servers, serve_drivers.KINDS,
                                 allow_none="sweep" not in args.part_list)
    args.server_list.sort(key=lambda s: s != "tf")  # the baseline first: its saturation rate
    try:
        args.rates = sc.parse_rates(args.rates)
    except ValueError as e:
        ap.error(f"--rates {args.rates!r}: {e}")
    if args.capacity is not None:
        cli.check_positive(ap, "--capacity", args.capacity)
    if (any(k is not None for _, k in args.rates) and args.capacity is None and "sweep" in args.part_list
            and "tf" not in args.server_list):
        ap.error("--rates Nx needs transformers serve's saturation rate: --capacity, or tf in --servers")
    cli.check_counts(ap, args, ["--num-prompts", "--min-prompts", "--overhead-requests", "--overhead-tokens",
                                "--inproc-max-requests", "--inproc-max-context"],
                     most={"--num-prompts": 100_000, "--min-prompts": 100_000, "--overhead-requests": 100_000,
                           "--overhead-tokens": 1 << 20, "--inproc-max-requests": 4096,
                           "--inproc-max-context": 1 << 20})
    if args.min_prompts > args.num_prompts:
        ap.error(f"--min-prompts {args.min_prompts} is above --num-prompts {args.num_prompts}")
    cli.check_seconds(ap, "--rate-seconds", args.rate_seconds)
    cli.check_positive(ap, "--burstiness", args.burstiness)
    # What is installed last: a flag's own error first, whatever the machine holds.
    if "sweep" in args.part_list and "tf" in args.server_list:
        serve_drivers.check_tf_serve(ap, "--servers tf")
    if "overhead" in args.part_list:
        from harness import contenders as ct

        import vmem
        import vmem.transformers as vt

        try:
            vt.install()  # refused on a transformers vmem does not serve
            vt.uninstall()
        except vmem.VmemError as e:
            ap.error(f"--parts overhead: {e}")
        try:
            ct.spec(args.inproc_contender)
        except ValueError as e:
            ap.error(f"--inproc-contender: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.merge:
        print(sc.write(args.out, args.merged))
        return 0
    try:
        marker = serve_drivers.ensure_model(args.spec, args.model_dir, args.device)
    except serve_drivers.ModelDirError as e:
        log(f"serve_compare.py: {e}")
        return 1
    blocks = serve_drivers.tf_blocks(args.kv_bytes, args.block_size, marker["kv_token_bytes"])
    meta = {"model": f"{args.spec.shape} x {marker['layers']} layers ({args.spec.dtype}, random weights)",
            "model_dir": args.model_dir, "device": serve_drivers.device_name(), "versions": serve_drivers.versions(),
            "kv_bytes": args.kv_bytes, "tf_blocks": blocks, "block_size": args.block_size,
            "args": {k: str(v) for k, v in vars(args).items() if k not in ("spec", "api_key")}}
    doc: dict[str, Any] = {"meta": meta, "runs": [], "capacity": {}, "overhead": None}
    if args.capacity is not None:
        doc["capacity"]["tf"] = args.capacity

    def save() -> None:
        sc.write(args.out, doc)

    try:
        if "sweep" in args.part_list:
            for kind in args.server_list:
                sc.sweep(kind, args, marker, doc, save)
        if "overhead" in args.part_list:
            sc.overhead(args, marker, doc, save)
    except serve_run.ServerGone as e:
        log(f"serve_compare.py: {e}")
        save()
        return 1
    print(sc.write(args.out, doc))
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
