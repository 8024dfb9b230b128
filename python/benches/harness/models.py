"""The one model builder of the benchmarks (random weights, configs made in code: no downloads),
and the configs it builds: Llama-3-8B shapes, a tiny Llama for CPU smoke tests, and the four
architectures of the continuous-batching correctness checks.

Hub kernels are pinned off (``USE_HUB_KERNELS=NO``, set when this module is imported, before any
model is made): transformers 5.25 replaces layers of a ``from_pretrained`` model with kernels from
the Hub by default (``use_kernels``), and a bench must run vmem and the engine on the same
non-attention code. Models built here (``from_config``) are never kernelized either."""

from __future__ import annotations

import os
from typing import Any

os.environ["USE_HUB_KERNELS"] = "NO"

#: the checks' architectures: Llama GQA, Qwen2 with qkv bias, Mistral, head dim 64 with tied embeddings
ARCHS = ("llama-gqa", "qwen2-bias", "mistral", "hd64-tied")

#: no BOS, EOS or PAD id (the engine then stops a request only at its token limit)
NO_TOKENS = (None, None, None)
#: BOS 1, EOS 2, PAD 0
SERVING_TOKENS = (1, 2, 0)
#: LlamaConfig's own: BOS 1, EOS 2, no PAD (the decode benches' generate())
LLAMA_TOKENS = (1, 2, None)


def llama3_8b_config(layers: int = 8, vocab: int = 128256, max_position_embeddings: int = 131072,
                     tokens: tuple[int | None, int | None, int | None] = NO_TOKENS) -> Any:
    """Llama-3-8B shapes (32 query heads, 8 KV heads of 128, MLP 14,336, rope theta 500,000) with
    ``layers`` layers, ``vocab`` tokens and ``tokens`` = (BOS, EOS, PAD) ids."""
    from transformers import LlamaConfig

    bos, eos, pad = tokens
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=vocab, num_hidden_layers=layers,
                       rope_theta=500000.0, max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def llama32_1b_config(layers: int = 16, vocab: int = 128256, max_position_embeddings: int = 131072,
                      tokens: tuple[int | None, int | None, int | None] = NO_TOKENS) -> Any:
    """Llama-3.2-1B shapes (hidden 2,048, 32 query heads, 8 KV heads of 64, MLP 8,192, tied
    embeddings, rope theta 500,000) with ``layers`` layers (16: its full depth)."""
    from transformers import LlamaConfig

    bos, eos, pad = tokens
    return LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       intermediate_size=8192, vocab_size=vocab, num_hidden_layers=layers,
                       rope_theta=500000.0, max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-5, tie_word_embeddings=True,
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def tiny_llama_config(tokens: tuple[int | None, int | None, int | None] = SERVING_TOKENS) -> Any:
    """A 2-layer Llama (hidden 128, 4 query heads, 2 KV heads of 32, vocab 256): CPU smoke tests."""
    from transformers import LlamaConfig

    bos, eos, pad = tokens
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def check_config(arch: str, size: str = "tiny") -> Any:
    """A config of one of :data:`ARCHS`: ``tiny`` (CPU tests) or ``small`` (the GPU check).
    An unknown ``arch`` is a ValueError."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if size == "tiny":
        common = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    else:
        # Llama-3-8B's KV shape per layer (8 KV heads of 128: 1,024 tokens per 2 MB page).
        common = {"vocab_size": 4096, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
                      "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 8192}
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


def random_model(config: Any, dtype: Any, device: Any, seed: int = 0, attn: str = "sdpa") -> Any:
    """A causal LM of ``config`` with random weights (``torch.manual_seed(seed)``), built on
    ``device`` in ``dtype`` with attention ``attn``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if getattr(model, "use_kernels", False):  # 5.25+: hub kernels pinned off (see the module doc)
        raise RuntimeError("the model was kernelized with hub kernels; the benches run without them")
    return model.eval()


def check_model(arch: str, dtype: Any, device: Any, size: str = "tiny", seed: int = 0,
                logit_scale: float = 1.0) -> Any:
    """A model of :func:`check_config` for the correctness checks: built in float32 on the CPU,
    qkv biases made to matter (Qwen2), the output head times ``logit_scale`` (decisive logits),
    then moved to ``device`` and ``dtype``."""
    import torch

    config = check_config(arch, size)
    model = random_model(config, torch.float32, "cpu", seed)
    with torch.no_grad():
        if arch == "qwen2-bias":
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                    p.normal_(0, 0.5)
        if logit_scale != 1.0 and not config.tie_word_embeddings:
            model.lm_head.weight.mul_(logit_scale)
    return model.to(device=device, dtype=dtype).eval()


def qwen25_7b_config(layers: int = 8, max_position_embeddings: int = 32768,
                     tokens: tuple[int | None, int | None, int | None] = SERVING_TOKENS) -> Any:
    """Qwen2.5-7B shapes (hidden 3,584, 28 query heads, 4 KV heads of 128, qkv bias, MLP 18,944,
    vocab 152,064) with ``layers`` layers."""
    from transformers import Qwen2Config

    bos, eos, pad = tokens
    return Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, num_hidden_layers=layers,
                       rope_theta=1000000.0, max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def tiny_config(shape: str, tokens: tuple[int | None, int | None, int | None] = SERVING_TOKENS) -> Any:
    """A tiny CPU stand-in of one of :data:`TENANT_SHAPES` (vocab 256, 2-4 layers, KV heads and
    head dims that differ as the real shapes' do; a token's K and V of every layer divide 64 KiB)."""
    from transformers import LlamaConfig, Qwen2Config

    bos, eos, pad = tokens
    common = {"vocab_size": 256, "max_position_embeddings": 2048, "bos_token_id": bos, "eos_token_id": eos,
              "pad_token_id": pad}
    if shape == "llama3-8b":
        return tiny_llama_config(tokens)
    if shape == "llama3.2-1b":
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **common)
    if shape == "qwen2.5-7b":
        return Qwen2Config(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
                           num_key_value_heads=1, use_sliding_window=False, **common)
    raise ValueError(f"unknown shape {shape!r} (known: {TENANT_SHAPES})")


#: the multi-tenant bench's model shapes (random weights, each with its own layer count)
TENANT_SHAPES = ("llama3-8b", "llama3.2-1b", "qwen2.5-7b")


def tenant_config(shape: str, layers: int, tiny: bool = False) -> Any:
    """The config of tenant shape ``shape`` (:data:`TENANT_SHAPES`) with ``layers`` layers, or
    with ``tiny`` its CPU stand-in (:func:`tiny_config`; ``layers`` ignored). Serving tokens
    (BOS 1, EOS 2, PAD 0), context 8,192. An unknown shape is a ValueError."""
    if tiny:
        return tiny_config(shape)
    if shape == "llama3-8b":
        return llama3_8b_config(layers, max_position_embeddings=8192, tokens=SERVING_TOKENS)
    if shape == "llama3.2-1b":
        return llama32_1b_config(layers, max_position_embeddings=8192, tokens=SERVING_TOKENS)
    if shape == "qwen2.5-7b":
        return qwen25_7b_config(layers, max_position_embeddings=8192)
    raise ValueError(f"unknown shape {shape!r} (known: {TENANT_SHAPES})")
