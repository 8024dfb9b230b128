"""transformers' continuous batching side by side: its own paged cache against vmem (issue #23).

One process, one model (random bf16 weights, Llama-3-8B shapes with ``--layers`` layers), one
trace sample (the first ``--requests`` requests of the Azure conversation trace, prompts capped
at ``--max-prompt`` tokens, random token ids of those lengths with a fixed seed, ``--new-tokens``
new tokens each, EOS ignored), one KV memory budget, contenders interleaved (order reversed
every other round):

* ``paged-sdpa-16``, ``paged-sdpa-256``: the engine's ``PagedAttentionCache`` with ``paged|sdpa``
  (its gather + SDPA), blocks of 16 and 256 tokens;
* ``paged-flex-256``: the same cache read in place by ``paged|blockflex`` (the block table fed to
  the FlexAttention core vmem uses);
* ``vmem-per-layer``, ``vmem-token-major``: ``paged|vmem``, 2 MB pages, read in place by
  torch's FlashAttention-2 varlen op (``kernel="fa"``, the default);
* ``vmem-per-layer-flex``: ``paged|vmem`` per-layer read by compiled FlexAttention
  (``kernel="flex"``, the first version's kernel): the kernel's effect inside the engine.

The KV budget: what the engine gives ``PagedAttentionCache`` at ``max_memory_percent`` (0.5)
with ``paged|sdpa`` and 256-token blocks, computed once before any contender runs; every
contender then gets exactly those KV bytes (engine: ``num_blocks`` for its block size; vmem:
``memory``) and the same ``max_batch_tokens``. CUDA graphs are off for every contender (the
engine's default for non-flash attention).

Per contender: generated tok/s, TTFT and time-between-tokens p50/p99, the largest number of
requests running at once, KV memory (reserved; vmem: peak mapped too), preemptions. Writes
``serving_bench.json`` and ``serving_bench.txt`` to ``--out``.

``--tiny`` runs a tiny fp32 config on the CPU (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cb_harness as h  # noqa: E402
import vmem.transformers as vt  # noqa: E402
from harness.blockflex import BLOCKFLEX_ATTENTION  # noqa: E402

CONTENDERS = {
    "paged-sdpa-16": dict(attn="paged|sdpa", block_size=16),
    "paged-sdpa-256": dict(attn="paged|sdpa", block_size=256),
    "paged-flex-256": dict(attn=BLOCKFLEX_ATTENTION, block_size=256),
    "vmem-per-layer": dict(attn=vt.VMEM_ATTENTION, layout="per-layer", kernel="fa"),
    "vmem-token-major": dict(attn=vt.VMEM_ATTENTION, layout="token-major", kernel="fa"),
    "vmem-per-layer-flex": dict(attn=vt.VMEM_ATTENTION, layout="per-layer", kernel="flex"),
}
HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "vmem-cli", "data", "traces", "azure-conv-2023-first2000.csv")


def load_trace(path: str, n: int, max_prompt: int) -> List[int]:
    with open(path) as f:
        rows = list(csv.DictReader(f))[:n]
    return [max(1, min(int(r["ContextTokens"]), max_prompt)) for r in rows]


def make_model(args: Any) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_theta=500000.0, tie_word_embeddings=False)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=args.dtype)
    return model.eval()


def kv_budget(model: Any, args: Any) -> Dict[str, int]:
    """The engine's KV bytes and max_batch_tokens for paged|sdpa, 256-token blocks."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    cfg = model.config
    model.set_attn_implementation("paged|sdpa")
    cb = ContinuousBatchingConfig(block_size=256, max_memory_percent=args.memory_percent,
                                  max_batch_tokens=args.max_batch_tokens)
    if args.tiny:
        cb.num_blocks = 64
    mbt, nb = PagedAttentionMemoryHandler(
        config=cfg, continuous_batching_config=cb, dtype=model.dtype, group_types=["full_attention"],
        group_size=cfg.num_hidden_layers,
    ).infer_max_batch_tokens_and_num_blocks()
    model.set_attn_implementation("sdpa")
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * model.dtype.itemsize
    return {"kv_bytes": nb * 256 * token_bytes, "max_batch_tokens": mbt, "token_bytes": token_bytes}


