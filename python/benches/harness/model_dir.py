"""A model directory a server loads with ``from_pretrained``, made here: a named shape of
:mod:`harness.models` with random weights (``save_pretrained``, safetensors) and a tokenizer made
with the ``tokenizers`` library over a made-up vocabulary of the model's size, saved beside it.
Nothing is downloaded.

The tokenizer is a word-level one: token ``i`` (from :data:`FIRST_WORD` on) is the word ``t<i>``,
words split on whitespace, no BOS added, so the text ``"t17 t4242 t9"`` is exactly the 3 tokens
``[17, 4242, 9]``: a load generator makes a prompt of any length as text (:func:`prompt_text`).
Special tokens: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (EOS), ``<unk>`` 3 and the chat roles
``<|system|>`` 4, ``<|user|>`` 5, ``<|assistant|>`` 6; the chat template is
``<|role|> content`` per message, then ``<|assistant|>``.

A finished directory holds :data:`MARKER` (what it was made from), written last: a directory
without it (a build that was killed) is not reused, and one made from other settings is
refused rather than overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harness import models

#: the special tokens, by id
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
#: the first id of a plain word (``t<id>``)
FIRST_WORD = len(SPECIALS)
#: the file that says a directory is finished, and what it was made from
MARKER = "vmem-model-dir.json"
#: the chat template (Jinja), as the tokenizer's ``chat_template``
CHAT_TEMPLATE = ("{%- for message in messages -%}<|{{ message['role'] }}|> {{ message['content'] }} "
                 "{% endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
#: the shapes by name: a config builder of :mod:`harness.models` and its full depth
SHAPES = {"llama3-8b": 32, "llama3.2-1b": 16, "qwen2.5-7b": 28, "tiny": 2}
#: dtypes by flag value
DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class ModelSpec:
    """What a model directory is made from: the shape (:data:`SHAPES`), its layers (``None``: the
    shape's full depth), ``tiny`` (the CPU stand-in of the shape, :func:`harness.models.tiny_config`),
    the weights' dtype (:data:`DTYPES`), the seed of the weights and the context length."""

    shape: str
    layers: int | None = None
    tiny: bool = False
    dtype: str = "bf16"
    seed: int = 0
    max_context: int = 8192

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r} (known: {sorted(SHAPES)})")
        if self.layers is not None and not 1 <= self.layers <= 512:
            raise ValueError(f"layers must be in [1, 512], got {self.layers}")
        if self.layers is not None and (self.tiny or self.shape == "tiny"):
            raise ValueError("a tiny stand-in has its own layers: give no layer count")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (known: {DTYPES})")
        if not 16 <= self.max_context <= 1 << 20:
            raise ValueError(f"max_context must be in [16, 1048576], got {self.max_context}")

    @property
    def depth(self) -> int:
        """The layers the model gets (a tiny stand-in: those of :func:`harness.models.tiny_config`)."""
        if self.tiny:
            return int(self.config().num_hidden_layers)
        return self.layers if self.layers is not None else SHAPES[self.shape]

    def config(self) -> Any:
        """The transformers config: :func:`harness.models.tenant_config` of the shape (``tiny``:
        the tiny Llama) with this context."""
        tiny = self.tiny or self.shape == "tiny"
        cfg = models.tenant_config("llama3-8b" if self.shape == "tiny" else self.shape,
                                   self.layers or SHAPES[self.shape], tiny)
        cfg.max_position_embeddings = self.max_context
        return as_llama(cfg) if cfg.model_type == "qwen2" else cfg


def as_llama(cfg: Any) -> Any:
    """Qwen2 config ``cfg``'s shapes on Llama's architecture with q/k/v biases (what Qwen2 adds
    without a sliding window): the same weights, KV and work per token. A directory of model type
    ``qwen2`` gets Qwen2's own tokenizer class from ``AutoTokenizer``, which cannot read the
    made-up word-level tokenizer saved beside it (every prompt would be no tokens)."""
    from transformers import LlamaConfig

    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    return LlamaConfig(attention_bias=True, **{k: getattr(cfg, k) for k in keep})


