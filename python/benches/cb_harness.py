"""Shared by ``python/tests/test_transformers_cb.py`` and ``python/benches/serving_check.py``:
tiny random-weight models of four architectures, built from configs in code (no downloads),
and a teacher-forced logits check of transformers' continuous batching.

How every request's logits are captured through the engine: a forward hook on the model reads
the output logits of each round (the engine passes ``logits_to_keep = logits_indices``, so row
``i`` is the ``i``-th scheduled request with a new token, in ``requests_in_batch`` order). The
engine's own greedy tokens are then fed, whole, to a plain forward with ``DynamicCache`` (sdpa),
whose logits at the same positions are the reference: the engine's logits are teacher-forced on
its own tokens, so no near-tie can make the two runs diverge.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

ARCHS = ("llama-gqa", "qwen2-bias", "mistral", "hd64-tied")


def fake_cpu_memory(total: int = 8 << 30) -> None:
    """On a CPU without psutil the engine sees 0 bytes free and refuses to size its paged cache:
    report ``total`` bytes free instead (tests only; a GPU reports its real memory)."""
    from transformers.generation.continuous_batching import cache as cb_cache

    if getattr(cb_cache.get_device_and_memory_breakdown, "__fake__", False):
        return

    def breakdown() -> Any:
        return torch.device("cpu"), total, 0, 0

    breakdown.__fake__ = True  # type: ignore[attr-defined]
    cb_cache.get_device_and_memory_breakdown = breakdown


def make_config(arch: str, size: str = "tiny") -> Any:
    """A config for ``arch``: ``tiny`` (CPU tests) or ``small`` (the GPU check)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if size == "tiny":
        common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    else:
        # Llama-3-8B's KV shape per layer (8 KV heads of 128: 1,024 tokens per 2 MB page).
        common = dict(vocab_size=4096, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192)
    common.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama-gqa":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2-bias":
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "hd64-tied":
        c = dict(common)
        c["num_attention_heads"] = max(2, c["hidden_size"] // 64)
        c["num_key_value_heads"] = 1 if size == "tiny" else 8
        return LlamaConfig(**c, head_dim=64, tie_word_embeddings=True)
    raise ValueError(f"unknown arch {arch!r} (known: {ARCHS})")


def make_model(arch: str, dtype: torch.dtype, device: str, size: str = "tiny", seed: int = 0,
               logit_scale: float = 1.0) -> Any:
    """A random-weight causal LM; ``logit_scale`` multiplies the output head (decisive logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(arch, size)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if arch == "qwen2-bias":
        with torch.no_grad():  # make the qkv biases matter
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                    p.normal_(0, 0.5)
    if logit_scale != 1.0 and not config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model.to(device=device, dtype=dtype).eval()


def make_prompts(n: int, lengths: List[int], vocab: int, seed: int = 1) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        out.append(torch.randint(3, vocab, (L,), generator=g).tolist())
    return out


class LogitsCapture:
    """A forward hook that files each round's logits under the request they belong to."""

    def __init__(self, model: Any) -> None:
        self.manager: Any = None
        self.logits: Dict[str, List[torch.Tensor]] = {}
        self.rounds = 0
        self.max_running = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self.manager is None or self.manager.batch_processor is None:
            return
        bp = self.manager.batch_processor
        states = [fs for fs in bp.inputs_and_outputs.requests_in_batch if fs.has_new_token]
        logits = output.logits[0].float().cpu()
        self.rounds += 1
        self.max_running = max(self.max_running, len(bp.scheduler.active_requests))
        for i, fs in enumerate(states):
            self.logits.setdefault(fs.state.request_id, []).append(logits[i])

    def remove(self) -> None:
        self.handle.remove()


def run_engine(model: Any, attn: str, prompts: List[List[int]], max_new_tokens: int, *,
               cb_kwargs: Optional[Dict[str, Any]] = None, stagger: Optional[List[int]] = None,
               streaming: bool = False, timeout: float = 600.0) -> Dict[str, Any]:
    """Runs ``prompts`` through the engine with ``attn`` via the manager API, capturing logits.

    ``stagger[i]``: add request ``i`` only after that many results (streamed tokens or finished
    requests) came back, so requests join mid-run. Returns ids, prompts, generated tokens, the
    captured logits, streamed token counts, the cache object and timings."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(attn)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(**(cb_kwargs or {}))
    cap = LogitsCapture(model)
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    cap.manager = mgr
    mgr.start()
    ids: List[Optional[str]] = [None] * len(prompts)
    results: Dict[str, Any] = {}
    streamed: Dict[str, int] = {}
    events = 0
    order = sorted(range(len(prompts)), key=lambda i: (stagger[i] if stagger else 0))
    pos = 0
    t0 = time.perf_counter()
    cache = None
    try:
        while len(results) < len(prompts):
            # Add a request once enough results came back, or when every request added so far
            # has finished (without streaming, finished requests are the only results).
            while pos < len(order) and ((stagger[order[pos]] if stagger else 0) <= events or len(results) == pos):
                i = order[pos]
                ids[i] = mgr.add_request(prompts[i], request_id=f"req{i}", max_new_tokens=max_new_tokens,
                                         streaming=streaming)
                pos += 1
            r = mgr.get_result(timeout=1.0)
            if mgr.batch_processor is not None:
                cache = mgr.batch_processor.cache
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError(f"engine stopped: {mgr.background_thread_status.fatal_error!r}")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError("engine run timed out")
                continue
            events += 1
            if r.error is not None:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            streamed[r.request_id] = streamed.get(r.request_id, 0) + 1
            if r.is_finished():
                results[r.request_id] = r
    finally:
        mgr.stop(block=True, timeout=60)
        cap.remove()
    seconds = time.perf_counter() - t0
    return {
        "ids": ids, "prompts": prompts, "results": results, "logits": cap.logits, "streamed": streamed,
        "cache": cache, "seconds": seconds, "rounds": cap.rounds, "max_running": cap.max_running,
    }


@torch.no_grad()
def reference_logits(model: Any, tokens: List[int]) -> torch.Tensor:
    """Logits of one plain forward over ``tokens`` with a ``DynamicCache`` (sdpa): ``[L, V]``."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    ids = torch.tensor([tokens], device=model.device)
    out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    return out.logits[0].float().cpu()


def compare(run: Dict[str, Any], model: Any, max_new_tokens: int) -> Dict[str, Any]:
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


def cross_compare(a: Dict[str, Any], b: Dict[str, Any]) -> float:
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
