"""The serving suite's roofline: a lower bound on a workload's wall time that no contender's
scheduling can beat, and the two device peaks it is measured against (both measured in the
run that uses them).

The bound (docs/serving.md, "The serving suite"): every prompt's prefill FLOPs at the bf16
matmul peak, plus the bytes the decode steps must read at the copy bandwidth. Prefill FLOPs
of a prompt of ``n`` tokens: ``2 x n x`` the non-embedding matmul parameters of the layers,
``2 x hidden x vocab`` for the first token's logits, and the causal attention
``2 x layers x heads x head_dim x n x (n + 1)`` (``QK^T`` and ``PV`` over the ``n (n + 1) / 2``
query-key pairs). Decode: each request's generated tokens after the first (the prefill makes
the first) are decode tokens; decode token ``j`` of a request with prompt ``n`` reads the K/V of
``n + j`` tokens. The KV bytes read are therefore fixed by the workload; the weight bytes are
``steps x`` the matmul weights (layers and LM head), and the steps are the fewest any schedule
could take: at least the longest request's decode tokens, the decode tokens over
``max_batch_tokens``, and the KV token-steps over the budget in tokens (each step holds at most
the budget). A sum, as the issue defines it: a schedule that overlapped prefill compute with
decode reads in one step could in principle come under it.

Only the formula imports nothing; :func:`measure_peaks` imports torch."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs of a decoder-only model: layer count and widths, vocabulary, bytes
    per weight or KV element."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    itemsize: int

    def __post_init__(self) -> None:
        for k, v in vars(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelShape.{k} must be an integer of at least 1, got {v!r}")

    @classmethod
    def from_config(cls, config: Any, itemsize: int) -> ModelShape:
        """The shape of a transformers Llama-like ``config`` (``head_dim`` from the config, else
        ``hidden_size // num_attention_heads``) with ``itemsize`` bytes per element."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size,
                   intermediate=config.intermediate_size, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=head_dim, vocab=config.vocab_size,
                   itemsize=itemsize)

    @property
    def layer_matmul_params(self) -> int:
        """One layer's matmul weights: q, k, v, o projections and the gated MLP's three."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        """The LM head's weights (``hidden x vocab``)."""
        return self.hidden * self.vocab

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's matmuls and the LM head."""
        return (self.layers * self.layer_matmul_params + self.head_params) * self.itemsize

    @property
    def token_kv_bytes(self) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class Peaks:
    """The device's measured peaks: bf16 (or the run's dtype) matmul FLOP/s and copy bytes/s
    (read + write)."""

    matmul_flops: float
    copy_bytes: float

    def __post_init__(self) -> None:
        for k, v in vars(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Peaks.{k} must be a finite number above 0, got {v!r}")


@dataclass(frozen=True)
class Workload:
    """What a run serves: prompt lengths, new tokens per request, the KV budget in tokens and
    the engine's ``max_batch_tokens``."""

    prompt_lens: tuple[int, ...]
    new_tokens: int
    budget_tokens: int
    max_batch_tokens: int

    def __post_init__(self) -> None:
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError(f"a workload needs prompts of at least 1 token, got {list(self.prompt_lens)[:8]}")
        for k in ("new_tokens", "budget_tokens", "max_batch_tokens"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Workload.{k} must be an integer of at least 1, got {v!r}")


def prefill_flops(shape: ModelShape, prompt_lens: Sequence[int]) -> int:
    """FLOPs of every prompt's prefill: layer matmuls per token, the first token's logits, causal
    attention."""
    total = 0
    for n in prompt_lens:
        total += 2 * n * shape.layers * shape.layer_matmul_params + 2 * shape.head_params
        total += 2 * shape.layers * shape.heads * shape.head_dim * n * (n + 1)
    return total


def decode_tokens(w: Workload) -> int:
    """Tokens the decode steps make: every request's new tokens but the first."""
    return len(w.prompt_lens) * (w.new_tokens - 1)


def kv_token_reads(w: Workload) -> int:
    """K/V tokens the decode steps read (also the token-steps of KV they hold): decode token
    ``j`` (1 to ``new_tokens - 1``) of a request with prompt ``n`` reads ``n + j``."""
    d = w.new_tokens - 1
    return sum(d * n for n in w.prompt_lens) + len(w.prompt_lens) * d * (d + 1) // 2


def decode_steps(w: Workload) -> int:
    """The fewest decode steps any schedule takes: the longest request's decode tokens, the
    decode tokens over ``max_batch_tokens``, the KV token-steps over the budget (rounded up)."""
    if w.new_tokens == 1:
        return 0
    return max(w.new_tokens - 1, -(-decode_tokens(w) // w.max_batch_tokens),
               -(-kv_token_reads(w) // w.budget_tokens))


def lower_bound(shape: ModelShape, w: Workload, peaks: Peaks) -> dict[str, float]:
    """The bound's parts (seconds, FLOPs, bytes, steps) and ``bound_s``, their sum."""
    flops = prefill_flops(shape, w.prompt_lens)
    steps = decode_steps(w)
    weight = steps * shape.decode_weight_bytes
    kv = kv_token_reads(w) * shape.token_kv_bytes
    prefill_s = flops / peaks.matmul_flops
    decode_s = (weight + kv) / peaks.copy_bytes
    return {"prefill_flops": float(flops), "prefill_s": prefill_s, "decode_steps": float(steps),
            "weight_bytes": float(weight), "kv_read_bytes": float(kv), "decode_s": decode_s,
            "bound_s": prefill_s + decode_s}


def measure_peaks(device: str, dtype: Any, n: int = 8192, copy_mib: int = 2048, reps: int = 10) -> Peaks:
    """The best of ``reps`` timed ``n x n`` matmuls of ``dtype`` (``2 n^3`` FLOPs each) and of
    ``reps`` copies of a ``copy_mib`` MiB tensor (read + write bytes), on ``device``, after one
    untimed of each. CUDA events time the GPU; the CPU is timed by the wall clock."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    src = torch.empty(copy_mib << 20, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    mm = _best(lambda: torch.mm(a, b, out=out), device, reps)
    cp = _best(lambda: dst.copy_(src), device, reps)
    return Peaks(matmul_flops=2 * n**3 / mm, copy_bytes=2 * (copy_mib << 20) / cp)


def _best(fn: Any, device: str, reps: int) -> float:
    """The shortest of ``reps`` timed calls of ``fn`` (seconds), after one untimed."""
    fn()
    cuda = str(device).startswith("cuda")
    return min(timed_call(fn, cuda) for _ in range(reps))


def timed_call(fn: Any, cuda: bool) -> float:
    """Seconds one call of ``fn`` takes: between CUDA events on CUDA (the GPU's time), by the
    wall clock on the CPU."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
