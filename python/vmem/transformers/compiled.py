"""What vmem's engine cache supports of the engine's compiled forward (``varlen_compile_config``,
``decode_compile_config``). Version-free.

The engine compiles its ``_forward_process_and_sample`` with ``torch.compile`` and, with
``use_cuda_graph``, captures the compiled forward in its CUDA graphs. vmem's attention
(:func:`~vmem.transformers.attention.paged_attention`) is ``torch.compiler.disable``-d, as the
engine's own paged attention is: Dynamo compiles the layers around it (norms, RoPE, the MLP's
elementwise work fused by Inductor) and calls it eagerly, so each round is read from the cache's
state, never baked into the compiled code. :func:`check_compile` refuses, when the cache is
built, what cannot work that way, saying what to pass instead; :func:`refuse_compile` refuses
any compiled forward, for a cache (a bench contender) whose attention is traced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._vmem import InvalidArgument

if TYPE_CHECKING:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig


def refuse_compile(cb: ContinuousBatchingConfig, name: str) -> None:
    """Refuses a compiled forward for a cache whose attention reads its round from Python state
    inside the traced forward (a bench contender), which ``torch.compile`` would bake in as
    constants of the first round."""
    if _compile_configs(cb):
        raise InvalidArgument(
            f"{name}: compiling the engine's forward (varlen_compile_config / decode_compile_config) is not "
            "supported: the attention reads each round from state the cache keeps on the host, which torch.compile "
            "would bake in as constants of the first round; use use_cuda_graph=True (graphs without compile)"
        )


def _compile_configs(cb: ContinuousBatchingConfig) -> list[Any]:
    """The engine's compile configs that are set (varlen, decode)."""
    return [c for c in (getattr(cb, "varlen_compile_config", None), getattr(cb, "decode_compile_config", None))
            if c is not None]


def check_compile(cb: ContinuousBatchingConfig, name: str, kernel: str) -> None:
    """What vmem's cache supports of a compiled forward (the engine's ``varlen_compile_config`` or
    ``decode_compile_config``): Dynamo compiles the model's layers around vmem's attention, which
    it leaves out (:func:`~vmem.transformers.attention.paged_attention` is
    ``torch.compiler.disable``-d), so the round is read from the cache's state each call. Refused,
    saying what to pass: a config that is not a ``CompileConfig``; ``fullgraph=True`` (the
    attention is a graph break); a mode that turns on
    Inductor's own CUDA graphs (``"reduce-overhead"``, CompileConfig's default, ``"max-autotune"``:
    the engine's ``use_cuda_graph`` captures the whole forward instead); ``kernel="flex"`` (its
    kernel is a compiled Flex called inside the attention the forward leaves out: not verified)."""
    for config in _compile_configs(cb):
        if not callable(getattr(config, "to_dict", None)):
            raise InvalidArgument(
                f"{name}: a compile config must be a transformers.CompileConfig, not {type(config).__name__} "
                f"({config!r}); pass CompileConfig(fullgraph=False, mode='default')"
            )
        if kernel == "flex":
            raise InvalidArgument(
                f"{name}: compiling the engine's forward with kernel='flex' is not supported (Flex is compiled "
                "on its own inside the attention); use kernel='fa', kernel='flashinfer' or kernel='fa+flashinfer', "
                "or leave varlen_compile_config and decode_compile_config unset"
            )
        if getattr(config, "fullgraph", False):
            raise InvalidArgument(
                f"{name}: a compile config with fullgraph=True cannot compile the forward: vmem's attention is "
                "left out of the graph (as the engine's own paged attention is); pass "
                "CompileConfig(fullgraph=False, mode='default') as varlen_compile_config"
            )
        if _uses_inductor_graphs(config):
            raise InvalidArgument(
                f"{name}: compile mode {getattr(config, 'mode', None)!r} turns on Inductor's CUDA graphs; pass "
                "mode='default' or 'max-autotune-no-cudagraphs' and use_cuda_graph=True (the engine's CUDA graphs "
                "capture the whole forward, vmem's attention included)"
            )


def _uses_inductor_graphs(config: Any) -> bool:
    """Whether compile ``config`` turns on Inductor's CUDA graphs (its mode's options, or its own)."""
    if getattr(config, "backend", "inductor") != "inductor":
        return False
    options = dict(getattr(config, "options", None) or {})
    mode = getattr(config, "mode", None)
    if mode is not None:
        import torch._inductor

        options = {**torch._inductor.list_mode_options().get(mode, {}), **options}
    return bool(options.get("triton.cudagraphs", False))
