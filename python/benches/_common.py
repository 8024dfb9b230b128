"""Shared pieces of the serving benchmarks (issue #23): trace loading, model building, metrics.

Used by ``cb_baseline.py`` (transformers' own continuous batching) and meant for the vmem
serving contenders, so every contender sees the same requests, weights and metric code.
"""
from __future__ import annotations

import csv
import os
import random
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

#: the Azure conversation trace (first 2,000 requests), relative to the repository root
DEFAULT_TRACE = "vmem-cli/data/traces/azure-conv-2023-first2000.csv"


def repo_root() -> str:
    """The repository root (this file is python/benches/_common.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Request:
    """One trace request: prompt token ids and the trace's own lengths."""

    index: int
    prompt_ids: List[int]
    trace_context: int
    trace_generated: int


def load_trace(path: Optional[str] = None, n: int = 256, cap: int = 4000, vocab: int = 128256,
               seed: int = 0) -> List[Request]:
    """The first ``n`` requests of an Azure trace CSV (columns TIMESTAMP, ContextTokens,
    GeneratedTokens). Prompt lengths are ``min(ContextTokens, cap)`` (at least 1); prompt token
    ids are drawn uniformly from ``[0, vocab)`` with a fixed ``seed`` (the same ids for every
    contender). Raises ValueError on a malformed file or fewer than ``n`` rows."""
    path = path or os.path.join(repo_root(), DEFAULT_TRACE)
    rng = random.Random(seed)
    out: List[Request] = []
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        missing = {"ContextTokens", "GeneratedTokens"} - set(rows.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)} (has {rows.fieldnames})")
        for i, row in enumerate(rows):
            if len(out) >= n:
                break
            try:
                ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: row {i + 2}: {e}") from e
            length = max(1, min(ctx, cap))
            ids = [rng.randrange(vocab) for _ in range(length)]
            out.append(Request(i, ids, ctx, gen))
    if len(out) < n:
        raise ValueError(f"{path}: {len(out)} requests, {n} asked")
    return out


def llama3_8b_config(layers: int = 8, tiny: bool = False) -> Any:
    """Llama-3-8B shapes with ``layers`` layers (or a small 2-layer model with ``tiny``)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, vocab_size=1024,
                           num_hidden_layers=2, rope_theta=500000.0, max_position_embeddings=8192,
                           eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=14336, vocab_size=128256,
                       num_hidden_layers=layers, rope_theta=500000.0, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       eos_token_id=None, bos_token_id=None, pad_token_id=None)


def build_model(kind: str = "llama-3-8b", layers: int = 8, dtype: Any = None, device: Any = None,
                attn_implementation: str = "sdpa", seed: int = 0) -> Any:
    """A Llama model with random weights (``torch.manual_seed(seed)``), built directly on
    ``device`` in ``dtype`` (default bf16, CUDA if available). ``kind``: ``"llama-3-8b"``
    (Llama-3-8B shapes, ``layers`` layers) or ``"tiny"`` (2 layers, hidden 256)."""
    import torch
    from transformers import LlamaForCausalLM

    if kind not in ("llama-3-8b", "tiny"):
        raise ValueError(f"unknown model kind {kind!r} (llama-3-8b, tiny)")
    dtype = dtype or torch.bfloat16
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = llama3_8b_config(layers, tiny=(kind == "tiny"))
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in [0, 100]); NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def serving_metrics(t_start: float, created: Sequence[float], token_times: Sequence[Sequence[float]],
                    expected_tokens: Optional[int] = None) -> Dict[str, Any]:
    """Metrics from per-request token timestamps (seconds, one clock).

    ``t_start``: when the first request was submitted; ``created[i]``: when request i was
    submitted; ``token_times[i]``: the time each of its generated tokens was produced.
    Returns generated tokens, makespan, tok/s (tokens / (last token - t_start)), TTFT
    p50/p99/mean (first token - submission), TBT p50/p99/mean (gaps between consecutive
    tokens of one request, pooled over requests), and how many requests did not produce
    ``expected_tokens``."""
    if len(created) != len(token_times):
        raise ValueError("created and token_times differ in length")
    ttft, tbt = [], []
    total = 0
    last = t_start
    short = 0
    for c, ts in zip(created, token_times):
        total += len(ts)
        if expected_tokens is not None and len(ts) != expected_tokens:
            short += 1
        if not ts:
            continue
        ttft.append(ts[0] - c)
        tbt.extend(b - a for a, b in zip(ts, ts[1:]))
        last = max(last, ts[-1])
    span = last - t_start
    return {
        "requests": len(created),
        "generated_tokens": total,
        "makespan_s": span,
        "tok_per_s": total / span if span > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": statistics.mean(ttft) if ttft else float("nan"),
        "tbt_p50_ms": percentile(tbt, 50) * 1e3, "tbt_p99_ms": percentile(tbt, 99) * 1e3,
        "tbt_mean_ms": statistics.mean(tbt) * 1e3 if tbt else float("nan"),
        "requests_wrong_token_count": short,
    }


def fmt_table(rows: List[Dict[str, Any]], cols: List[str]) -> str:
    """A fixed-width text table of ``rows`` over ``cols`` (floats with 3 significant-ish digits)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return str(v)
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in cols]
    lines = [" ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines.append("-" * len(lines[0]))
    for r in rows:
        lines.append(" ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)
