"""Teacher-forced checks of an engine run (:func:`harness.engine.run_engine` with
``capture_logits``): the engine's own greedy tokens are fed, whole, to a plain forward with
``DynamicCache`` (sdpa), whose logits at the same positions are the reference. The engine's
logits are teacher-forced on its own tokens, so no near-tie can make the two runs diverge."""

from __future__ import annotations

from typing import Any

import torch

from harness import engine
from harness.engine import fake_cpu_memory
from harness.models import ARCHS, check_config, check_model
from harness.trace import random_prompts

#: what python/tests/test_transformers_cb.py and serving_check.py use, by these names
__all__ = ["ARCHS", "compare", "cross_compare", "fake_cpu_memory", "make_config", "make_model", "make_prompts",
           "reference_logits", "run_engine"]
make_config = check_config
make_model = check_model


def make_prompts(n: int, lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    """``n`` random prompts, prompt ``i`` of ``lengths[i % len(lengths)]`` tokens (seeded)."""
    return random_prompts([lengths[i % len(lengths)] for i in range(n)], vocab, seed)


def run_engine(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`harness.engine.run_engine` capturing every round's logits, for :func:`compare`."""
    return engine.run_engine(*args, capture_logits=True, **kwargs)


@torch.no_grad()
def reference_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Logits of one plain forward over ``tokens`` with a ``DynamicCache`` (sdpa): ``[L, V]``."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    ids = torch.tensor([tokens], device=model.device)
    out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    return out.logits[0].float().cpu()


def compare(run: dict[str, Any], model: Any, max_new_tokens: int) -> dict[str, Any]:
    """Teacher-forced comparison of every request's captured logits against the reference.

    Returns the largest error relative to the largest reference logit, the top-1 agreement where
    the reference's top-2 margin is decisive, and the per-request token counts."""
    worst = 0.0
    decisive = agree = 0
    counts_ok = True
    per_req = {}
    for i, rid in enumerate(run["ids"]):
        res = run["results"][rid]
        gen = list(res.generated_tokens)
        got = run["logits"].get(rid, [])
        if len(gen) != max_new_tokens or len(got) != len(gen):
            counts_ok = False
        prompt = run["prompts"][i]
        ref = reference_logits(model, prompt + gen[:-1])
        n = min(len(got), len(gen))
        err = 0.0
        for k in range(n):
            r = ref[len(prompt) - 1 + k]
            scale = r.abs().max().item()
            e = (got[k] - r).abs().max().item() / max(scale, 1e-6)
            err = max(err, e)
            top2 = torch.topk(r, 2)
            margin = (top2.values[0] - top2.values[1]).item() / max(scale, 1e-6)
            if margin > 0.05:
                decisive += 1
                agree += int(got[k].argmax().item() == top2.indices[0].item())
        worst = max(worst, err)
        per_req[rid] = {"err": err, "tokens": len(gen), "captured": len(got)}
    return {"max_rel_err": worst, "decisive": decisive, "top1_agree": agree, "counts_ok": counts_ok,
            "requests": per_req}


def cross_compare(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative logits difference between two engine runs over each request's common
    prefix of identical generated tokens (the runs are not teacher-forced on each other)."""
    worst = 0.0
    for rid in a["ids"]:
        ga = list(a["results"][rid].generated_tokens)
        gb = list(b["results"][rid].generated_tokens)
        la, lb = a["logits"][rid], b["logits"][rid]
        for k in range(min(len(la), len(lb))):
            scale = lb[k].abs().max().item()
            worst = max(worst, (la[k] - lb[k]).abs().max().item() / max(scale, 1e-6))
            if k >= len(ga) or k >= len(gb) or ga[k] != gb[k]:
                break
    return worst
