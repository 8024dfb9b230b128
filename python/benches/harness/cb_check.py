"""serving_check.py's checks: vmem under transformers' continuous batching against a plain
forward, per architecture and contender, and its attention kernels outside the engine."""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

import torch
from vmem.transformers import (
    KERNELS,
    Options,
    VmemCBCache,
    block_tokens,
    install,
)
from vmem.transformers import paged_attention as flex_paged_attention
from vmem.transformers.options import FLASHINFER_KERNELS

import vmem
from harness.check import compare, cross_compare, make_prompts, run_engine
from harness.contenders import (
    CHECK,
    VMEM_ATTENTION,
    attention,
    is_vmem,
    is_vmem_cache,
    vmem_options,
)
from harness.engine import fake_cpu_memory
from harness.models import check_model
from harness.table import format_table
from harness.trace import random_prompts


def clean(cache: Any) -> str:
    """'' when only the trash row is mapped, else what is left."""
    u = cache.usage()
    ok = u["rows_in_use"] == 0 and u["blocks_in_use"] == 0 and u["mapped_bytes"] == cache.trash_bytes()
    return "" if ok else f"left mapped: {u}"


def padding_cost(device: str, dtype: torch.dtype, tiny: bool, kernel: str) -> dict[str, Any]:
    """Decode attention of the vmem path (``kernel="fa"``: one FlashAttention-2 varlen call with
    each row's start and length; ``"flex"``: Flex over ``[rows, Hkv, max_context, D]`` rows with
    per-row KV block counts) for one long request among short ones, against every row as long
    as the longest and every row short: the time must follow the tokens, not rows x longest.
    Uses a :class:`vmem.transformers.VmemCBCache`'s own index builder and buffers."""
    from transformers import ContinuousBatchingConfig, LlamaConfig

    if tiny:
        cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                          intermediate_size=256, vocab_size=128, max_position_embeddings=2048)
        rows, long, short, page, reps = 8, 1024, 128, "64K", 3
    else:
        cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1,
                          intermediate_size=256, vocab_size=128, max_position_embeddings=16384)
        rows, long, short, page, reps = 64, 16384, 512, "2M", 20
    cb = ContinuousBatchingConfig(max_batch_tokens=rows)
    cache = VmemCBCache(cfg, cb, device, dtype=dtype, options=Options(
        max_requests=rows, max_context=long, memory=str(2 * (rows + 2) * long * 8 * 128 * dtype.itemsize),
        page_size=page, kernel=kernel))
    hq, d = cfg.num_attention_heads, 128 if not tiny else 32

    class _M:  # what the attention function reads of a module
        layer_idx = 0

    out: dict[str, Any] = {}
    ids = [f"r{i}" for i in range(rows)]
    for label, lens in (("one long, rest short", [long] + [short] * (rows - 1)),
                        ("all long", [long] * rows), ("all short", [short] * rows)):
        for rid in ids:
            cache.free_blocks(rid)
        for rid, n in zip(ids, lens):
            blocks = -(-n // cache.block_size)
            if cache.allocate_blocks(blocks, rid, 0) != blocks:
                raise RuntimeError(f"padding_cost: could not allocate {blocks} blocks")
        cache.flush()
        wi: list[list[int]] = [[]]
        for rid, n in zip(ids, lens):
            cache.extend_read_and_write_indices(rid, n - 1, 1, None, wi)
        write_index = [torch.tensor(wi[0], device=device)]
        q = torch.randn(1, hq, rows, d, device=device, dtype=dtype)
        k = torch.randn(1, cfg.num_key_value_heads, rows, d, device=device, dtype=dtype)
        kw = {"cache": cache, "write_index": write_index}
        flex_paged_attention(_M(), q, k, k, scaling=d ** -0.5, **kw)  # builds the mask (+ compiles)
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            flex_paged_attention(_M(), q, k, k, scaling=d ** -0.5, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        sec = sorted(times)[len(times) // 2]
        kv_bytes = 2 * sum(lens) * cfg.num_key_value_heads * d * dtype.itemsize
        out[label] = {"ms": sec * 1e3, "tokens": sum(lens), "gb_s": kv_bytes / sec / 1e9}
        print(f"padding cost ({kernel}): {label:22} {sum(lens):7} tokens {sec * 1e3:8.3f} ms "
              f"{kv_bytes / sec / 1e9:8.1f} GB/s", flush=True)
    for rid in ids:
        cache.free_blocks(rid)
    del cache
    mixed, full, short_ = out["one long, rest short"]["ms"], out["all long"]["ms"], out["all short"]["ms"]
    # The mixed batch reads 1 long + (rows-1) short rows: it must cost far less than rows x long.
    out["status"] = "PASS" if mixed < 0.5 * full or tiny else "FAIL"
    out["why"] = "" if out["status"] == "PASS" else f"mixed {mixed:.3f} ms vs all-long {full:.3f} ms"
    if tiny:
        out["why"] = "CPU reference paths: not a measurement"
    out["short_ms"] = short_
    return out


def fa_kernel_check(device: str, dtype: torch.dtype, tiny: bool, layout: str, tol: float) -> dict[str, Any]:
    """The ``kernel="fa"`` attention call of one round, outside the engine, against a float32
    per-request reference: a :class:`vmem.transformers.VmemCBCache` (``layout``), six requests
    (decodes and prefill chunks mixed) queried in descending row order (``cu_seqlens_k`` not
    sorted), NaN in every allocated slot past a request's ``past + q`` (FA must not read it),
    every layer. Proves the FlashAttention op over the in-place views, both layouts' strides."""
    from transformers import ContinuousBatchingConfig, LlamaConfig

    if tiny:
        hq, hkv, d, ctx, page = 4, 2, 32, 1024, "64K"
        shapes = [(0, 37), (300, 1), (200, 1), (0, 1), (100, 64), (500, 1)]
    else:
        hq, hkv, d, ctx, page = 8, 2, 128, 8192, "2M"
        shapes = [(0, 37), (1500, 1), (200, 1), (0, 1), (900, 64), (2999, 1)]
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, num_hidden_layers=2,
                      intermediate_size=256, vocab_size=128, max_position_embeddings=ctx)
    cb = ContinuousBatchingConfig(max_batch_tokens=256)
    cache = VmemCBCache(cfg, cb, device, dtype=dtype, options=Options(
        max_requests=8, max_context=ctx, memory="256M", page_size=page, layout=layout, kernel="fa"))
    ids = [f"r{i}" for i in range(len(shapes))]
    held = {}
    for rid, (past, q) in zip(ids, shapes):
        blocks = -(-(past + q) // cache.block_size)
        if cache.allocate_blocks(blocks, rid, 0) != blocks:
            raise RuntimeError(f"fa_kernel_check: could not allocate {blocks} blocks")
        held[rid] = blocks * cache.block_size
    cache.flush()
    torch.manual_seed(0)
    base = {rid: cache.table.get(rid).index * cache.max_context for rid in ids}
    for rid, (past, q) in zip(ids, shapes):
        b = base[rid]
        for kc in cache.key_cache + cache.value_cache:
            kc[b:b + past] = torch.randn(past, hkv, d, device=device, dtype=dtype)
            kc[b + past + q:b + held[rid]] = float("nan")
    order = list(range(len(shapes)))[::-1]
    wi: list[list[int]] = [[]]
    for i in order:
        cache.extend_read_and_write_indices(ids[i], shapes[i][0], shapes[i][1], None, wi)
    write_index = [torch.tensor(wi[0], device=device)]
    t = sum(q for _, q in shapes)
    scale = d ** -0.5

    class _M:
        layer_idx = 0

    worst = 0.0
    for layer in range(cfg.num_hidden_layers):
        _M.layer_idx = layer
        q = torch.randn(1, hq, t, d, device=device, dtype=dtype)
        kn = torch.randn(1, hkv, t, d, device=device, dtype=dtype)
        vn = torch.randn(1, hkv, t, d, device=device, dtype=dtype)
        out, _ = flex_paged_attention(_M(), q, kn, vn, scaling=scale, cache=cache, write_index=write_index)
        if device == "cuda":
            torch.cuda.synchronize()
        kc, vc = cache.kv_layer(layer)
        start = 0
        for i in order:
            past, ql = shapes[i]
            b, n = base[ids[i]], past + ql
            qs = q[0, :, start:start + ql].float()  # [Hq, ql, D]
            ks = kc[b:b + n].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            vs = vc[b:b + n].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            s_ = (qs @ ks.transpose(1, 2)) * scale
            causal = torch.arange(n, device=device).view(1, -1) <= torch.arange(n - ql, n, device=device).view(-1, 1)
            ref = torch.softmax(s_.masked_fill(~causal, float("-inf")), -1) @ vs  # [Hq, ql, D]
            got = out[0, start:start + ql].float().transpose(0, 1)
            if not torch.isfinite(got).all():
                raise RuntimeError(f"layer {layer}, request {i}: non-finite output (read past seqused_k?)")
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
            start += ql
    for rid in ids:
        cache.free_blocks(rid)
    del cache
    ok = worst <= tol
    return {"status": "PASS" if ok else "FAIL", "max_rel_err": worst, "why": "" if ok else f"err {worst:.2e} > {tol}"}


def run(args: Any) -> int:
    """Every check of serving_check.py (``args``: its flags); prints a PASS/FAIL table, writes
    ``serving_check.json`` to ``args.out``; 1 on any failure, else 0."""
    if args.tiny:
        device, dtype = "cpu", torch.float32
        tol = args.tol or 1e-4
        lengths = [5, 140, 300, 17, 260, 64, 33, 200]
        page, mem, ctx, mbt = "64K", "8M", 1024, 48
        fake_cpu_memory()
    else:
        device, dtype = "cuda", torch.bfloat16
        tol = args.tol or 0.04
        lengths = [7, 1500, 300, 2100, 45, 900, 3000, 128, 1030, 64]
        page, mem, ctx, mbt = "2M", "4G", 8192, 512
    install(page_size=page, memory=mem, max_context=ctx, max_requests=16)
    os.makedirs(args.out, exist_ok=True)
    n = args.requests
    stagger = [0] * (n // 2) + [2 * i + 1 for i in range(n - n // 2)]
    rows: list[dict[str, Any]] = []
    failed = False

    def record(arch: str, contender: str, fn: Any) -> None:
        nonlocal failed
        t = time.perf_counter()
        row: dict[str, Any] = {"arch": arch, "contender": contender}
        try:
            row.update(fn())
        except Exception as e:  # noqa: BLE001 - a failure is a row of the table
            row.update(status="FAIL", why=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6))
        row["seconds"] = round(time.perf_counter() - t, 1)
        failed |= row.get("status") != "PASS"
        rows.append(row)
        print(f"{row['status']:4} {arch:11} {contender:22} err {row.get('max_rel_err', float('nan')):.2e} "
              f"top1 {row.get('top1_agree', '-')}/{row.get('decisive', '-')} {row.get('why', '')}", flush=True)

    for layout in ("per-layer", "token-major"):
        record("fa-kernel", f"fa-varlen({layout})",
               lambda layout=layout: fa_kernel_check(device, dtype, args.tiny, layout, 0.02 if not args.tiny else tol))

    for arch in [a for a in args.archs.split(",") if a]:
        model = check_model(arch, dtype, device, size=("tiny" if args.tiny else "small"), logit_scale=20.0)
        if not args.tiny:
            model.config.max_position_embeddings = ctx
        prompts = make_prompts(n, lengths, model.config.vocab_size)
        runs: dict[str, Any] = {}

        def check(contender: str, attn: str, cb_kwargs: dict[str, Any], opts: dict[str, Any],
                  prompts: list[list[int]] = prompts, new: int = args.new_tokens, stagger: Any = stagger,
                  want_preempt: bool = False, model: Any = model, runs: dict[str, Any] = runs) -> Any:
            def fn() -> dict[str, Any]:
                run = run_engine(model, attn, prompts, new, cb_kwargs=cb_kwargs, serving=opts, stagger=stagger,
                                 streaming=True)
                runs[contender] = run
                cmp = compare(run, model, new)
                why = []
                if not cmp["counts_ok"]:
                    why.append("token/logit counts")
                if cmp["max_rel_err"] > tol:
                    why.append(f"err {cmp['max_rel_err']:.2e} > {tol}")
                if cmp["top1_agree"] != cmp["decisive"] or cmp["decisive"] == 0:
                    why.append(f"top-1 {cmp['top1_agree']}/{cmp['decisive']}")
                if any(c != new for c in run["streamed"].values()):
                    why.append("streamed counts")
                cache = run["cache"]
                extra: dict[str, Any] = {"rounds": run["rounds"], "max_running": run["max_running"]}
                if is_vmem_cache(cache):
                    left = clean(cache)
                    if left:
                        why.append(left)
                    extra.update(block_size=cache.block_size, num_blocks=cache.num_blocks,
                                 preemptions=cache.readmissions, peak_mapped_mb=cache.peak_mapped_bytes / 2**20)
                    if want_preempt and cache.readmissions == 0:
                        why.append("no preemption happened")
                return dict(status="FAIL" if why else "PASS", why="; ".join(why),
                            max_rel_err=cmp["max_rel_err"], decisive=cmp["decisive"], top1_agree=cmp["top1_agree"],
                            **extra)
            record(arch, contender, fn)  # noqa: B023 - arch is this iteration's: record runs fn now

        base = {"max_batch_tokens": mbt}
        nblocks = 4096 if args.tiny else 2048
        for name, spec in CHECK.items():
            if is_vmem(spec):
                check(name, spec["attn"], base, vmem_options(spec))
            else:
                check(name, attention(spec), dict(base, block_size=spec["block_size"], num_blocks=nblocks // 16), {})
        c = model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        page_b = vmem.parse_bytes(page)
        tpp = page_b // (c.num_key_value_heads * hd * dtype.itemsize)
        blk = block_tokens(tpp, "fa")  # the default kernel's block
        ppb = 2 * c.num_hidden_layers * (blk // tpp)
        # Four rows each hold a block, then all cross into a second one with 3 free: preemption.
        pre_lengths, pre_new = [blk - 56] * 5, 112
        pre_mem = 8 * ppb * page_b
        pre_prompts = random_prompts(pre_lengths, model.config.vocab_size, seed=3)
        check("vmem-preempt", VMEM_ATTENTION, {"max_batch_tokens": mbt * 2}, {"memory": pre_mem, "max_requests": 4},
              prompts=pre_prompts, new=pre_new, stagger=None, want_preempt=True)

        def cross(runs: dict[str, Any] = runs) -> dict[str, Any]:
            if "vmem-per-layer" not in runs or "paged-sdpa-256" not in runs:
                return {"status": "FAIL", "why": "a run is missing"}
            e = cross_compare(runs["vmem-per-layer"], runs["paged-sdpa-256"])
            return {"status": "PASS" if e <= tol else "FAIL", "max_rel_err": e,
                        "why": "" if e <= tol else f"vmem vs paged|sdpa {e:.2e} > {tol}"}
        record(arch, "vmem-vs-paged-sdpa", cross)
        del model, runs, check, cross
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for kernel in (k for k in KERNELS if k not in FLASHINFER_KERNELS):  # FlashInfer is optional (test_gpu.py checks it)
        def pad(kernel: str = kernel) -> dict[str, Any]:
            return dict(padding_cost(device, dtype, args.tiny, kernel))
        record("llama-8b-heads", f"padding-cost({kernel})", pad)

    with open(os.path.join(args.out, "serving_check.json"), "w") as f:
        json.dump({"tol": tol, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    print()
    print(format_table([{"status": r["status"], "arch": r["arch"], "contender": r["contender"],
                         "max rel err": f"{r.get('max_rel_err', float('nan')):.2e}",
                         "top-1": f"{r.get('top1_agree', '-')}/{r.get('decisive', '-')}", "why": r.get("why", "")}
                        for r in rows], ["status", "arch", "contender", "max rel err", "top-1", "why"]))
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0