def torch_dtype(name: str) -> Any:
    """The torch dtype of :data:`DTYPES` name ``name``."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def kv_token_bytes(config: Any, dtype_bytes: int) -> int:
    """Bytes of one token's K and V over every layer of ``config`` (full attention)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def read_marker(path: str) -> dict[str, Any] | None:
    """The marker of the finished model directory ``path``; ``None`` when there is none."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def unusable(spec: ModelSpec, path: str) -> str | None:
    """Why ``path`` cannot take the model of ``spec`` (a finished directory of another spec, or a
    non-empty path that is no finished directory: nothing is overwritten); ``None`` when it can
    (absent, empty, or finished from ``spec``: reused)."""
    have = read_marker(path)
    if have is not None and have.get("spec") != asdict(spec):
        return f"{path} holds a model made from {have.get('spec')}, not {asdict(spec)}: choose another path"
    if have is None and os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        return f"{path} exists and is not a finished model directory: choose another path"
    return None


def make_tokenizer(vocab_size: int, max_context: int) -> Any:
    """The word-level ``PreTrainedTokenizerFast`` of ``vocab_size`` tokens (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= FIRST_WORD:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no word after the {FIRST_WORD} special tokens")
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(FIRST_WORD, vocab_size)})
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE, model_max_length=max_context,
                                   additional_special_tokens=list(SPECIALS[4:]))


def prompt_text(ids: Sequence[int]) -> str:
    """The text that this module's tokenizer turns into exactly ``ids`` (plain words only)."""
    for i in ids:
        if i < FIRST_WORD:
            raise ValueError(f"id {i} is a special token, not a word")
    return " ".join(f"t{i}" for i in ids)


def build(spec: ModelSpec, out: str, device: str, log: Any = None) -> dict[str, Any]:
    """Makes the model directory of ``spec`` at ``out`` (weights built on ``device``), or reuses
    the finished one there made from the same ``spec``. Built in a sibling temporary directory
    renamed into place at the end, so ``out`` is whole or absent. A finished directory of another
    spec, or a non-empty directory that is not one, is a ValueError (nothing is overwritten).
    Returns the marker (with ``reused`` and ``build_s``)."""
    why = unusable(spec, out)
    if why is not None:
        raise ValueError(why)
    have = read_marker(out)
    if have is not None:
        return dict(have, reused=True, build_s=0.0)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        marker = _write(spec, tmp, device, log)
        marker["build_s"] = round(time.perf_counter() - t0, 1)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(marker, reused=False)


def _write(spec: ModelSpec, path: str, device: str, log: Any) -> dict[str, Any]:
    """The weights and tokenizer of ``spec`` written to ``path``; returns the marker."""
    import torch

    cfg = spec.config()
    dtype = torch_dtype(spec.dtype)
    t0 = time.perf_counter()
    model = models.random_model(cfg, dtype, device, seed=spec.seed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    if log:
        log(f"model: {spec.shape}{' (tiny)' if spec.tiny else ''} x {cfg.num_hidden_layers} layers, "
            f"{params / 1e9:.2f} B parameters, built on {device} "
            f"in {t_init:.1f} s; saving")
    t1 = time.perf_counter()
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    make_tokenizer(cfg.vocab_size, spec.max_context).save_pretrained(path)
    t_save = time.perf_counter() - t1
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    if log:
        log(f"model: saved {size / 2**30:.2f} GiB in {t_save:.1f} s")
    return {"spec": asdict(spec), "architecture": type(cfg).__name__, "layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size, "parameters": params, "bytes": size,
            "kv_token_bytes": kv_token_bytes(cfg, dtype.itemsize), "init_s": round(t_init, 1),
            "save_s": round(t_save, 1)}
