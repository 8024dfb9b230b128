"""``host_cost.py``: the host time vmem adds per engine round, measured on the CPU (issue #32).

The real engine (transformers' continuous batching) serves a tiny random model on the CPU with
the shapes that set the host work (``8b-x8``: 8 layers, head dim 128; ``1b-x16``: 16 layers, head
dim 64) under two contenders interleaved in one process: the engine's own paged cache
(``paged|sdpa`` on 5.17, ``sdpa`` on 5.19+, 256-token blocks) and vmem's (``vmem-token-major``
by default, host backend: the same Python and Rust as on the GPU, pages in host memory). The
KV has 1 head where the real shapes have 8, with pages of 256 KB where they have 2 MB: a page
holds as many tokens (64 token-major, 1,024 or 2,048 per-layer), so the mapping work per token
is the real one, at an eighth of the memory. Hidden size 256 and vocab 512 keep the CPU's
matmuls small; what the forward costs here is not the GPU's. ``--device cuda`` runs the same on a
GPU with the real 8 KV heads and 2 MB pages (FlashAttention's kernel for vmem): there the plain
runs' round wall time is the measure (the ``cpu.`` names are then kernel launches, whose host
time counts).

A run serves ``batch`` requests (prompts of ``prompt_min``-``prompt_max`` tokens, random, seed
0; ``new_tokens`` each): prefill rounds, then decode rounds of all ``batch`` requests, then the
tail. :mod:`harness.hostclock` charges every round's time to the hooks (exclusive times).
Two runs per contender and repeat: ``plain`` (the round clock only: the rounds' wall time)
and ``hooks`` (every hook timed: where the time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import random
from typing import Any

import torch

from harness import contenders as cont
from harness.engine import fake_cpu_memory, run_engine
from harness.hostclock import HookClock

#: The shapes: name -> (layers, head dim).
SHAPES = {"8b-x8": (8, 128), "1b-x16": (16, 64)}
#: Per device: (KV heads, vmem page size). On the CPU 1 KV head and 256 KB pages (a page holds the
#: tokens a 2 MB page holds at the real shapes' 8 heads: an eighth of the memory); on CUDA the real
#: ones (its backend maps 2 MB pages only).
GEOMETRY = {"cpu": (1, "256K"), "cuda": (8, "2M")}
MAX_CONTEXT = 1024

#: vmem's hooks, by class attribute (the cache, its reader, its round buffers) and by module function.
VMEM_METHODS = ("get_num_free_blocks", "will_allocation_be_successful", "allocate_blocks", "free_blocks",
                "extend_read_and_write_indices", "get_seqlens_k", "flush", "distinct_mapped_bytes",
                "search_prefix_match", "mark_shareable_blocks_as_complete")
VMEM_FUNCTIONS = {"Tenant": ("budget_blocks", "yield_room", "on_round", "step"), "graphs": ("prepare_round",)}
#: Tensor ops vmem's hooks and the engine's cache call: one kernel launch each on the GPU (on the CPU
#: the kernel itself runs in the call: charged as a kernel, counted as a launch).
TENSOR_OPS = ("index_copy_", "zero_", "index_fill_", "copy_")
#: The engine's own paged cache's hooks.
NATIVE_METHODS = ("get_num_free_blocks", "allocate_blocks", "free_blocks", "extend_read_and_write_indices",
                  "get_seqlens_k", "update", "search_prefix_match", "mark_shareable_blocks_as_complete")


def tiny_model(shape: str, device: str = "cpu") -> Any:
    """A random bf16 Llama of ``shape``'s layers and head dim on ``device`` (its KV heads:
    :data:`GEOMETRY`), 4 query heads per KV head, hidden 256, vocab 512."""
    from transformers import LlamaConfig

    from harness.models import random_model

    layers, head_dim = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4 * GEOMETRY[device][0], num_key_value_heads=GEOMETRY[device][0],
                      head_dim=head_dim,
                      max_position_embeddings=2 * MAX_CONTEXT, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    return random_model(cfg, torch.bfloat16, device)


def prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``lo``-``hi`` random tokens (seed 0)."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def native_name() -> str:
    """The engine's own paged contender on the running transformers version."""
    return "paged-sdpa-256" if cont.family() == cont.V517 else "sdpa-256"


def _attention_wrap(clock: HookClock, attn: str, name: str) -> None:
    """Times the attention function registered under ``attn`` (re-registered; restored after)."""
    from transformers import AttentionInterface

    bare = attn.removeprefix("paged|")
    keys = [k for k in (bare, f"paged|{bare}") if k in AttentionInterface._global_mapping]
    for key in keys:
        original = AttentionInterface._global_mapping[key]
        AttentionInterface.register(key, clock.timed(original, name))
        clock.on_restore(lambda key=key, fn=original: AttentionInterface.register(key, fn))


