"""The Python package on a CUDA GPU: checks that need one (scripts/python-gpu.sh run, on the GPU
machine, with torch and transformers). Without torch or a GPU every test here is skipped, and
pytest says why. Benchmarks are in python/benches (gpu_bench.py).

  dlpack_views: vmem views are cuda:N torch tensors at vmem's addresses, no copy (CuPy too).
  sdpa_equality: SDPA (flash, and math as reference) on vmem K/V views of both layouts equals
    the same call on contiguous copies: bit-exact.
  lifetime: a tensor keeps the cache alive after close() and del; its drop returns the memory.
  unmap_after_queued_kernel: a long kernel queued over a request's pages, then free (unmap);
    the kernel's result is right and the context still works; free waits for the kernel, or
    with background_unmap returns at once and the unmapping thread waits.
  vattention_api: vmem.vattention with torch on the GPU.
  hf_models: Llama-3-8B- and Qwen2-shaped models (random weights, bf16, few layers),
    left-padded prompts of different lengths; teacher-forced logits with VmemCache equal
    DynamicCache's within bf16 tolerance at every step; greedy tokens identical once the
    output head is scaled so logits are decisive.
  shared_prefix: prefix sharing on the GPU (2 MB pages, both layouts): a request that adopts
    another's published prompt reads the same physical pages (a write through one row shows
    through the other), SDPA flash over its row equals SDPA over a contiguous copy of the same
    K/V bit-exactly, its own tail never reaches the shared pages, the owner's free leaves them
    readable, and the pool holds each shared page once.
  zero_slots_under_queued_reads: the zero page on CUDA (issue #30, item 1). cuMemMap cannot
    map over a mapping, so replacing a zero slot unmaps it first; a kernel queued after the
    fence that reads the slot then faults. The rule: on CUDA a zero-backed cache maps on the
    thread that queues the kernels (zero_page with overlap is refused); under it, reads of a
    whole max_context row queued behind a long kernel, then steps that replace the row's zero
    slots, give exact sums and leave the context alive. Were the background mapper allowed,
    the same loop would run with it and fault.
  flashinfer_rows: kernel="flashinfer" (skipped without FlashInfer): its reader over vmem rows of
    both layouts (bf16 head dim 128, fp16 head dim 64; GQA), a decode round (the tensor-core
    decode wrapper) and a mixed round (the prefill wrapper), rows out of order, NaN in every
    mapped slot past a request's length: equals kernel="fa"'s reader within bf16/fp16
    tolerance, and the float32 paged reference of the same plan.
  flashinfer_graph_plan: FlashInfer's graph-mode plan over vmem's rows (skipped without
    FlashInfer) returns while a long kernel is queued (its page indices go to the device without
    a blocking copy, which would wait for the round in flight), and they reach its fixed buffer.
  split_decode: kernel="fa"'s padded decode rounds split along the keys (fa_split): six
    requests of 300-2,000 tokens in 64 slots, bf16, Llama-3-8B heads: equals FA2 over the whole
    rows within bf16 tolerance, padded rows zeros; captured in a CUDA graph, a replay after a new
    plan is written equals a fresh call on that plan; both timed (CUDA events, printed). The same
    with split_reader="triton" (vmem's slot kernel reading twice the sequences as slots), and
    with head dim 64 (Llama-3.2-1B's), 120 requests of ~1,000 tokens in 128 sequences.
  fa_mixed_round: kernel="fa"'s mixed rounds with the decodes in a call of their own (fa_mixed):
    a prompt chunk beside decodes, in two query orders, bf16, Llama-3's heads: equals the one
    varlen call within bf16 tolerance; planning returns while a long kernel is queued (pinned
    copies). rows_view: KVCache.rows() zeroes a block of every layer's K and V in one kernel.
  fp8_consumer: vmem views are torch.float8_e4m3fn tensors on the GPU; torch kernels write and
    read them (bytes round-trip), and dequantized SDPA on the views equals the same on
    contiguous copies, bit-exact, in both layouts.
"""

from __future__ import annotations

import gc
import itertools
import random
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here; scripts/python-gpu.sh runs these on the GPU")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here; scripts/python-gpu.sh runs these on the GPU machine", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import vmem  # noqa: E402


def check(name, ok, detail=""):
    """One claim of a test: printed (pytest -s shows the details), and asserted."""
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    assert ok, f"{name} {detail}"


def dlpack_views():
    kv = vmem.KVCache(layers=2, kv_heads=8, head_dim=128, dtype="bf16", max_batch=4,
                      max_context=4096, backend="cuda")
    k, v = kv.layer(1)
    K = torch.from_dlpack(k)
    check("dlpack device", K.device == torch.device("cuda", 0), str(K.device))
    check("dlpack no copy", K.data_ptr() == k.data_ptr, f"{K.data_ptr():#x} {k.data_ptr:#x}")
    r = kv.alloc()
    kv.step({r: 3000})
    K[r, :3000] = 1.5
    check("dlpack write/read", float(torch.from_dlpack(kv.layer(1)[0])[r, :3000].float().mean()) == 1.5)
    cp = None
    try:
        import cupy

        cp = cupy.from_dlpack(kv.layer(1)[0])
        check("cupy reads the view", float(cp[r, 2999, 7, 127].get()) == 1.5 and cp.data.ptr == k.data_ptr)
    except ImportError:
        print("SKIP cupy: not installed")
    del cp, K
    kv.close()