class Watch:
    """A forward hook: the most requests running at once, and the most KV blocks in use after a
    round's allocations (the engine's and vmem's ``num_blocks - get_num_free_blocks()``: a block
    several requests share counts once, cached blocks no request holds count as free)."""

    def __init__(self, model: Any) -> None:
        self.manager = None
        self.max_running = 0
        self.peak_blocks = 0
        self.rounds = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *a: Any) -> None:
        bp = self.manager.batch_processor if self.manager is not None else None
        if bp is not None:
            self.rounds += 1
            self.max_running = max(self.max_running, len(bp.scheduler.active_requests))
            cache = bp.cache
            self.peak_blocks = max(self.peak_blocks, cache.num_blocks - cache.get_num_free_blocks())


def run_one(model: Any, name: str, prompts: List[List[int]], args: Any, budget: Dict[str, int],
            timed: bool = True, contenders: Optional[Dict[str, Dict[str, Any]]] = None,
            primers: int = 0) -> Dict[str, Any]:
    """Serves ``prompts`` with contender ``name`` (of ``contenders``, default :data:`CONTENDERS`;
    a spec's ``sharing`` sets the engine's ``allow_block_sharing``, default on, the engine's
    default). With ``primers``, the first ``primers`` prompts are served to the end first and
    the clock starts after them (a cache that has seen those prompts before)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    spec = (contenders or CONTENDERS)[name]
    model.set_attn_implementation(spec["attn"])
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    kw: Dict[str, Any] = dict(max_batch_tokens=budget["max_batch_tokens"], max_memory_percent=args.memory_percent,
                              use_cuda_graph=False)
    extra, opts = contender_config(model, spec, args, budget)
    kw.update(extra)
    watch = Watch(model)
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    with vt.serving(**opts):
        mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**kw))
        watch.manager = mgr
        mgr.start()
        results: Dict[str, Any] = {}
        t0 = time.perf_counter()
        ids = [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=args.new_tokens, record_timestamps=True)
               for i, p in enumerate(prompts[:primers])]
        try:
            for phase in ("primers", "timed"):
                if phase == "timed":
                    t0 = time.perf_counter()
                    ids += [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=args.new_tokens,
                                            record_timestamps=True)
                            for i, p in enumerate(prompts) if i >= primers]
                await_results(mgr, name, ids, results, t0, args.timeout)
            wall = time.perf_counter() - t0
            cache = mgr.batch_processor.cache
            info = cache_info(cache, budget)
            info["kv_peak_in_use_mb"] = watch.peak_blocks * cache.block_size * budget["token_bytes"] / 2**20
        finally:
            mgr.stop(block=True, timeout=120)
            watch.handle.remove()
    timed_results = [r for i, r in enumerate(results[k] for k in ids) if i >= primers]
    generated = sum(len(r.generated_tokens) for r in timed_results)
    ttft, tbt = [], []
    for r in timed_results:
        ts = r.timestamps or []
        if ts:
            ttft.append(ts[0] - r.created_time)
            tbt.extend(b - a for a, b in zip(ts, ts[1:]))
    out = {
        "contender": name, "requests": len(timed_results), "generated_tokens": generated, "wall_s": wall,
        "tok_s": generated / wall, "rounds": watch.rounds, "max_running": watch.max_running,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "tbt_p50_ms": pct(tbt, 50) * 1e3, "tbt_p99_ms": pct(tbt, 99) * 1e3,
        "peak_torch_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }
    out.update(info)
    del mgr, cache
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def contender_config(model: Any, spec: Dict[str, Any], args: Any, budget: Dict[str, int],
                     max_requests: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """What contender ``spec`` needs to hold exactly ``budget["kv_bytes"]`` of KV: the engine's
    config entries (block sharing per the spec's ``sharing``, default on as in the engine; for
    the engine's own cache its block size and block count) and the ``vmem.transformers.serving``
    options (vmem: layout, kernel, memory, rows — ``max_requests``, default ``--max-requests``)."""
    kw: Dict[str, Any] = dict(allow_block_sharing=spec.get("sharing", True))
    if spec["attn"] == vt.VMEM_ATTENTION:
        rows = args.max_requests if max_requests is None else max_requests
        if spec.get("kernel", "fa") == "flex":
            # Compiled Flex indexes [rows, Hkv, max_context, D] with 32-bit offsets (rows = requests
            # + the trash row): cap the rows there, as vmem.transformers refuses more.
            cfg = model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            per_row = args.max_context * cfg.num_key_value_heads * head_dim
            rows = min(rows, (2**31 - 1) // per_row - 1)
        opts = dict(layout=spec["layout"], kernel=spec.get("kernel", "fa"), memory=budget["kv_bytes"],
                    page_size=args.page_size, max_requests=rows, max_context=args.max_context)
        return kw, opts
    bs = spec["block_size"]
    # The budget is fixed by num_blocks; the engine still checks its footprint against
    # max_memory_percent of the memory free *now*, which the run before may have moved by a
    # few hundred MB (seen on the H100: 39.37 GB asked, 39.28 GB allowed). Let the check
    # pass; the blocks, not the percentage, set what the cache holds.
    kw.update(block_size=bs, num_blocks=budget["kv_bytes"] // (bs * budget["token_bytes"]),
              max_memory_percent=0.95)
    return kw, {}


def await_results(mgr: Any, name: str, ids: List[str], results: Dict[str, Any], t0: float, timeout: float) -> None:
    """Collects finished results into ``results`` until every id in ``ids`` has one."""
    while any(i not in results for i in ids):
        r = mgr.get_result(timeout=1.0)
        if r is None:
            if not mgr.is_running():
                raise RuntimeError(f"{name}: engine stopped: {mgr.background_thread_status.fatal_error!r}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{name}: timed out after {timeout} s")
            continue
        if r.error is not None:
            raise RuntimeError(f"{name}: request {r.request_id} failed: {r.error}")
        if r.is_finished():
            results[r.request_id] = r


def cache_info(cache: Any, budget: Dict[str, int]) -> Dict[str, Any]:
    """Memory, preemptions and prefix hits (tokens served from cache) of a finished run's cache."""
    common = {"block_size": cache.block_size, "num_blocks": cache.num_blocks,
              "prefix_hit_tokens": getattr(cache, "_total_prefix_length", 0),
              "sharing": bool(getattr(cache, "use_prefix_sharing", False))}
    if isinstance(cache, vt.VmemCBCache):
        u = cache.usage()
        return {"kv_reserved_mb": u["physical_bytes"] / 2**20, "kv_peak_mapped_mb": cache.peak_mapped_bytes / 2**20,
                "kv_mapped_at_end_mb": u["mapped_bytes"] / 2**20, "preemptions": cache.readmissions,
                "kernel": cache.kernel, **common}
    kv = sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)
    return {"kv_reserved_mb": kv / 2**20, "kv_peak_mapped_mb": None, "preemptions": None, **common}


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def table(rows: List[Dict[str, Any]]) -> str:
    cols = ["contender", "round", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "max_running",
            "kv_reserved_mb", "kv_peak_mapped_mb", "preemptions", "wall_s"]
    lines = [" | ".join(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    # Medians per contender over rounds.
    lines.append("")
    lines.append("median over rounds: contender | tok_s | tbt_p99_ms | vs paged-sdpa-256")
    names = list(dict.fromkeys(r["contender"] for r in rows))
    med = {n: statistics.median(r["tok_s"] for r in rows if r["contender"] == n) for n in names}
    base = med.get("paged-sdpa-256")
    for n in names:
        p99 = statistics.median(r["tbt_p99_ms"] for r in rows if r["contender"] == n)
        ratio = f"{med[n] / base:.2f}x" if base else "-"
        lines.append(f"{n} | {med[n]:.1f} | {p99:.1f} | {ratio}")
    return "\n".join(lines)


def contender_names(ap: argparse.ArgumentParser, spec: str, known: Dict[str, Any]) -> List[str]:
    """The comma-separated contender names of ``spec``; an unknown one is a usage error."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in known:
            ap.error(f"unknown contender {n!r} (known: {list(known)})")
    if not names:
        ap.error(f"--contenders names none (known: {list(known)})")
    return names


def check_flags(ap: argparse.ArgumentParser, args: Any, positive: List[str], at_least_zero: List[str] = ()) -> None:
    """Refuses, as usage errors (exit 2, one line naming the flag), before any model is built,
    what either benchmark cannot run: counts in ``positive`` below 1 (a ``None`` default passes),
    in ``at_least_zero`` below 0, ``--memory-percent`` outside (0, 1], ``--timeout`` not above 0,
    a ``--page-size`` vmem cannot parse or 0, a ``--trace`` that is no file, an ``--out`` that
    cannot be created."""
    for flag in [*positive, *at_least_zero]:
        v = getattr(args, flag[2:].replace("-", "_"))
        least = 1 if flag in positive else 0
        if v is not None and v < least:
            ap.error(f"{flag} must be at least {least}, got {v}")
    if not 0 < args.memory_percent <= 1:  # NaN included
        ap.error(f"--memory-percent must be a fraction in (0, 1], got {args.memory_percent}")
    if not args.timeout > 0:
        ap.error(f"--timeout must be more than 0 seconds, got {args.timeout}")
    try:
        page = vt.parse_bytes(args.page_size)
    except vt.VmemError as e:
        ap.error(f"--page-size {args.page_size!r}: {e}")
    if page == 0:
        ap.error("--page-size must be more than 0 bytes")
    if not os.path.isfile(args.trace):
        ap.error(f"--trace {args.trace!r} is not a file")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out!r} cannot be created: {e.strerror}")


def place(ap: argparse.ArgumentParser, args: Any) -> None:
    """Sets ``args.device`` and ``args.dtype``: bf16 on the GPU, or with ``--tiny`` fp32 on the CPU
    with small pages, context and batch (a smoke test); no GPU without ``--tiny`` is a usage error."""
    if args.tiny:
        args.device, args.dtype = "cpu", torch.float32
        args.page_size = "64K"
        args.max_context = min(args.max_context, 2048)
        args.max_batch_tokens = args.max_batch_tokens or 256
        args.max_requests = min(args.max_requests, 8)  # eager Flex on the CPU materializes rows x context scores
        h.fake_cpu_memory()
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU: use --tiny for a CPU smoke test")
        args.device, args.dtype = "cuda", torch.bfloat16


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=4000)
    ap.add_argument("--memory-percent", type=float, default=0.5)
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default: what the engine picks")
    ap.add_argument("--max-requests", type=int, default=256, help="vmem rows (requests holding KV at once)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--page-size", default="2M")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per contender (compiles Flex)")
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 config on the CPU (smoke test)")
    ap.add_argument("--out", default="serving-bench-out")
    args = ap.parse_args(argv)
    names = contender_names(ap, args.contenders, CONTENDERS)
    check_flags(ap, args, ["--requests", "--new-tokens", "--rounds", "--layers", "--max-prompt", "--max-batch-tokens",
                           "--max-requests", "--max-context"], ["--warmup"])
    place(ap, args)
    vt.install()
    os.makedirs(args.out, exist_ok=True)

    lengths = load_trace(args.trace, args.requests, args.max_prompt)
    g = torch.Generator().manual_seed(args.seed)
    model = make_model(args)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    budget = kv_budget(model, args)
    print(f"KV budget {budget['kv_bytes'] / 2**30:.2f} GiB, max_batch_tokens {budget['max_batch_tokens']}, "
          f"{len(prompts)} requests, prompts {sum(lengths)} tokens, {args.new_tokens} new tokens each", flush=True)

    rows: List[Dict[str, Any]] = []
    for name in names:
        for _ in range(args.warmup):
            t = time.perf_counter()
            small = argparse.Namespace(**vars(args))
            small.new_tokens = 4
            run_one(model, name, prompts[:8], small, budget, timed=False)
            print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            r = run_one(model, name, prompts, args, budget)
            r["round"] = rnd
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "serving_bench.json"), "w") as f:
                json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "budget": budget, "runs": rows,
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           "torch": torch.__version__}, f, indent=1)
    text = table(rows)
    with open(os.path.join(args.out, "serving_bench.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