def instrument(clock: HookClock, model: Any, hooks: bool, vmem_attn: str, native_attn: str) -> None:
    """The round clock, and with ``hooks`` every hook of both caches, the engine's loop parts and
    the model's forward."""
    api = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    runner = importlib.import_module("transformers.generation.continuous_batching.model_runner").ModelRunner
    if hooks:
        import vmem.transformers as vt
        from vmem.kernels import buffers, fa
        from vmem.transformers import graphs, tenancy

        clock.wrap(api.ContinuousBatchProcessor, "prepare_next_batch", "engine.prepare")
        clock.wrap(api.ContinuousBatchProcessor, "update_batch", "engine.update")
        clock.wrap(runner, "compute_batch", "engine.compute")
        clock.wrap(model, "forward", "cpu.forward")
        for op in TENSOR_OPS:
            clock.wrap(torch.Tensor, op, f"cpu.{op}")
        clock.wrap_all(vt.cache_class(), [(m, f"vmem.{m}") for m in VMEM_METHODS])
        for mod, fns in ((tenancy.Tenant, VMEM_FUNCTIONS["Tenant"]), (graphs, VMEM_FUNCTIONS["graphs"])):
            clock.wrap_all(mod, [(f, f"vmem.{f}") for f in fns])
        clock.wrap(buffers.RoundBuffers, "fill", "vmem.RoundBuffers.fill")
        clock.wrap(fa.FaReader, "__call__", "vmem.reader")
        clock.wrap(fa, "fa_varlen_reference", "cpu.fa_reference")
        clock.wrap(torch, "index_select", "cpu.index_select")
        _attention_wrap(clock, vmem_attn, "vmem.attention")
        native_cls = importlib.import_module("transformers.generation.continuous_batching.cache").PagedAttentionCache
        clock.wrap_all(native_cls, [(m, f"native.{m}") for m in NATIVE_METHODS])
        _attention_wrap(clock, native_attn, "cpu.native_attention")
    clock.wrap_rounds(api.ContinuousBatchProcessor, runner)


def run_one(model: Any, name: str, batch: int, args: Any, mode: str, profile: bool = False) -> dict[str, Any]:
    """One run of contender ``name`` at ``batch`` requests; ``mode`` ``plain`` or ``hooks``.
    Returns the rounds the clock filed, and with ``profile`` the engine thread's cProfile text."""
    import vmem.transformers as vt

    spec = cont.spec(name)
    cfg = model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    # Every request fits one 256-token block; a quarter more lets the engine's safety margin (0.15 of its
    # blocks free before it admits a prompt) admit the whole batch.
    budget = {"kv_bytes": token_bytes * 256 * (batch + batch // 4 + 2), "token_bytes": token_bytes}
    page = GEOMETRY[model.device.type][1]
    ns = argparse.Namespace(max_requests=batch, page_size=page, max_context=MAX_CONTEXT)
    kw, opts = cont.contender_config(model, spec, ns, budget)
    kw.update(max_batch_tokens=args.max_batch_tokens)
    ps = prompts(batch, args.prompt_min, args.prompt_max, model.config.vocab_size)
    vt.install()  # the engine patch first: the clock wraps what the engine will call
    clock = HookClock()
    prof = cProfile.Profile() if profile else None
    with clock:
        instrument(clock, model, mode == "hooks", cont.VMEM_ATTENTION, native_attn_name())
        if prof is not None:
            _profile_loop(clock, prof)
        run = run_engine(model, spec["attn"], ps, args.new_tokens, cb_kwargs=kw, serving=opts or None,
                         name=name, timeout=args.timeout)
        clock.close_round()
    out = {"contender": name, "batch": batch, "mode": mode, "rounds": clock.rounds, "wall_s": run["wall_s"],
           "completed": len(run["results"])}
    if prof is not None:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
        s.write("== vmem's code and the engine's scheduling and batch preparation (host work; the "
                "kernels' CPU stand-ins excluded), by own time:\n")
        stats.print_stats(r"vmem/(?!kernels/fa\.py:\d+\(fa_varlen_reference)|continuous_batching/|_vmem",
                          args.profile_top)
        s.write("\n== everything, by own time (the CPU kernels first: FA's CPU reference, the model's ops):\n")
        stats.print_stats(args.profile_top)
        out["profile"] = s.getvalue()
    return out


def native_attn_name() -> str:
    """The engine's own attention name on the running version."""
    return cont.spec(native_name())["attn"]


def _profile_loop(clock: HookClock, prof: cProfile.Profile) -> None:
    """Runs the engine's generation loop (its own thread) under ``prof``."""
    api = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    mgr = api.ContinuousBatchingManager
    original = mgr.__dict__["_run_generation_loop"]

    def loop(self: Any) -> None:
        prof.runcall(original, self)

    mgr._run_generation_loop = loop
    clock.on_restore(lambda: setattr(mgr, "_run_generation_loop", original))


def setup(device: str) -> None:
    """On the CPU: one thread, and the engine's memory check sees a fixed amount free."""
    if device == "cpu":
        torch.set_num_threads(1)
        fake_cpu_memory()


def binding_costs(rows: int = 257, layers: int = 16, n: int = 20000) -> dict[str, float]:
    """µs per call (best of 3 x ``n``) of the Rust calls the engine hooks make per scheduling
    candidate or per loop turn, on a host-backend cache of ``rows`` rows (256 requests and the
    trash row) and ``layers`` layers, alone and as a pool tenant (a ledger in a temporary
    directory): what each cut of a per-candidate read saves."""
    import os
    import tempfile
    import timeit

    import vmem
    from vmem import pool

    def kv(**kw: Any) -> Any:
        return vmem.KVCache(layers=layers, kv_heads=1, head_dim=64, dtype="bfloat16", max_batch=rows,
                            max_context=MAX_CONTEXT, page_size="256K", backend="host", **kw)

    with tempfile.TemporaryDirectory() as d:
        ledger = pool.create(os.path.join(d, "pool"), size="64M")
        alone, tenant = kv(), kv(pool=pool.Join("t", ledger=ledger.path))
        calls = {"tenant() in a pool": tenant._rs.tenant, "pool_room() in a pool": tenant._rs.pool_room,
                 "tenant() alone": alone._rs.tenant, "is_asleep()": alone._rs.is_asleep,
                 "usage()": alone._rs.usage, "prefix_stats()": alone._rs.prefix_stats,
                 "distinct_mapped_bytes()": alone._rs.distinct_mapped_bytes}
        out = {name: min(timeit.repeat(f, number=n, repeat=3)) / n * 1e6 for name, f in calls.items()}
        tenant.close()
        alone.close()
    return out

