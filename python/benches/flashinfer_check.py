"""``kernel="flashinfer"`` against ``kernel="fa"`` in the engine, on the GPU: the same prompts
through vmem.transformers with each kernel, both layouts, chunked prefill (mixed rounds) then
decode rounds; per run the teacher-forced logits against ``DynamicCache`` (max relative error,
top-1 where decisive), and FlashInfer against FA directly (greedy tokens equal, logits over the
common prefix). Models: the serving benches' Llama-3-8B shapes (8 layers, bf16, head dim 128,
GQA 32/8) and the checks' head-dim-64 model in fp16; a float32 model must be refused clearly.
Exit 1 on a failure. Needs FlashInfer (``pip install "vmem-kv[flashinfer]"``).

    python3 python/benches/flashinfer_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import transformers
from harness import check as h
from harness import cli
from harness.models import SERVING_TOKENS, llama3_8b_config, random_model

import vmem
import vmem.transformers as vt
from vmem.kernels.fi_reader import FlashInferReader

TOL = 0.04  # bf16/fp16, relative to the largest logit (serving_check.py's tolerance)
NEW = 16
LENGTHS = [5, 300, 1100, 40, 2000, 17, 700, 64]


def llama8(dtype: torch.dtype) -> Any:
    """The serving benches' model (Llama-3-8B shapes, 8 layers), output head x 20 (decisive logits)."""
    model = random_model(llama3_8b_config(8, max_position_embeddings=8192, tokens=SERVING_TOKENS), dtype, "cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def run(model: Any, prompts: list[list[int]], opts: dict[str, Any]) -> dict[str, Any]:
    plans: list[bool] = []
    real = FlashInferReader._plan

    def counting(self: Any, rnd: Any, state: Any, scale: Any) -> None:
        real(self, rnd, state, scale)
        plans.append(state.plan.decode)

    FlashInferReader._plan = counting  # type: ignore[method-assign]
    try:
        t0 = time.time()
        r = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs={"max_batch_tokens": 512}, serving=opts)
    finally:
        FlashInferReader._plan = real  # type: ignore[method-assign]
    c = h.compare(r, model, NEW)
    r["summary"] = {"err": c["max_rel_err"], "top1": [c["top1_agree"], c["decisive"]], "counts": c["counts_ok"],
                    "kernel": r["cache"].kernel, "layout": r["cache"].layout, "rounds": r["rounds"],
                    "decode_plans": sum(plans), "prefill_plans": len(plans) - sum(plans),
                    "rows_left": r["cache"].usage()["rows_in_use"], "secs": round(time.time() - t0, 1)}
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="flashinfer-check-out")
    args = ap.parse_args(argv)
    cli.need_modules(ap, "flashinfer_check.py", ["flashinfer"])
    cli.need_gpu(ap, "flashinfer_check.py")
    cli.check_out(ap, args.out)
    import flashinfer

    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "flashinfer": flashinfer.__version__}
    print(meta, flush=True)
    vt.install(memory="4GiB", max_requests=16, max_context=4096)
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    models = {"llama3-8b-shape-8l bf16 hd128": lambda: llama8(torch.bfloat16),
              "hd64-tied fp16 hd64": lambda: h.make_model("hd64-tied", torch.float16, "cuda", size="small")}
    for label, make in models.items():
        model = make()
        prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
        for layout in vt.LAYOUTS:
            got = {k: run(model, prompts, {"layout": layout, "kernel": k}) for k in ("fa", "flashinfer")}
            fi, fa = got["flashinfer"], got["fa"]
            same = sum(list(fi["results"][i].generated_tokens) == list(fa["results"][i].generated_tokens)
                       for i in fi["ids"])
            row = {"model": label, "layout": layout, "fa": fa["summary"], "flashinfer": fi["summary"],
                   "same_greedy": [same, len(prompts)], "fi_vs_fa_err": h.cross_compare(fi, fa)}
            s = fi["summary"]
            ok = (s["err"] <= TOL and s["counts"] and s["top1"][0] == s["top1"][1] and s["rows_left"] == 0
                  and s["decode_plans"] > 0 and s["prefill_plans"] > 0 and row["fi_vs_fa_err"] <= TOL)
            row["status"] = "PASS" if ok else "FAIL"
            if not ok:
                failed.append(f"{label} {layout}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    # float32: refused when the cache is built (FlashInfer's kernels here: float16/bfloat16).
    try:
        vt.cache_class()(h.make_config("llama-gqa", "small"), transformers.ContinuousBatchingConfig(), "cuda",
                         dtype=torch.float32, options=vt.options().replace(kernel="flashinfer"))
        refused = ""
    except vmem.VmemError as e:
        refused = str(e)
    ok = "kernel='flashinfer' serves float16 and bfloat16" in refused
    rows.append({"model": "llama-gqa fp32", "status": "PASS" if ok else "FAIL", "refused": refused[:300]})
    print(json.dumps(rows[-1]), flush=True)
    if not ok:
        failed.append("fp32 refusal")
    with open(os.path.join(args.out, "flashinfer_check.json"), "w") as f:
        json.dump({**meta, "tol": TOL, "rows": rows}, f, indent=1)
    print("FAIL " + ", ".join(failed) if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
