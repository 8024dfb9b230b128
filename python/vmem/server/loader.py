"""Loading one served model: its config and vmem options checked first (:func:`check`, nothing
loaded: a bad option is a usage error in a moment), then the tokenizer, the weights on vmem's
cache (``attn_implementation="vmem"``, the hub's kernels off) and the continuous-batching manager,
warmed up and started (:func:`load`).

The manager runs greedy argmax (``do_sample=False``) with the server's per-request sampling
processors in front of it (:mod:`.sampling`); CUDA graphs and async batching are on for CUDA
unless the options say otherwise; the engine's own request queue is unbounded (the server bounds
admission itself).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Dict

from .options import ModelSpec, ServerOptions


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A loaded model: ``tokenizer``, ``model``, the started ``manager``, the ``vocab`` size (ids
    past it are refused), ``max_context`` (tokens a request may hold), ``eos`` (id or ids, -1:
    none) and the sampling defaults (the model's generation config's, else 1)."""

    tokenizer: Any
    model: Any
    manager: Any
    vocab: int
    max_context: int
    eos: Any
    default_temperature: float
    default_top_p: float


def check(opts: ServerOptions, spec: ModelSpec) -> Dict[str, Any]:
    """What can be checked before loading the weights: the model's config (its context) and
    the vmem cache's options, returned checked (:class:`vmem.InvalidArgument` otherwise, a
    usage error). A path that holds no model is an ``OSError`` (transformers')."""
    from transformers import AutoConfig

    import vmem.transformers as vt
    from vmem.pool import Join

    from .._vmem import InvalidArgument

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=opts.trust_remote_code)
    longest = getattr(config.get_text_config(), "max_position_embeddings", None)
    if opts.max_context is None and not longest:
        raise InvalidArgument(f"the config of {spec.path} gives no max_position_embeddings: give --max-context")
    if opts.max_context is not None and longest and opts.max_context > longest:
        raise InvalidArgument(f"--max-context {opts.max_context} is past the model's max_position_embeddings "
                              f"({longest}): its positions were never trained there")
    context = opts.max_context or int(longest or 0)
    chosen: Dict[str, Any] = {"page_size": opts.page_size, "layout": opts.layout, "kernel": opts.kernel,
                              "max_requests": opts.max_requests, "max_context": context, "memory": opts.memory}
    if opts.pool_ledger is not None:
        chosen["pool"] = Join(spec.name, limit=spec.limit, floor=spec.floor, ledger=opts.pool_ledger)
    known = set(vt.Options.names())
    for name, value in opts.vmem_options:
        if name not in known or name in ("pool",):
            raise InvalidArgument(f"--vmem-option {name}: not an option of vmem.transformers.Options "
                                  f"(known: {', '.join(sorted(known - {'pool'}))})")
        chosen[name] = value
    vt.Options(**chosen)  # checked now, before any weight is read
    return chosen


def load(opts: ServerOptions, spec: ModelSpec, vmem_options: Dict[str, Any]) -> Loaded:
    """Loads the tokenizer and the model on vmem's cache (``vmem_options``: from :func:`check`),
    and starts its continuous-batching manager (warmed up: CUDA graphs captured), with the
    server's sampling processors (``--sampling full``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    import vmem.transformers as vt

    from .sampling import SamplingProcessors

    device = opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    on_cuda = device.startswith("cuda")
    for flag, value in (("--cuda-graphs", opts.cuda_graphs), ("--async-batching", opts.async_batching)):
        if value == "on" and not on_cuda:
            raise ValueError(f"{flag} on needs a CUDA device (the model runs on {device})")
    dtype: Any = "auto" if opts.dtype == "auto" else getattr(torch, opts.dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=opts.trust_remote_code)
    vt.install(**vmem_options)
    placed: Dict[str, Any] = {}
    if importlib.util.find_spec("accelerate") is not None:  # loads the weights straight onto the device
        placed["device_map"] = device
    model: Any = AutoModelForCausalLM.from_pretrained(
        spec.path, attn_implementation="vmem", dtype=dtype, use_kernels=False,
        trust_remote_code=opts.trust_remote_code, **placed)
    if not placed:
        model = model.to(device)
    if not on_cuda and model.dtype in (torch.float16, torch.bfloat16) and opts.dtype == "auto":
        model = model.to(torch.float32)  # half precision on the CPU: slow, and not every op has it
    model.eval()
    max_context = int(vmem_options["max_context"])
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos = eos if eos is not None else -1
    pad = gen.pad_token_id if gen.pad_token_id is not None else (tokenizer.pad_token_id or 0)
    temperature = top_p = 1.0
    if gen.do_sample:  # the model's own sampling defaults, as vLLM takes them
        temperature = float(gen.temperature if gen.temperature is not None else 1.0)
        top_p = float(gen.top_p if gen.top_p is not None else 1.0)
    cb: Dict[str, Any] = {"allow_block_sharing": opts.prefix_caching, "max_queue_size": 0,
                          "use_cuda_graph": on_cuda if opts.cuda_graphs == "auto" else opts.cuda_graphs == "on",
                          "use_async_batching": (on_cuda if opts.async_batching == "auto"
                                                 else opts.async_batching == "on")}
    if opts.max_batch_tokens is not None:
        cb["max_batch_tokens"] = opts.max_batch_tokens
    if opts.sampling == "full":  # the engine's share of free memory when logits processors run (it
        cb["max_memory_percent"] = 0.8  # decides before the server installs its own)
    config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad,
                              max_new_tokens=max_context)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=ContinuousBatchingConfig(**cb))
    if opts.sampling == "full":
        manager.logit_processor = SamplingProcessors()
    manager.warmup()
    manager.start()
    vocab = int(model.get_input_embeddings().num_embeddings)
    return Loaded(tokenizer=tokenizer, model=model, manager=manager, vocab=vocab, max_context=max_context, eos=eos,
                  default_temperature=temperature, default_top_p=top_p)
