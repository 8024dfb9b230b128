"""The serving suite's workloads and runs: two traces, three models, two KV budgets, every
contender of the registry asked for, interleaved per workload; each row with its device memory,
its roofline bound and its ratios to the engine's best (served with vmem installed, and in a
process where vmem was never imported: ``NAME@clean``, :mod:`harness.clean`) and to ``fi-paged``.
serving_suite.py parses the flags and calls :func:`run_suite`."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness import clean
from harness import contenders as ct
from harness import roofline as rf
from harness import stats
from harness.trace import TRACES as BUNDLED
from harness.trace import trace_path

#: the suite's traces, by name (they travel with the repository)
TRACES = {name: trace_path(name) for name in BUNDLED}
#: the suite's models, the headline first: Llama-3-8B's shapes at its full depth (32 layers), the
#: same shapes at 8 layers, and Llama-3.2-1B's at its full depth (16)
MODELS = ("llama3-8b", "llama3-8b-x8", "llama3.2-1b")
#: each model's layers, and those of its tiny CPU stand-in (``--tiny``: as deep relative to the others)
LAYERS = {"llama3-8b": (32, 8), "llama3-8b-x8": (8, 2), "llama3.2-1b": (16, 4)}
#: the KV budgets: every request's KV at once, and about a tenth of that (memory-bound)
BUDGETS = ("fits", "tenth")
#: the FlashInfer paged peer the ratios are taken against
FI_PAGED = "fi-paged"
#: the largest token granule a contender allocates in, besides vmem's page: the engine's block
ENGINE_BLOCK = 256


def registry() -> dict[str, ct.Spec]:
    """The serving contenders the running transformers version offers, by name (the catalog's
    entries for this version: the engine's own, vmem's, fi-paged's), and each engine-native one
    again as ``NAME@clean`` (served in a process without vmem)."""
    reg = {name: ct.spec(name) for name in ct.offered()}
    return {**reg, **{name + clean.SUFFIX: sp for name, sp in reg.items() if ct.is_engine_native(name, sp)}}


def default_contenders() -> list[str]:
    """The contenders the suite runs when none are named: every one this version offers, and the
    engine's best again in a process without vmem."""
    return [*ct.offered(), ct.engine_best() + clean.SUFFIX]


def is_engine_native(name: str, spec: ct.Spec) -> bool:
    """Whether ``spec`` is one of the engine's own attentions over its own cache (in either process)."""
    return ct.is_engine_native(name, spec)


def model_config(name: str, tiny: bool, context: int = 2048, pages_like: bool = False) -> Any:
    """The config of model ``name`` (context 8,192); ``tiny``: its tiny Llama stand-in for the
    CPU (:data:`LAYERS`), with positions for ``context`` tokens; ``pages_like`` (``--schedule``):
    with the layers that make a 64K token-major page hold as many of its tokens as a 2M page holds
    of the model's (:func:`page_matched_layers`)."""
    from harness.models import SERVING_TOKENS, llama3_8b_config, llama32_1b_config, tiny_llama_config

    layers, tiny_layers = LAYERS[name]
    if tiny:
        cfg = tiny_llama_config()
        cfg.num_hidden_layers = page_matched_layers(name, cfg) if pages_like else tiny_layers
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, context)
        return cfg
    if name.startswith("llama3-8b"):
        return llama3_8b_config(layers, max_position_embeddings=8192, tokens=SERVING_TOKENS)
    return llama32_1b_config(layers, max_position_embeddings=8192, tokens=SERVING_TOKENS)


