"""CUDA graphs with vmem in transformers' continuous batching, on the GPU, under the installed
transformers (5.17.x or 5.19-5.24): greedy tokens and logprobs with the engine's graph switch on
and off, and throughput on and off in one process (contenders interleaved). Exit 1 on a failure.

Checks (``kernel="fa"``, bf16 — FlashAttention has no fp32):
* the check model (:func:`harness.models.check_model` ``small``, decisive logits) and the
  8-layer Llama-3-8B-shape model: graphs off, graphs on (per-layer, token-major,
  ``graph_seqlen_k="context"``) and graphs + async batching; each run's tokens teacher-forced
  against a plain ``DynamicCache`` forward: top-1 agreement where the reference is decisive, and
  the largest error of the engine's logprob of its token (``return_logprobs``; the forward hook
  that captures logits does not run on a replay); tokens compared with the graphs-off run
  (reported; in bf16 they may part at near-ties, the top-1 check is what fails the run);
  ``CUDAGraph.replay`` counted (graphs were replayed, not just captured).
* throughput: decode-heavy requests on the 8-layer model, each contender ``--repeats`` times,
  interleaved; tok/s and the ratio to graphs-off.
* ``--kernels fa,flashinfer`` (needs FlashInfer): the same runs with ``kernel="flashinfer"``
  (``fi-*``: off, graphs, token-major, async), each also compared with the FA run of the same
  switches (tokens equal, ``same_tokens_as_fa``); the top-1 check against the plain forward is
  what fails a run. The throughput adds ``fi-off``, ``fi-graphs``, ``fi-graphs-async`` and each
  one's ratio to FA's ``graphs`` (``ratio_to_fa_graphs``).

    python3 python/benches/graphs_check.py [--bench-requests 64] [--repeats 2] [--kernels fa,flashinfer]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from harness import check as h
from harness import cli
from harness import engine as he
from harness.models import llama3_8b_config, random_model

import vmem.transformers as vt

IS_517 = transformers.__version__.startswith("5.17.")
LENGTHS = [5, 300, 1100, 40, 2000, 17, 700, 64]
NEW = 16
RUNS = {
    "off": ({"use_cuda_graph": False}, {}),
    "graphs": ({"use_cuda_graph": True}, {}),
    "graphs-token-major": ({"use_cuda_graph": True}, {"layout": "token-major"}),
    "graphs-context-k": ({"use_cuda_graph": True}, {"graph_seqlen_k": "context"}),
    "graphs-async": ({"use_cuda_graph": True, "use_async_batching": True}, {}),
    "graphs-warmup": ({"use_cuda_graph": True, "warmup": True}, {}),  # manager.warmup() pre-captures first
    # ... every decode graph too (vmem.transformers.warmup), on both of async batching's IO pairs
    "graphs-async-warmup": ({"use_cuda_graph": True, "use_async_batching": True, "warmup": True}, {}),
}
#: kernel="flashinfer" runs: the FA run of the same switches each is compared with.
FI_RUNS = {"fi-off": "off", "fi-graphs": "graphs", "fi-graphs-token-major": "graphs-token-major",
           "fi-graphs-async": "graphs-async"}
for _fi, _fa in FI_RUNS.items():
    RUNS[_fi] = (RUNS[_fa][0], {**RUNS[_fa][1], "kernel": "flashinfer"})
REPLAYS = [0]


def _count_replays() -> None:
    real = torch.cuda.CUDAGraph.replay

    def replay(self: torch.cuda.CUDAGraph) -> None:
        REPLAYS[0] += 1
        real(self)

    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]


def serve(model, prompts, new, cb, opts, max_batch_tokens=512):
    REPLAYS[0] = 0
    cb = dict(cb)
    warmup = cb.pop("warmup", False)
    cbk = dict(max_batch_tokens=max_batch_tokens, return_logprobs=True, **cb)
    t0 = time.perf_counter()
    run = he.run_engine(model, vt.VMEM_ATTENTION, prompts, new, cb_kwargs=cbk, serving=opts or None, timeout=200,
                        warmup=warmup, workload_hints=warmup)
    wall = time.perf_counter() - t0
    res = [run["results"][i] for i in run["ids"]]
    return {"tokens": [list(r.generated_tokens) for r in res], "logprobs": [list(r.logprobs) for r in res],
            "wall": wall, "replays": REPLAYS[0], "rows_left": run["cache"].usage()["rows_in_use"]}


def teacher_forced(model, prompts, run):
    """Top-1 agreement (decisive positions) and the largest logprob error against a plain forward."""
    agree = decisive = 0
    worst = 0.0
    for p, gen, lps in zip(prompts, run["tokens"], run["logprobs"]):
        ref = h.reference_logits(model, p + gen[:-1])[len(p) - 1:]
        logp = torch.log_softmax(ref, -1)
        for k, tok in enumerate(gen):
            r = ref[k]
            scale = r.abs().max().item()
            top2 = torch.topk(r, 2)
            if (top2.values[0] - top2.values[1]).item() / max(scale, 1e-6) > 0.05:
                decisive += 1
                agree += int(tok == top2.indices[0].item())
            if k < len(lps):
                worst = max(worst, abs(lps[k] - logp[k, tok].item()))
    return {"top1": [agree, decisive], "max_logprob_err": round(worst, 4)}


def check(label, model, prompts, names):
    out = {}
    runs = {}
    for name in names:
        cb, opts = RUNS[name]
        try:
            r = runs[name] = serve(model, prompts, NEW, cb, opts)
            tf = teacher_forced(model, prompts, r)
            base = runs.get("off")
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) if base else None
            out[name] = dict(tf, same_tokens_as_off=[same, len(prompts)], replays=r["replays"],
                             rows_left=r["rows_left"], secs=round(r["wall"], 1))
            fa = runs.get(FI_RUNS.get(name, ""))
            if fa is not None:
                out[name]["same_tokens_as_fa"] = [sum(a == b for a, b in zip(r["tokens"], fa["tokens"])), len(prompts)]
        except Exception as e:  # noqa: BLE001 - a failure is a row
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(label, name, out[name], flush=True)
    return out


def bench(model, args):
    prompts = h.make_prompts(args.bench_requests, [200, 480, 90, 330], model.config.vocab_size, seed=3)
    names = ["off", "graphs", "graphs-context-k", "graphs-async"]
    if "flashinfer" in args.kernels:
        names += ["fi-off", "fi-graphs", "fi-graphs-async"]
    rows: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up: captures every graph size once
        serve(model, prompts[:8], 8, *RUNS[n], max_batch_tokens=args.max_batch_tokens)
    for _ in range(args.repeats):
        for n in names:
            r = serve(model, prompts, args.new_tokens, *RUNS[n], max_batch_tokens=args.max_batch_tokens)
            rows[n].append(sum(len(t) for t in r["tokens"]) / r["wall"])
    off = sum(rows["off"]) / len(rows["off"])
    fa_graphs = sum(rows["graphs"]) / len(rows["graphs"])
    table = {n: {"tok_s": [round(x, 1) for x in v], "ratio_to_off": round(sum(v) / len(v) / off, 3),
                 "ratio_to_fa_graphs": round(sum(v) / len(v) / fa_graphs, 3)} for n, v in rows.items()}
    for n, v in table.items():
        print("bench", n, v, flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--kernels", default="fa", help="fa (default) or fa,flashinfer (needs FlashInfer)")
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--bench-requests", "--new-tokens", "--max-batch-tokens", "--repeats"],
                     most={"--bench-requests": 2000, "--new-tokens": 2048, "--repeats": 1000})
    kernels = cli.names(ap, "--kernels", args.kernels, ["fa", "flashinfer"])
    if "fa" not in kernels:
        ap.error(f"--kernels: fa or fa,flashinfer (FlashInfer's runs are compared with FA's), got {args.kernels!r}")
    cli.need_gpu(ap, "graphs_check.py")
    args.kernels = kernels
    names = [n for n in RUNS if n not in FI_RUNS or "flashinfer" in kernels]
    print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))
    _count_replays()
    vt.install(memory="2GiB", max_requests=64, max_context=4096)
    out = {"transformers": transformers.__version__, "device": torch.cuda.get_device_name(0)}
    if not args.skip_small:
        small = h.make_model("llama-gqa", torch.bfloat16, "cuda", size="small", logit_scale=20.0)
        out["small"] = check("small", small, h.make_prompts(len(LENGTHS), LENGTHS, small.config.vocab_size), names)
        del small
    big = random_model(llama3_8b_config(layers=8), torch.bfloat16, "cuda")
    out["llama3-8b-8layers"] = check("llama3-8b-8layers", big, h.make_prompts(len(LENGTHS), LENGTHS,
                                                                             big.config.vocab_size), names)
    out["bench"] = bench(big, args)
    print("JSON", json.dumps(out))
    bad = []  # bf16: greedy tokens may part at near-ties (padded shapes pick other GEMM kernels), so the
    # check is top-1 where the reference is decisive; tests/test_gpu.py::test_cb_graphs asserts identical tokens
    for label in ("small", "llama3-8b-8layers"):
        for name, r in out.get(label, {}).items():
            graphs = RUNS[name][0].get("use_cuda_graph", False)  # fi-off, like off, replays nothing
            if ("error" in r or r["rows_left"] != 0 or (graphs and r["replays"] == 0)
                    or r["top1"][0] != r["top1"][1]):
                bad.append(f"{label}/{name}")
    print("FAIL " + ", ".join(bad) if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    cli.exit_with(main)
