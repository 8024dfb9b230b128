#!/usr/bin/env python3
"""A decode round's weight GEMMs on the serving suite's shapes (Llama-3.2-1B at 16 layers,
Llama-3-8B at 32): the seven projections of a layer as the model runs them (q, k, v, o, gate,
up, down) against the same weights fused into four (q+k+v, o, gate+up, down), then the LM head,
at a few round sizes (rows: the engine pads a graphed decode round to 64 tokens, and so on).

What it answers: how far the weight GEMMs of a small decode round sit from the copy bandwidth
(the serving roofline reads every weight once a decode step at the measured copy rate,
harness/roofline.py), and how much of that fusing the narrow projections gains back. The
fused and separate runs do the same FLOPs over the same bytes of weights.

Timing: every layer's GEMMs and the head, one whole round, captured in a CUDA graph (the
engine replays its decode rounds from graphs, so no launch gap is timed) and replayed
``--reps`` times between CUDA events, the two forms interleaved; the median. Each layer has its
own weights (a layer's are 60-440 MB, past L2), random bf16. ``bound`` is the weight bytes over
the copy bandwidth, the roofline's own rate.

Run: ``python3 python/benches/decode_gemms.py --out DIR`` (CUDA); ``--tiny`` runs small shapes
on the CPU, untimed by graphs (a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from harness import cli, outfiles
from harness.roofline import ModelShape, timed_call
from harness.table import format_table

#: the suite's shapes, by name: (layers, hidden, intermediate, heads, kv_heads, head_dim)
SHAPES = {"llama3.2-1b": (16, 2048, 8192, 32, 8, 64), "llama3-8b": (32, 4096, 14336, 32, 8, 128)}
#: --tiny's one shape (CPU)
TINY = {"tiny": (2, 64, 128, 4, 2, 16)}
FORMS = ("separate", "fused")
VOCAB = 128256
#: the most rows --rows takes (the engine's largest round is its max_batch_tokens, 8,192 by default)
MOST_ROWS = 65536


def shape_of(dims: tuple[int, ...], vocab: int) -> ModelShape:
    layers, hidden, inter, heads, kv_heads, head_dim = dims
    return ModelShape(layers=layers, hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, vocab=vocab, itemsize=2)


def weights(s: ModelShape, form: str, device: str, dtype: Any) -> list[list[Any]]:
    """Each layer's projection weights (``[out, in]``) in ``form``; ``form`` ``"head"``: the LM
    head's, as one layer of one."""
    if form == "head":
        return [[_random(s.vocab, s.hidden, device, dtype)]]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    outs = {"separate": [(q, s.hidden), (kv, s.hidden), (kv, s.hidden), (s.hidden, q), (s.intermediate, s.hidden),
                         (s.intermediate, s.hidden), (s.hidden, s.intermediate)],
            "fused": [(q + 2 * kv, s.hidden), (s.hidden, q), (2 * s.intermediate, s.hidden),
                      (s.hidden, s.intermediate)]}[form]
    return [[_random(o, i, device, dtype) for o, i in outs] for _ in range(s.layers)]


def _random(out: int, inp: int, device: str, dtype: Any) -> Any:
    """A random ``[out, in]`` weight of ``dtype`` (scaled as a layer's init is)."""
    import torch

    return (torch.randn(out, inp, device=device) * inp ** -0.5).to(dtype)


def round_fn(s: ModelShape, ws: list[list[Any]], rows: int, device: str, dtype: Any) -> Any:
    """One decode round's GEMMs over ``ws``: each projection reads an input of its width."""
    import torch
    import torch.nn.functional as F

    xs = {n: torch.randn(rows, n, device=device).to(dtype) for n in {w.shape[1] for layer in ws for w in layer}}

    def run() -> None:
        for layer in ws:
            for w in layer:
                F.linear(xs[w.shape[1]], w)
    return run


def time_forms(fns: dict[str, Any], reps: int, cuda: bool) -> dict[str, float]:
    """Median seconds of each form's round, interleaved; graphs and CUDA events on CUDA."""
    import torch

    calls = {}
    for name, fn in fns.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            calls[name] = graph.replay
        else:
            calls[name] = fn
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, call in calls.items():
            times[name].append(timed_call(call, cuda))
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,64,128", help="round sizes (tokens a decode round runs)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke test)")
    ap.add_argument("--out", default=None, help="folder for decode_gemms.txt and .json")
    args = ap.parse_args(argv)
    cli.check_int_list(ap, "--rows", args.rows)
    rows_list = cli.int_list(args.rows)
    if max(rows_list) > MOST_ROWS:
        ap.error(f"--rows must be at most {MOST_ROWS}, got {max(rows_list)}")
    cli.check_counts(ap, args, ["--reps"], [])
    if args.out is not None:
        cli.check_out(ap, args.out)
    if not args.tiny:
        cli.need_gpu(ap, "decode_gemms.py")
    import torch

    from harness.roofline import measure_peaks

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    small = {"n": 256, "copy_mib": 16, "reps": 3} if args.tiny else {}
    copy = measure_peaks(device, dtype, **small).copy_bytes
    shapes = TINY if args.tiny else SHAPES
    rows: list[dict[str, Any]] = []
    for name, dims in shapes.items():
        s = shape_of(dims, 512 if args.tiny else VOCAB)
        ws = {f: weights(s, f, device, dtype) for f in (*FORMS, "head")}
        for m in rows_list:
            t = time_forms({f: round_fn(s, w, m, device, dtype) for f, w in ws.items()}, args.reps, device == "cuda")
            layer_bytes = s.layers * s.layer_matmul_params * s.itemsize
            for form in FORMS:
                rows.append({"model": name, "rows": m, "form": form, "layers_ms": t[form] * 1e3,
                             "head_ms": t["head"] * 1e3, "round_ms": (t[form] + t["head"]) * 1e3,
                             "bound_ms": s.decode_weight_bytes / copy * 1e3,
                             "of_copy": layer_bytes / copy / t[form]})
        del ws  # this model's weights freed before the next model's are made
    text = format_table(rows, ["model", "rows", "form", "layers_ms", "head_ms", "round_ms", "bound_ms", "of_copy"],
                        title=f"a decode round's weight GEMMs (median of {args.reps} "
                              f"{'graph replays' if device == 'cuda' else 'calls'}; bound: the "
                              f"weights at the copy bandwidth, {copy / 1e9:.0f} GB/s; of_copy: the layers' weights' "
                              "bound over their time)")
    if args.out is not None:
        try:
            outfiles.replace({os.path.join(args.out, "decode_gemms.txt"): text + "\n",
                              os.path.join(args.out, "decode_gemms.json"): json.dumps(
                                  {"copy_bytes": copy, "device": torch.cuda.get_device_name() if device == "cuda"
                                   else "cpu", "rows": rows}, indent=1) + "\n"})
        except outfiles.WriteError as e:
            print(f"decode_gemms: {e}", file=sys.stderr)
            return 1
    print(text)
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