def sdpa_equality():
    torch.manual_seed(0)
    B, H, D, G = 4, 8, 128, 4  # Llama-3-8B: 8 KV heads, 32 query heads
    lens = [37, 1000, 2048, 513]
    L = max(lens)
    for layout in ["per-layer", "token-major"]:
        kv = vmem.KVCache(layers=4, kv_heads=H, head_dim=D, dtype="bf16", max_batch=B,
                          max_context=4096, layout=layout, backend="cuda", pad_rows=True,
                          overlap=False)
        ids = [kv.alloc() for _ in range(B)]
        kv.step({r: n for r, n in zip(ids, lens)})
        k, v = (torch.from_dlpack(t) for t in kv.layer(2))
        k[:B, :L].copy_(torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16))
        v[:B, :L].copy_(torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16))
        q = torch.randn(B, H * G, 1, D, device="cuda", dtype=torch.bfloat16)
        kq = k[:B, :L].transpose(1, 2)  # [B, H, L, D] strided views: no copy
        vq = v[:B, :L].transpose(1, 2)
        kc, vc = kq.contiguous(), vq.contiguous()
        for backend in [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.MATH]:
            with torch.nn.attention.sdpa_kernel(backend):
                a = F.scaled_dot_product_attention(q, kq, vq, enable_gqa=True)
                b = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            same = torch.equal(a, b)
            check(f"sdpa {backend.name.lower()} {layout} equals contiguous", same,
                  f"max diff {float((a.float() - b.float()).abs().max()):.3g}")
        # Prefill-shaped (causal, many queries).
        qp = torch.randn(B, H * G, 256, D, device="cuda", dtype=torch.bfloat16)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            a = F.scaled_dot_product_attention(qp, kq[:, :, :256], vq[:, :, :256], is_causal=True, enable_gqa=True)
            b = F.scaled_dot_product_attention(qp, kc[:, :, :256], vc[:, :, :256], is_causal=True, enable_gqa=True)
        check(f"sdpa flash causal {layout} equals contiguous", torch.equal(a, b))
        del k, v, kq, vq, kc, vc
        kv.close()


def lifetime():
    kv = vmem.KVCache(layers=1, kv_heads=8, head_dim=128, dtype="bf16", max_batch=2,
                      max_context=8192, backend="cuda")
    r = kv.alloc()
    kv.step({r: 8000})
    K = torch.from_dlpack(kv.layer(0)[0])
    K[r, :8000] = 2.0
    kv.close()
    del kv
    gc.collect()
    torch.cuda.synchronize()
    check("a tensor keeps the cache alive after close and del", float(K[r, :8000].float().sum()) == 2.0 * 8000 * 8 * 128)
    free0 = torch.cuda.mem_get_info()[0]
    del K
    gc.collect()
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    check("the last tensor's drop returns the memory", free1 > free0, f"{(free1 - free0) >> 20} MB back")


def close_with_live_context(kv, after):
    """Checks that the CUDA context still runs a kernel after `after`, then closes `kv`."""
    y = torch.ones(1024, device="cuda").sum()
    check(f"context alive after the {after}", float(y) == 1024.0)
    kv.close()


def unmap_after_queued_kernel(background):
    kv = vmem.KVCache(layers=1, kv_heads=8, head_dim=128, dtype="fp32", max_batch=2,
                      max_context=65536, backend="cuda", deferred_reclaim=False, overlap=False,
                      eager_tokens=0, background_unmap=background)
    r = kv.alloc()
    kv.step({r: 65536})
    K = torch.from_dlpack(kv.layer(0)[0])
    K[r].fill_(1.0)
    torch.cuda.synchronize()
    x = K[r]
    torch.cuda._sleep(2_000_000_000)  # ~1 s of queued GPU work ahead of the reads
    total = torch.zeros((), device="cuda")
    for _ in range(20):
        total += x.sum()
    t = time.perf_counter()
    kv.free(r)  # unmaps after the queued reads: here, or on the unmapping thread
    waited = time.perf_counter() - t
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t
    want = 20.0 * 65536 * 8 * 128
    check("queued kernel over freed pages: right result", float(total) == want,
          f"{float(total)} vs {want}; free waited {waited:.3f} s of {gpu_s:.3f} s of queued work")
    if background:
        check("free returns before the queued work ends", waited < gpu_s / 4, f"{waited:.3f} s")
        kv.wait_unmapped()
        check("the unmapping thread gave the pages back", kv.request_pages(r) == [0, 0], str(kv.request_pages(r)))
    else:
        check("free waits for the queued work", waited > gpu_s / 2, f"{waited:.3f} s")
    del K, x
    close_with_live_context(kv, "unmap")


def vattention_api():
    import vmem.vattention as va

    try:
        ts = va.init_kvcache(2, 8, 128, 4, 4096, "cuda:0", torch.bfloat16, 2 << 20)
        va.reserve_physical_pages(256 << 20)
        r = va.alloc_new_batch_idx(1000)
        lens = [0] * 4
        lens[r] = 1000
        va.step(lens)
        ts[0][r, :1000] = 1
        ts[3][r, :1000] = 2
        ok = float(ts[0][r, :1000].float().mean()) == 1 and float(ts[3][r, :1000].float().mean()) == 2
        check("vattention on cuda", ok and ts[0].is_cuda and len(ts) == 4, f"free blocks {va.num_free_kvblocks()}")
    finally:
        ts = None
        va.cleanup()  # a failed check must not leave the module's cache to the next test


