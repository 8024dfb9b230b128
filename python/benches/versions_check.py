"""vmem.transformers on the GPU under the installed transformers (5.19+: the engine's own reference
is ``sdpa``), bf16: vmem's layouts and kernels and a preemption run against the engine's own path
and DynamicCache (teacher-forced logits, top-1, greedy tokens). Exit 1 on a failure.

    python3 python/benches/versions_check.py      # a GPU machine, transformers 5.19-5.24
"""

import argparse
import json
import time

import torch
import transformers
from harness import check as h
from harness import cli

import vmem.transformers as vt

TOL = 0.04  # bf16, relative to the largest logit (serving_check.py's tolerance)
NEW = 16
LENGTHS = [5, 300, 1100, 40, 2000, 17, 700, 64]
CONTENDERS = {
    "vmem-per-layer-fa": {"layout": "per-layer"},
    "vmem-token-major-fa": {"layout": "token-major"},
    "vmem-per-layer-flex": {"layout": "per-layer", "kernel": "flex"},
    "vmem-preempt": {"memory": str(5 * 16 << 20), "max_requests": 8},
}


def run(model, prompts, theirs, opts):
    t0 = time.time()
    r = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs={"max_batch_tokens": 512}, serving=opts)
    c = h.compare(r, model, NEW)
    same = sum(list(r["results"][i].generated_tokens) == list(theirs["results"][i].generated_tokens) for i in r["ids"])
    cache = r["cache"]
    return {"err": round(c["max_rel_err"], 4), "top1": [c["top1_agree"], c["decisive"]], "counts": c["counts_ok"],
            "same_greedy_as_sdpa": [same, len(prompts)], "cache": type(cache).__name__,
            "readmissions": getattr(cache, "readmissions", None), "rows_left": cache.usage()["rows_in_use"],
            "secs": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    cli.need_gpu(ap, "versions_check.py")
    print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))
    vt.install(memory="2GiB", max_requests=16, max_context=4096)
    model = h.make_model("llama-gqa", torch.bfloat16, "cuda", size="small", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    theirs = h.run_engine(model, "sdpa", prompts, NEW,
                          cb_kwargs={"max_batch_tokens": 512, "page_size": 256, "num_blocks": 256})
    ct = h.compare(theirs, model, NEW)
    out = {"sdpa": {"err": ct["max_rel_err"], "top1": [ct["top1_agree"], ct["decisive"]], "counts": ct["counts_ok"]}}
    print("sdpa", out["sdpa"], flush=True)
    for label, opts in CONTENDERS.items():
        try:
            out[label] = run(model, prompts, theirs, opts)
        except Exception as e:  # noqa: BLE001 - a failure is a row
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(label, out[label], flush=True)
    print("JSON", json.dumps(out))
    bad = [k for k, r in out.items() if k != "sdpa" and (
        "error" in r or r["err"] > TOL or not r["counts"] or r["rows_left"] != 0 or r["top1"][0] != r["top1"][1])]
    print("FAIL " + ", ".join(bad) if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    cli.exit_with(main)