def page_matched_layers(name: str, tiny: Any) -> int:
    """The layers of the stand-in ``tiny`` (fp32) whose token-major token takes the share of a 64K
    page that model ``name``'s (bf16) takes of a 2M page: 8 for Llama-3-8B at 32 layers (16 tokens
    a page), 2 for it at 8 layers and for Llama-3.2-1B (64). ``ValueError`` where no whole number
    of layers does."""
    real = rf.ModelShape.from_config(model_config(name, False), 2)
    tokens = (2 << 20) // real.token_kv_bytes
    one = rf.ModelShape.from_config(tiny, 4).token_kv_bytes // tiny.num_hidden_layers  # a layer's K and V
    layers, rest = divmod((64 << 10) // tokens, one)
    if rest or layers < 1 or (2 << 20) % real.token_kv_bytes:
        raise ValueError(f"no stand-in of {name} holds {tokens} tokens a 64K page")
    return layers


def granule_tokens(shape: rf.ModelShape, page_bytes: int) -> int:
    """The largest token granule of any contender: the engine's 256-token block, or vmem's
    per-layer page (``page_bytes`` over one layer's K of one token), whichever is larger."""
    return max(ENGINE_BLOCK, page_bytes // (shape.kv_heads * shape.head_dim * shape.itemsize))


def budget_tokens(kind: str, prompt_lens: Sequence[int], new_tokens: int, granule: int, fraction: float) -> int:
    """KV tokens of budget ``kind``. ``fits``: every request's prompt and new tokens, each
    rounded up to ``granule``, plus one granule (vmem's trash row): no contender waits for
    memory. ``tenth``: ``fraction`` of the working set (exact tokens), but at least the
    largest request rounded up plus one granule (else no contender could serve it)."""
    if kind not in BUDGETS:
        raise ValueError(f"unknown budget {kind!r} (known: {list(BUDGETS)})")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    rounded = [-(-(n + new_tokens) // granule) * granule for n in prompt_lens]
    if kind == "fits":
        return sum(rounded) + granule
    working = sum(n + new_tokens for n in prompt_lens)
    return max(int(working * fraction), max(rounded) + granule)


@dataclass(frozen=True)
class Workload:
    """One cell of the suite: trace, model, budget name, the prompts and the KV budget."""

    trace: str
    model: str
    budget: str
    prompts: list[list[int]]
    kv: dict[str, int]
    bound: rf.Workload


def workload(trace: str, model_name: str, budget: str, prompts: list[list[int]], shape: rf.ModelShape,
             args: Any, page_bytes: int) -> Workload:
    """The workload of ``trace`` x ``model_name`` x ``budget`` over ``prompts``."""
    lens = [len(p) for p in prompts]
    tokens = budget_tokens(budget, lens, args.new_tokens, granule_tokens(shape, page_bytes), args.tenth)
    kv = {"kv_bytes": tokens * shape.token_kv_bytes, "max_batch_tokens": args.max_batch_tokens,
          "token_bytes": shape.token_kv_bytes}
    return Workload(trace, model_name, budget, prompts, kv,
                    rf.Workload(tuple(lens), args.new_tokens, tokens, args.max_batch_tokens))


def run_one(model: Any, w: Workload, name: str, args: Any, shape: rf.ModelShape, peaks: rf.Peaks,
            rnd: int, worker: clean.CleanEngine | None = None) -> dict[str, Any]:
    """Contender ``name`` on ``w``, timed, its device memory watched: one result row (a
    ``NAME@clean`` one served by ``worker``, a process without vmem, which measures it the same
    way). A run that fails is a row with ``error`` and 0 requests completed (the suite goes on)."""
    from harness import serving

    row: dict[str, Any] = {"contender": name, "trace": w.trace, "model": w.model, "budget": w.budget, "round": rnd,
                           "kv_budget_mb": w.kv["kv_bytes"] / 2**20, "requests": len(w.prompts)}
    t = time.perf_counter()
    try:
        if clean.is_clean(name):
            if worker is None:
                raise RuntimeError("no vmem-free worker for a @clean contender")
            r = worker.run(name, registry()[name], w.prompts, args, w.kv)
            if r["vmem_modules"]:
                raise RuntimeError(f"vmem was imported in the vmem-free process: {r['vmem_modules'][:5]}")
            row["vmem_modules"] = r["vmem_modules"]
        else:
            r = serving.run_measured(model, name, w.prompts, args, w.kv, registry())
    except Exception as e:  # one contender's failure is a row, not the end of the suite
        row.update(error=f"{type(e).__name__}: {e}"[:500], completed=0)
        print(f"{name} {w.trace}/{w.model}/{w.budget}: FAILED {row['error']}", flush=True)
        return row
    row.update({k: r.get(k) for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "tbt_gaps",
                                      "tbt_slow_gaps", "tbt_stalled_gaps", "completed",
                                      "generated_tokens", "wall_s", "preemptions", "kv_reserved_mb",
                                      "kv_peak_mapped_mb", "max_running", "rounds", "warmup_mb",
                                      "graphs_at_start", "graphs_at_end", "device_mb")})
    bound = rf.lower_bound(shape, w.bound, peaks)
    row.update(bound_s=bound["bound_s"], bound_prefill_s=bound["prefill_s"], bound_decode_s=bound["decode_s"],
               roofline=bound["bound_s"] / r["wall_s"] if r["wall_s"] > 0 else None)
    print(f"{name} {w.trace}/{w.model}/{w.budget} round {rnd}: {time.perf_counter() - t:.1f} s, "
          f"{row['tok_s']:.0f} tok/s, roofline {row['roofline']:.3f}, TBT p99 {row['tbt_p99_ms']:.2f} ms; "
          f"of {row['tbt_gaps']} gaps {row['tbt_slow_gaps']} past {stats.SLOW}x p50, {row['tbt_stalled_gaps']} "
          f"past {stats.STALLED:g}x", flush=True)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per workload (trace, model, budget) and round, each row's tok/s over: the best engine-native
    contender's served with vmem installed (``vs_engine``), the best served in the process without
    vmem (``vs_engine_clean``), the better of the two (``vs_engine_best``), and the best
    ``fi-paged*``'s (``vs_fi_paged``); ``None`` where that contender did not run or failed."""
    reg = registry()
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["model"], r["budget"], r.get("round", 0)), []).append(r)
    for cell in cells.values():
        ok = [r for r in cell if r.get("tok_s")]
        native = [r for r in ok if r["contender"] in reg and is_engine_native(r["contender"], reg[r["contender"]])]
        inside = max((r["tok_s"] for r in native if not clean.is_clean(r["contender"])), default=None)
        apart = max((r["tok_s"] for r in native if clean.is_clean(r["contender"])), default=None)
        best = max((x for x in (inside, apart) if x), default=None)
        fi = max((r["tok_s"] for r in ok if r["contender"].startswith(FI_PAGED)), default=None)
        for r in cell:
            tok = r.get("tok_s")
            for key, ref in (("vs_engine", inside), ("vs_engine_clean", apart), ("vs_engine_best", best),
                             ("vs_fi_paged", fi)):
                r[key] = tok / ref if tok and ref else None


def agreement(model: Any, name: str, args: Any, kv: dict[str, int], n: int, new_tokens: int) -> dict[str, Any]:
    """Top-1 agreement of contender ``name`` with a plain forward (teacher-forced,
    :func:`harness.check.compare`) over the first ``n`` prompts, ``new_tokens`` each, each
    capped at 512 tokens."""
    from harness import check
    from harness.trace import random_prompts

    spec = registry()[name]
    attn = ct.attention(spec)
    prompts = random_prompts([min(512, 16 + 37 * i) for i in range(n)], model.config.vocab_size, seed=7)
    kw: dict[str, Any] = {"max_batch_tokens": kv["max_batch_tokens"], "use_cuda_graph": False}
    extra, opts = ct.contender_config(model, spec, args, kv)
    kw.update(extra)
    # The check reads each round's logits in a forward hook, which a captured graph neither runs
    # nor allows (a device-to-host copy inside capture): graph contenders are checked with their
    # graphs off (the same attention and cache; graphs_check.py compares graphs on and off).
    # Async batching off too: its rounds run one ahead of the requests' results, and the hook's
    # logits did not line up with the tokens (counts_ok false on the H200, top-1 agreeing);
    # graphs_check.py checks async batching's tokens against a plain forward instead.
    kw["use_cuda_graph"] = False
    kw["use_async_batching"] = False
    try:
        run = check.run_engine(model, attn, prompts, new_tokens, cb_kwargs=kw, serving=opts,
                               timeout=args.timeout, name=name)
        c = check.compare(run, model, new_tokens)
    except Exception as e:
        return {"contender": name, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"contender": name, "top1_agree": c["top1_agree"], "decisive": c["decisive"],
            "max_rel_err": c["max_rel_err"], "counts_ok": c["counts_ok"]}


def run_suite(args: Any, names: list[str], only: dict[str, list[str]], peaks: rf.Peaks,
              on_row: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every selected model, trace and budget, contenders interleaved per workload (order
    reversed every other round); ``on_row(rows, checks)`` after each run (to save them)."""
    from harness import serving
    from harness.models import random_model
    from harness.trace import load_trace, random_prompts

    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    page_bytes = _page_bytes(args.page_size)
    reg = registry()
    for model_name in only.get("model", list(MODELS)):
        config = model_config(model_name, args.tiny, args.max_context, getattr(args, "schedule", False))
        model = random_model(config, args.dtype, args.device)
        shape = rf.ModelShape.from_config(config, model.dtype.itemsize)
        worker = _worker(config, args) if any(clean.is_clean(n) for n in names) else None
        try:
            warmed = False
            for trace in only.get("trace", list(TRACES)):
                lens = [r.prompt_len for r in load_trace(TRACES[trace], args.requests, args.max_prompt)]
                prompts = random_prompts(lens, config.vocab_size, args.seed)
                for budget in only.get("budget", list(BUDGETS)):
                    w = workload(trace, model_name, budget, prompts, shape, args, page_bytes)
                    print(f"== {trace}/{model_name}/{budget}: KV budget {w.kv['kv_bytes'] / 2**20:.0f} MiB "
                          f"({w.bound.budget_tokens} tokens), {len(prompts)} requests", flush=True)
                    if not warmed:
                        for name in names:  # one contender failing its warm-up must not stop the others
                            try:
                                if clean.is_clean(name):
                                    if worker is not None:
                                        worker.warm_up(name, reg[name], prompts, args, w.kv, times=args.warmup)
                                else:
                                    serving.warm_up(model, [name], prompts, args, w.kv, reg, times=args.warmup)
                            except Exception as e:  # its timed runs then record the error in their rows
                                print(f"warm-up {name} failed: {type(e).__name__}: {e}"[:300], flush=True)
                        # the @clean rows run the engine's own code as checked in-process
                        for name in [n for n in names if not clean.is_clean(n)] if args.check_requests else []:
                            checks.append({"model": model_name, **agreement(model, name, args, w.kv,
                                                                            args.check_requests, args.check_tokens)})
                            print(f"check {name}: {checks[-1]}", flush=True)
                        warmed = True
                    for rnd in range(args.rounds):
                        for name in names if rnd % 2 == 0 else names[::-1]:
                            rows.append(run_one(model, w, name, args, shape, peaks, rnd, worker))
                            add_ratios(rows)
                            on_row(rows, checks)
        finally:
            if worker is not None:
                worker.close()
        del model
        gc.collect()
        _empty_cache()
    return rows


def _worker(config: Any, args: Any) -> clean.CleanEngine | None:
    """The vmem-free worker for one model (``None``, said once, when it cannot start: its rows then
    record the error)."""
    try:
        return clean.CleanEngine(config, args.dtype, args.device)
    except Exception as e:  # noqa: BLE001 - the @clean rows say so
        print(f"the vmem-free worker did not start: {type(e).__name__}: {e}"[:500], flush=True)
        return None


def _page_bytes(text: str) -> int:
    import vmem

    return int(vmem.parse_bytes(text))


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