def hf_models():
    import transformers
    from transformers import DynamicCache
    from vmem.hf import VmemCache

    configs = {
        "llama-3-8b (4 layers)": transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            num_hidden_layers=4, vocab_size=32000, max_position_embeddings=8192, rope_theta=500000.0),
        "qwen2-7b (4 layers)": transformers.Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
            num_hidden_layers=4, vocab_size=32000, max_position_embeddings=8192),
    }
    for name, cfg in configs.items():
        cfg.torch_dtype = torch.bfloat16
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
        B, steps = 4, 32
        plen = [7, 120, 300, 45]
        P = max(plen)
        ids = torch.randint(3, 32000, (B, P), device="cuda")
        mask = torch.zeros(B, P, dtype=torch.long, device="cuda")
        for i, n in enumerate(plen):
            ids[i, : P - n] = 0  # left padding
            mask[i, P - n:] = 1
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                                 past_key_values=DynamicCache(config=cfg))[:, P:]
            # Teacher forcing: both caches see the reference tokens; compare logits each step.
            worst = 0.0
            caches = {"dynamic": DynamicCache(config=cfg), "vmem": VmemCache(cfg, B, P + steps + 8)}
            logits = {}
            am = mask.clone()
            pos = (am.cumsum(-1) - 1).clamp(min=0)
            for cname, c in caches.items():
                logits[cname] = [model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=c, use_cache=True, logits_to_keep=1).logits[:, -1].float()]
            for s in range(steps - 1):
                tok = ref[:, s:s + 1]
                am = torch.cat([am, torch.ones(B, 1, dtype=am.dtype, device="cuda")], 1)
                pos = (am.cumsum(-1) - 1)[:, -1:]
                for cname, c in caches.items():
                    logits[cname].append(model(input_ids=tok, attention_mask=am, position_ids=pos, past_key_values=c, use_cache=True).logits[:, -1].float())
            for a, b in zip(logits["vmem"], logits["dynamic"]):
                scale = b.abs().max().item()
                worst = max(worst, (a - b).abs().max().item() / max(scale, 1e-6))
            check(f"hf {name}: teacher-forced logits match DynamicCache", worst < 2e-2, f"max rel diff {worst:.2e} over {steps} steps")
            # Decisive logits: scale the output head, then greedy tokens must be identical.
            model.lm_head.weight.mul_(50.0)
            g_ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                                   past_key_values=DynamicCache(config=cfg))[:, P:]
            vc = VmemCache(cfg, B, P + steps + 8)
            g_vm = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                                  past_key_values=vc)[:, P:]
            same = (g_ref == g_vm).float().mean().item()
            check(f"hf {name}: greedy tokens identical (decisive head)", same == 1.0, f"{same:.1%} equal; vmem holds {vc.memory()['mapped_bytes'] >> 20} MB")
        del model
        gc.collect()
        torch.cuda.empty_cache()


def fp8_consumer():
    """fp8 KV caches as engines keep them: e4m3 values in vmem, dequantized for attention."""
    torch.manual_seed(0)
    B, H, D, G, n = 2, 8, 128, 4, 3000
    for layout in ["per-layer", "token-major"]:
        kv = vmem.KVCache(layers=2, kv_heads=H, head_dim=D, dtype="fp8_e4m3", max_batch=B,
                          max_context=4096, layout=layout, backend="cuda", overlap=False)
        ids = [kv.alloc() for _ in range(B)]
        kv.step({r: n for r in ids})
        k, v = (torch.from_dlpack(t) for t in kv.layer(1))
        check(f"fp8 {layout}: torch sees float8_e4m3fn on cuda", k.dtype == torch.float8_e4m3fn and k.is_cuda,
              f"{k.dtype} {k.device}")
        src_k = (torch.randn(B, n, H, D, device="cuda") * 4).to(torch.float8_e4m3fn)
        src_v = (torch.randn(B, n, H, D, device="cuda") * 4).to(torch.float8_e4m3fn)
        k[:B, :n].copy_(src_k)  # a torch kernel writes fp8 into vmem memory
        v[:B, :n].copy_(src_v)
        same_bytes = torch.equal(k[:B, :n].view(torch.uint8), src_k.view(torch.uint8))
        check(f"fp8 {layout}: bytes written by torch read back", same_bytes)
        scale = 0.25
        q = torch.randn(B, H * G, 1, D, device="cuda", dtype=torch.bfloat16)
        kq = k[:B, :n].transpose(1, 2).to(torch.bfloat16) * scale  # dequantize from vmem
        vq = v[:B, :n].transpose(1, 2).to(torch.bfloat16) * scale
        kc = src_k.transpose(1, 2).contiguous().to(torch.bfloat16) * scale
        vc = src_v.transpose(1, 2).contiguous().to(torch.bfloat16) * scale
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            a = F.scaled_dot_product_attention(q, kq, vq, enable_gqa=True)
            b = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        check(f"fp8 {layout}: dequantized SDPA flash on vmem equals contiguous", torch.equal(a, b),
              f"max diff {float((a.float() - b.float()).abs().max()):.3g}")
        del k, v, kq, vq
        kv.close()


def shared_prefix():
    torch.manual_seed(0)
    H, D, G, n = 8, 128, 4, 3000
    for layout in ["token-major", "per-layer"]:
        kv = vmem.KVCache(layers=2, kv_heads=H, head_dim=D, dtype="bf16", max_batch=4, max_context=8192,
                          layout=layout, backend="cuda", overlap=False, eager_tokens=0, prefix_cache="1G")
        bt = kv.prefix_stats()["block_tokens"]
        prompt = torch.randint(0, 128000, (n,)).tolist()
        a = kv.alloc()
        kv.adopt_prefix(a, prompt)
        kv.step({a: n})
        layers = kv.torch_layers()
        for k, v in layers:
            k[a, :n].copy_(torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16))
            v[a, :n].copy_(torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        check(f"{layout} publish", kv.publish_prefix(a, prompt) == n // bt, f"{n // bt} blocks of {bt}")
        pages_before = kv.usage()["pool_created_pages"]
        b = kv.alloc()
        got = kv.adopt_prefix(b, torch.tensor(prompt + [5] * 100))
        check(f"{layout} adopt", got == n // bt * bt, f"{got} tokens")
        kv.step({a: n, b: n + 100})
        pages = kv.usage()["pool_created_pages"] - pages_before
        own = (-(-(n + 100) // bt) - got // bt) * kv.config()["buffers"]  # B's blocks past the adopted ones
        check(f"{layout} the adopted blocks cost no pages", pages == own, f"{pages} new pages, {own} expected")
        k, v = layers[1]
        # B's own tokens (from its adopted length on) go to its own pages only.
        k[b, got:n + 100].copy_(torch.randn(n + 100 - got, H, D, device="cuda", dtype=torch.bfloat16))
        v[b, got:n + 100].copy_(torch.randn(n + 100 - got, H, D, device="cuda", dtype=torch.bfloat16))
        a_tail = k[a, got:n].clone()
        torch.cuda.synchronize()
        check(f"{layout} B's tail does not reach A's row", torch.equal(k[a, got:n], a_tail))
        check(f"{layout} B reads A's K/V", torch.equal(k[b, :got], k[a, :got]) and torch.equal(v[b, :got], v[a, :got]))
        q = torch.randn(1, H * G, 1, D, device="cuda", dtype=torch.bfloat16)
        kq, vq = k[b:b + 1, :n + 100].transpose(1, 2), v[b:b + 1, :n + 100].transpose(1, 2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            x = F.scaled_dot_product_attention(q, kq, vq, enable_gqa=True)
            y = F.scaled_dot_product_attention(q, kq.contiguous(), vq.contiguous(), enable_gqa=True)
        check(f"{layout} sdpa flash over a shared row equals contiguous", torch.equal(x, y))
        k[a, 7].fill_(3.0)
        torch.cuda.synchronize()
        check(f"{layout} one physical page: a write through A shows through B", bool((k[b, 7] == 3.0).all()))
        kv.free(a)
        kv.step({b: n + 100})
        torch.cuda.synchronize()
        check(f"{layout} A's free leaves B's shared pages", bool((k[b, 7] == 3.0).all()))
        s = kv.prefix_stats()
        check(f"{layout} counters", s["hit_tokens"] == got and s["blocks"] == n // bt, str(s))
        del k, v, layers, kq, vq
        kv.close()


def zero_slots_under_queued_reads():
    # fp32, 1 head x 128: 512 B a token, 4,096 tokens a 2 MB page, 8 pages a row.
    shape = dict(layers=1, kv_heads=1, head_dim=128, dtype="fp32", max_batch=2, max_context=32768,
                 backend="cuda", eager_tokens=0, deferred_reclaim=False, zero_page=True)
    try:
        kv = vmem.KVCache(**shape, overlap=True)
        refused = None
    except vmem.InvalidArgument as e:
        kv, refused = None, str(e)
    check("zero_page with overlap refused on cuda", refused is not None and "overlap" in refused, str(refused))
    if kv is None:
        kv = vmem.KVCache(**shape, overlap=False)
    tpp = int(kv.config()["tokens_per_page"])
    r = kv.alloc()
    K = torch.from_dlpack(kv.layer(0)[0])
    row = K[r]  # the whole max_context row: past the request's length it reads zero slots
    acc = torch.zeros((), dtype=torch.float64, device="cuda")
    want = 0
    for n in range(tpp, 32768 + 1, tpp):
        kv.step({r: n})  # replaces a zero slot that the reads queued below still cover
        K[r, n - tpp:n] = 1.0
        torch.cuda._sleep(50_000_000)  # queued GPU work ahead of the reads: the next step waits
        for _ in range(4):
            acc += row.sum(dtype=torch.float64)
        want += 4 * n * 128
    torch.cuda.synchronize()
    check("reads of zero slots around steps: exact sums", float(acc) == want, f"{float(acc)} vs {want}")
    del K, row
    close_with_live_context(kv, "swaps")


def flashinfer_rows():
    from vmem.kernels.fa import FaReader
    from vmem.kernels.fi_reader import FlashInferReader
    from vmem.kernels.flashinfer import paged_plan, paged_reference
    from vmem.kernels.rounds import Round

    g = torch.Generator(device="cuda").manual_seed(0)
    rounds = {"decode": [(5, 3000, 1), (0, 17, 1), (3, 1023, 1), (1, 4000, 1)],
              "mixed": [(5, 2000, 1), (2, 0, 300), (0, 700, 1), (4, 100, 64), (1, 3999, 1)]}
    lens = {r: max(p + q for rr, p, q in sum(rounds.values(), []) if rr == r) for r in range(6)}
    # (dtype, query heads, KV heads, head dim, max_context: a row is whole 2 MB pages in both layouts)
    for dtype, hq, hkv, d, ctx in [(torch.bfloat16, 32, 8, 128, 4096), (torch.float16, 8, 2, 64, 8192)]:
        for layout in ["per-layer", "token-major"]:
            kv = vmem.KVCache(layers=2, kv_heads=hkv, head_dim=d, dtype="bf16" if dtype == torch.bfloat16 else "fp16",
                              max_batch=6, max_context=ctx, layout=layout, backend="cuda", overlap=False)
            rows = [kv.alloc() for _ in range(6)]
            check("flashinfer test rows are 0..5", rows == list(range(6)), str(rows))
            kv.step(lens)
            tpp = int(kv.config()["tokens_per_page"])
            layers = [tuple(torch.from_dlpack(t) for t in kv.layer(i)) for i in range(2)]
            k0 = layers[0][0]
            check(f"flashinfer {layout} rows are max_context tokens apart", k0.stride(0) == ctx * k0.stride(1))
            fi = FlashInferReader(ctx, lambda i, layers=layers: layers[i], torch.device("cuda"), hq)
            fa = FaReader(ctx)
            for name, entries in rounds.items():
                now = {r: p + q for r, p, q in entries}
                for k4, v4 in layers:
                    for r, n in lens.items():
                        mapped = -(-n // tpp) * tpp
                        k4[r, :mapped] = float("nan")  # NaN past this round's length: never read
                        v4[r, :mapped] = float("nan")
                        m = now.get(r, 0)
                        k4[r, :m] = torch.randn(m, hkv, d, device="cuda", dtype=dtype, generator=g)
                        v4[r, :m] = torch.randn(m, hkv, d, device="cuda", dtype=dtype, generator=g)
                total = sum(e[2] for e in entries)
                a, b = Round(), Round()
                a.entries = [(r, p, q, None) for r, p, q in entries]
                b.entries = list(a.entries)
                for layer, (k4, v4) in enumerate(layers):
                    query = torch.randn(1, hq, total, d, device="cuda", dtype=dtype, generator=g)
                    kf = k4.as_strided((k4.shape[0] * ctx, hkv, d), k4.stride()[1:])
                    vf = v4.as_strided((v4.shape[0] * ctx, hkv, d), v4.stride()[1:])
                    got = fi(layer, a, query, kf, vf, 0.1, True)[0]
                    want = fa(layer, b, query, kf, vf, 0.1, True)[0]
                    # The reference reads whole pages (rows): give it host copies of what is mapped
                    # (on the GPU the rows' unmapped tails would fault).
                    kc, vc = (torch.zeros(t.shape, dtype=torch.float32) for t in (k4, v4))
                    for r, n in now.items():
                        kc[r, :n], vc[r, :n] = k4[r, :n].float().cpu(), v4[r, :n].float().cpu()
                    ref = paged_reference(query[0].transpose(0, 1).float().cpu(), kc, vc,
                                          paged_plan(entries, ctx), 0.1).cuda()
                    label = f"flashinfer {name} {layout} {dtype} hd{d} layer {layer}"
                    check(f"{label} finite", bool(torch.isfinite(got).all()))
                    e_fa = float((got.float() - want.float()).abs().max())
                    e_ref = float((got.float() - ref).abs().max())
                    check(f"{label} vs fa", e_fa < 2e-2, f"max diff {e_fa:.3g}")
                    check(f"{label} vs fp32 reference", e_ref < 2e-2, f"max diff {e_ref:.3g}")
                check(f"flashinfer {name} round planned for the {'decode' if name == 'decode' else 'prefill'} "
                      "wrapper", a.index.plan.decode == (name == "decode"))
                pages = a.index.plan.kv_indptr.tolist()
                check(f"flashinfer {name} rows read as 256-token pages (split-KV can divide them)",
                      a.index.plan.page_size == 256 and pages[-1] > len(pages) - 1, str(pages))
            del layers, fi, k0
            kv.close()


def test_flashinfer_rows():
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed (pip install \"vmem-kv[flashinfer]\")")
    flashinfer_rows()


def test_flashinfer_graph_plan_does_not_wait_for_queued_work():
    fi = pytest.importorskip("flashinfer", reason="FlashInfer is not installed (pip install \"vmem-kv[flashinfer]\")")
    from vmem.kernels import fi_graphs
    from vmem.kernels.flashinfer import paged_plan

    ctx = 4096
    ws = fi_graphs.WrapperSet(fi, torch.device("cuda"), fi_graphs.workspace_bytes(True, 64, 32, 128), 32, 8, 128,
                              torch.bfloat16, max_pages=ctx // 256)
    plan = paged_plan([(0, 100, 1), (3, 300, 1), (1, 2000, 1)], ctx)  # a decode round
    ws.plan(plan, pair=0, graph=True, scale=0.1)  # the first plan builds (JIT) and makes the wrapper
    torch.cuda.synchronize()
    key = (0, plan.decode, int(plan.kv_last_page_len.numel()), plan.total_q)
    indices = ws.buffers[key][1]
    indices.fill_(-1)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued, as a round in flight
    start = time.perf_counter()
    ws.plan(plan, pair=0, graph=True, scale=0.1)
    took = time.perf_counter() - start
    check("a graph-mode plan returns while queued work runs (no blocking copy)", took < 0.3, f"{took * 1e3:.1f} ms")
    torch.cuda.synchronize()
    n = plan.kv_indices.numel()
    check("the plan's page indices reached the wrapper's fixed buffer after the queued work",
          indices[:n].cpu().tolist() == plan.kv_indices.tolist())


def test_fa_mixed_round_matches_one_call(monkeypatch):
    """A mixed round (a prompt chunk beside decodes) with its decodes in a call of their own
    (:mod:`vmem.kernels.fa_mixed`: FlashAttention-2's grouped-head decode path, or vmem's slot
    kernel over a slot plan of the decodes' own) gives the one varlen call's output, bf16,
    Llama-3's 32 query and 8 KV heads, in any query order."""
    from vmem.kernels import fa_mixed
    from vmem.kernels.fa import fa_varlen_indices, varlen

    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)  # rounds this small are split too
    mc, dev = 2048, torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(8 * mc, 8, 128, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(8 * mc, 8, 128, generator=g).to(dev, torch.bfloat16)
    for entries, slots in itertools.product(([(0, 1500, 1), (1, 900, 1), (2, 0, 700), (3, 300, 200)],
                                             [(2, 0, 700), (0, 1500, 1), (3, 300, 200), (1, 900, 1), (4, 2046, 1)]),
                                            (False, True)):
        whole = fa_varlen_indices(entries, mc).to(dev)
        mixed = fa_mixed.plan_mixed(entries, mc, dev, whole=whole, slots=slots)
        check("the round is split", mixed is not None and (mixed.slots is not None) is slots)
        q = torch.randn(whole.total_q, 32, 128, generator=g).to(dev, torch.bfloat16)
        one, two = varlen(q, k, v, whole, None), fa_mixed.attend(q, k, v, mixed, None, varlen)
        diff = float((one.float() - two.float()).abs().max())
        how = "vmem's slot kernel" if slots else "FA2"
        check(f"the split (decodes read by {how}) equals the one call", diff < 2e-2, f"largest difference {diff:.3g}")
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued, as a round in flight
        start = time.perf_counter()
        fa_mixed.plan_mixed(entries, mc, dev, whole=whole)  # what the reader does at an eager round's first layer
        took = time.perf_counter() - start
        check("planning a round returns while queued work runs (pinned copies)", took < 0.3, f"{took * 1e3:.1f} ms")
        torch.cuda.synchronize()


def test_fa_prompts_match_flash_attention(monkeypatch):
    """``prompt_reader="flashinfer"``: FlashInfer's prefill (its Hopper backend on Hopper) reading
    an eager round's prompts in vmem's rows in place, token-major strides of 32 layers, bf16,
    Llama-3's heads: prompts alone (fresh and continued chunks), a padded round (zeros past the
    requests), a mixed round split (decodes by the slot kernel) and one not split, each equal to
    FlashAttention-2's one call; planning returns while queued work runs."""
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed (vmem-kv[flashinfer])")
    from vmem.kernels import fa_mixed, fa_prompts, fa_split
    from vmem.kernels.buffers import RoundBuffers
    from vmem.kernels.fa import FaReader, fa_varlen_indices, varlen
    from vmem.kernels.rounds import Round

    mc, dev, layers = 4096, torch.device("cuda"), 32
    g = torch.Generator(device="cpu").manual_seed(0)
    whole = torch.randn(9 * mc, 2 * layers * 8, 128, device=dev, dtype=torch.bfloat16,
                        generator=torch.Generator(device=dev).manual_seed(0))
    k, v = whole[:, 8:16], whole[:, 24:32]  # one layer's K and V heads
    prompts = fa_prompts.PromptReader(mc, dev, 32, 8, 128, torch.bfloat16)
    check("the Hopper backend on Hopper", (prompts.backend == "fa3") == (torch.cuda.get_device_capability()[0] == 9),
          prompts.backend)
    rounds = {"prompts": [(0, 0, 1800), (1, 0, 700), (2, 1200, 900), (3, 0, 37), (4, 300, 2000)],
              "padded": [(5, 0, 1000), (6, 64, 500)],
              "mixed, split": [(0, 3000, 1), (1, 0, 1500), (2, 2500, 1), (7, 100, 300), (3, 4000, 1)],
              "mixed, one call": [(0, 10, 1), (1, 0, 800), (2, 20, 1)]}
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 2000)
    for pair, (name, entries) in enumerate(rounds.items()):
        tokens = sum(e[2] for e in entries)
        total = tokens + (100 if name == "padded" else 0)
        q = torch.randn(total, 32, 128, generator=g).to(dev, torch.bfloat16)
        index = fa_varlen_indices(entries, mc).to(dev)
        want = varlen(q[:tokens].contiguous(), k, v, index, None)
        rnd = Round()
        rnd.entries = [(r, p, n, None) for r, p, n in entries]
        rnd.pair = pair % 2
        if total > tokens:  # the engine's padding, in the round's metadata (row 8 the trash row)
            rnd.meta = RoundBuffers(8, mc, 8, dev, max_tokens=total).fill(entries, sequences=8, tokens=total,
                                                                          padded=True, bucket_k=mc)
        reader = FaReader(mc, splits=fa_split.SplitBuffers(16, dev, slot_kernel=True), prompts=prompts)
        got = reader(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, None, True)[0]
        split = isinstance(rnd.index, fa_mixed.MixedRound)
        read = rnd.index.prompts if split else rnd.index
        diff = float((got[:tokens].float() - want.float()).abs().max())
        check(f"{name}: FlashInfer read the prompts{' (decodes by the slot kernel)' if split else ''} as FA2 does",
              isinstance(read, fa_prompts.PromptPlan) and split == (name == "mixed, split") and diff < 2e-2,
              f"largest difference {diff:.3g}")
        if total > tokens:
            check(f"{name}: the padded tokens are zeros", bool((got[tokens:] == 0).all()))
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued, as a round in flight
        start = time.perf_counter()
        prompts.plan(entries, pair=pair % 2, scale=None)
        took = time.perf_counter() - start
        check(f"{name}: planning returns while queued work runs (pinned copies)", took < 0.3, f"{took * 1e3:.1f} ms")
        torch.cuda.synchronize()


def test_zero_slots_under_queued_reads():
    zero_slots_under_queued_reads()


def test_shared_prefix():
    shared_prefix()


def test_dlpack_views():
    dlpack_views()


def test_rows_view_zeroes_a_block_of_every_layer_in_one_kernel():
    """The token-major rows view on CUDA (``KVCache.rows()``): one ``index_fill_`` over its block
    view zeroes a block of a row in every layer's K and V, and nothing past it (the serving
    cache's zeroing of a round's fresh blocks)."""
    from vmem.kernels.blocks import FreshBlocks

    kv = vmem.KVCache(layers=4, kv_heads=8, head_dim=128, dtype="bf16", max_batch=3, max_context=4096,
                      layout="token-major", backend="cuda")
    r = kv.alloc()
    kv.step({r: 64})  # one 2 MB page: 128 tokens of all four layers
    rows = torch.from_dlpack(kv.rows())
    check("rows view shape", tuple(rows.shape) == (3, 4096, 64, 128), str(tuple(rows.shape)))
    layers = kv.torch_layers()
    for k, v in layers:
        k[r, :64] = float("nan")
        v[r, :64] = float("nan")
    fresh = FreshBlocks([rows], 16, torch.device("cuda"))
    check("one block zeroed", fresh.zero([(r, 16, 32)]) == 1)
    torch.cuda.synchronize()
    block = [(k[r, 16:32], v[r, 16:32]) for k, v in layers]
    rest = [(k[r, :16], v[r, 32:64]) for k, v in layers]
    check("the block reads zeros in every layer's K and V",
          all(bool((a == 0).all()) and bool((b == 0).all()) for a, b in block))
    check("the tokens around it keep their NaN", all(bool(a.isnan().all()) and bool(b.isnan().all()) for a, b in rest))
    del rows, layers, block, rest
    kv.close()


def test_sdpa_equality():
    sdpa_equality()


def test_lifetime():
    lifetime()


@pytest.mark.parametrize("background", [False, True])
def test_unmap_after_queued_kernel(background):
    unmap_after_queued_kernel(background)


def test_vattention_api():
    vattention_api()


def test_hf_models():
    pytest.importorskip("transformers", reason="transformers is not installed")
    hf_models()


def test_fp8_consumer():
    fp8_consumer()


def cb_graphs():
    """transformers' continuous batching with CUDA graphs on (kernel="fa", both layouts, async
    batching too): greedy tokens identical to graphs off, graphs replayed, nothing left mapped."""
    from harness import check as hc
    from harness import engine as he

    import vmem.transformers as vt

    replays = [0]
    real = torch.cuda.CUDAGraph.replay

    def replay(self):
        replays[0] += 1
        real(self)

    torch.cuda.CUDAGraph.replay = replay
    vt.install(memory="512M", max_requests=8, max_context=2048)
    try:
        model = hc.make_model("llama-gqa", torch.bfloat16, "cuda", logit_scale=20.0)
        prompts = hc.make_prompts(6, [5, 140, 700, 17, 33, 300], model.config.vocab_size)

        def tokens(cb, **opts):
            replays[0] = 0
            run = he.run_engine(model, vt.VMEM_ATTENTION, prompts, 12, serving=opts or None,
                                cb_kwargs=dict(max_batch_tokens=256, **cb))
            assert run["cache"].usage()["rows_in_use"] == 0
            return [list(run["results"][i].generated_tokens) for i in run["ids"]], replays[0]

        off, _ = tokens({"use_cuda_graph": False})
        for label, cb, opts in (("per-layer", {"use_cuda_graph": True}, {}),
                                ("token-major", {"use_cuda_graph": True}, {"layout": "token-major"}),
                                ("async", {"use_cuda_graph": True, "use_async_batching": True}, {})):
            on, n = tokens(cb, **opts)
            same = sum(a == b for a, b in zip(on, off))
            check(f"cb graphs {label}: greedy tokens identical to graphs off, graphs replayed",
                  same == len(prompts) and n > 0, f"{same}/{len(prompts)} identical, {n} replays")
    finally:
        torch.cuda.CUDAGraph.replay = real
        vt.uninstall()


def test_cb_graphs():
    pytest.importorskip("transformers", reason="transformers is not installed")
    cb_graphs()


def cb_compile(kernel: str = "fa", split_reader: str | None = "fa", prompt_reader: str = "fa"):
    """The engine's compiled forward with vmem (Inductor, token-major, ``kernel``): with CUDA graphs and async
    batching, greedy tokens identical to the compiled forward without graphs, graphs replayed,
    Dynamo's graphs compiled; compiled without graphs, top-1 agreement with a plain forward at
    every decisive position (bf16: Inductor's fused norms round differently from eager, so a
    near tie may flip against an uncompiled run). Nothing left mapped. With
    ``split_reader`` ``None`` (the default) or ``"triton"``, vmem's slot kernel read the graphed
    decode rounds. With ``prompt_reader="flashinfer"`` (and ``graph_max_tokens`` 64, so prefill
    rounds run eagerly under graphs too), FlashInfer's prefill read the eager rounds' prompts."""
    import transformers
    from harness import check as hc
    from harness import engine as he

    import vmem.transformers as vt

    replays, compiled = [0], [0]
    real = torch.cuda.CUDAGraph.replay

    def replay(self):
        replays[0] += 1
        real(self)

    def inductor(gm, example_inputs):
        compiled[0] += 1
        return torch._inductor.compile(gm, example_inputs)

    from vmem.kernels import _triton_decode, fa_fi, fa_split

    decode_min, reads_with_flashinfer, routes = fa_fi.DECODE_MIN, fa_fi.FaFlashInferReader.reads_with_flashinfer, []
    attend_slots, slot_calls = _triton_decode.attend_slots, [0]

    def counted_slots(*a, **k):
        slot_calls[0] += 1
        return attend_slots(*a, **k)

    def routed(self, rnd, padded):
        fi = reads_with_flashinfer(self, rnd, padded)
        routes.append((padded, all(q == 1 for _, _, q, _ in rnd.entries), fi))
        return fi

    torch.cuda.CUDAGraph.replay = replay
    try:
        # kernel="fa+flashinfer": a query padding of 2 makes decode rounds of 1-2 requests 2
        # sequences and of 3-4 requests 4, and decode_min 4 reads the first with FA, the second
        # with FlashInfer: graphs of both kinds in one run
        fa_fi.DECODE_MIN = 4
        fa_fi.FaFlashInferReader.reads_with_flashinfer = routed
        _triton_decode.attend_slots = counted_slots
        prompts = {"prompt_reader": prompt_reader, "graph_max_tokens": 64} if prompt_reader != "fa" else {}
        vt.install(memory="512M", max_requests=8, max_context=2048, layout="token-major", kernel=kernel,
                   split_reader=split_reader, **prompts)
        arch = "llama-gqa" if kernel == "fa" and prompt_reader == "fa" else "hd64-tied"  # FlashInfer: 64 or 128
        model = hc.make_model(arch, torch.bfloat16, "cuda", logit_scale=20.0)
        prompts = hc.make_prompts(6, [5, 140, 700, 17, 33, 300], model.config.vocab_size)
        config = transformers.CompileConfig(mode="default", fullgraph=False, dynamic=True, backend=inductor)

        def serve(graphs, capture_logits=False):
            replays[0] = 0
            cb = dict(max_batch_tokens=256, varlen_compile_config=config, use_cuda_graph=graphs,
                      use_async_batching=graphs)
            if kernel == "fa+flashinfer":
                cb["q_padding_interval_size"] = 2
            run = he.run_engine(model, vt.VMEM_ATTENTION, prompts, 12, cb_kwargs=cb, capture_logits=capture_logits)
            assert run["cache"].usage()["rows_in_use"] == 0
            return run, [list(run["results"][i].generated_tokens) for i in run["ids"]], replays[0]

        t = time.perf_counter()
        plain_run, plain, _ = serve(False, capture_logits=True)
        cmp = hc.compare(plain_run, model, 12)
        check(f"cb compile ({kernel}): top-1 agreement with a plain forward at every decisive position",
              cmp["counts_ok"] and cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"] and compiled[0] > 0,
              f"{cmp['top1_agree']}/{cmp['decisive']}, max rel err {cmp['max_rel_err']:.3g}, {compiled[0]} graphs "
              f"compiled, {time.perf_counter() - t:.1f} s")
        graph_run, on, n = serve(True)
        same = sum(a == b for a, b in zip(on, plain))
        check(f"cb compile ({kernel}, split_reader={split_reader}) + graphs + async: greedy tokens identical to "
              "compiled without graphs, graphs replayed",
              same == len(prompts) and n > 0, f"{same}/{len(prompts)} identical, {n} replays")
        if split_reader != "fa":
            split_buffers = graph_run["cache"].read.splits
            check(f"split_reader={split_reader!r}: the slot kernel read the graphed decode rounds",
                  slot_calls[0] > 0 and split_buffers is not None and split_buffers.slot_kernel
                  and split_buffers.per_row == fa_split.SLOTS_PER_ROW, f"{slot_calls[0]} calls")
        if prompt_reader != "fa":
            reader = graph_run["cache"].read.prompts
            check(f"prompt_reader={prompt_reader!r}: FlashInfer read the eager rounds' prompts under graphs",
                  reader.plans > 0 and (reader.backend == "fa3") == (torch.cuda.get_device_capability()[0] == 9)
                  and reader.pairs_planned == [0, 1],
                  f"{reader.plans} rounds planned, backend {reader.backend}, IO pairs {reader.pairs_planned}")
        if kernel == "fa+flashinfer":
            wrappers = graph_run["cache"].read.fi.wrappers
            kinds = sorted({decode for _, decode, _, _ in wrappers.wrappers}) if wrappers else []
            check("fa+flashinfer: FlashInfer planned the decode rounds only", wrappers is not None
                  and wrappers.plans > 0 and kinds == [True], f"{wrappers.plans if wrappers else 0} plans, decode "
                  f"kinds {kinds}")
            graphed = [(decode, fi) for padded, decode, fi in routes if padded and decode]
            check("fa+flashinfer: padded decode rounds read by both kernels",
                  any(fi for _, fi in graphed) and not all(fi for _, fi in graphed),
                  f"{sum(fi for _, fi in graphed)} of {len(graphed)} through FlashInfer")
    finally:
        fa_fi.DECODE_MIN, fa_fi.FaFlashInferReader.reads_with_flashinfer = decode_min, reads_with_flashinfer
        _triton_decode.attend_slots = attend_slots
        torch.cuda.CUDAGraph.replay = real
        vt.uninstall()


@pytest.mark.parametrize("kernel", ["fa", "flashinfer", "fa+flashinfer"])
def test_cb_compile(kernel):
    pytest.importorskip("transformers", reason="transformers is not installed")
    if kernel != "fa":
        pytest.importorskip("flashinfer", reason="FlashInfer is not installed (vmem-kv[flashinfer])")
    cb_compile(kernel)


@pytest.mark.parametrize("split_reader", [None, "triton"])
def test_cb_compile_slot_kernel(split_reader):
    pytest.importorskip("transformers", reason="transformers is not installed")
    cb_compile("fa", split_reader=split_reader)


def test_cb_compile_flashinfer_prompts():
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed (vmem-kv[flashinfer])")
    cb_compile("fa", split_reader="triton", prompt_reader="flashinfer")


def split_decode(slot_kernel: bool = False, d: int = 128, lengths: list[int] | None = None):
    from vmem.kernels import fa_split
    from vmem.kernels.buffers import RoundBuffers

    torch.manual_seed(0)
    lengths = lengths or [850, 300, 2000, 900, 1200, 640]
    hq, hkv, mc = 32, 8, 4096
    slots = max(64, -(-len(lengths) // 64) * 64)  # the engine's padded decode round
    rows = len(lengths) + 1  # the requests and the trash row
    how = "slot kernel" if slot_kernel else "FA"
    k = torch.randn(rows * mc, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows * mc, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(slots, hq, d, device="cuda", dtype=torch.bfloat16)
    buffers = RoundBuffers(slots, mc, rows - 1, torch.device("cuda"), max_tokens=slots)
    split_buffers = fa_split.SplitBuffers(slots, torch.device("cuda"), slot_kernel=slot_kernel)
    if slot_kernel:
        fa_split.check_slot_kernel(torch.device("cuda"), d)

    def plan(lengths):
        entries = [(i, u - 1, 1) for i, u in enumerate(lengths)]
        meta = buffers.fill(entries, sequences=len(entries), tokens=slots, padded=True, bucket_k=mc, decode=True)
        return meta, split_buffers.fill(entries, slots, mc, None)

    def whole(meta):
        return torch.ops.aten._flash_attention_forward(q, k, v, meta.cu_q, meta.cu_k, 1, meta.max_k, 0.0, True,
                                                       False, scale=d ** -0.5, seqused_k=meta.used)[0]

    meta, split = plan(lengths)
    want, got = whole(meta), fa_split.attend(q, k, v, split, meta.max_k, d ** -0.5)
    err = (got.float() - want.float()).abs().max().item()
    n = len(lengths)
    check(f"split decode ({how}, head dim {d}) equals FA over whole rows",
          err < 2e-2 and max(split.host_part(4)) > 1 and split.slot_kernel == slot_kernel,
          f"max abs err {err:.2e}, slots per request {split.host_part(4)[:6]}")
    check(f"split decode ({how}): padded rows are zeros", bool((got[n:] == 0).all()))

    def replay_us(fn, n=200):
        """GPU time of one call of ``fn`` replayed from a CUDA graph (no launch cost: as served)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compiles and loads every kernel outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n * 1e3
    t_whole = replay_us(lambda: whole(meta))
    t_split = replay_us(lambda: fa_split.attend(q, k, v, split, meta.max_k, d ** -0.5))
    need = sum(lengths) * hkv * d * 2 * 2  # the K and V bytes the round reads
    print(f"split decode ({how}, head dim {d}, {n} requests), GPU time a layer (graph replays): FA over whole rows "
          f"{t_whole:.1f} us, split {t_split:.1f} us ({t_whole / t_split:.2f}x; {need / t_split / 1e3:.0f} GB/s)",
          flush=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fa_split.attend(q, k, v, split, meta.max_k, d ** -0.5)  # compiles the merge kernel outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa_split.attend(q, k, v, split, meta.max_k, d ** -0.5)
    meta2, split2 = plan([3000, 129, 1, 400])  # a new plan into the same buffers (fewer requests)
    graph.replay()
    torch.cuda.synchronize()
    fresh = whole(meta2)
    err2 = (captured.float() - fresh.float()).abs().max().item()
    check(f"split decode ({how}) under a CUDA graph: a replay reads the round's own plan", err2 < 2e-2,
          f"max abs err {err2:.2e} against FA over the new round's rows")


def test_split_decode():
    split_decode()


def test_split_decode_slot_kernel():
    split_decode(slot_kernel=True)
    rng = random.Random(1)  # Llama-3.2-1B's heads; a round of every request fitting
    split_decode(slot_kernel=True, d=64, lengths=[rng.randint(200, 2000) for _ in range(120)])
