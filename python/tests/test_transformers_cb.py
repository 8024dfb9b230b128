"""vmem.transformers under transformers' continuous batching, on the CPU (fp32, host backend).

Needs torch and a transformers vmem serves (5.17.x or 5.19-5.23; CI runs these under 5.17 and
5.23; without torch they are skipped, and ``python/benches/serving_check.py`` runs the same checks
on the GPU in bf16). Logits of every request, teacher-forced on the engine's own tokens, are
compared with a plain ``DynamicCache`` forward, and with the engine's own paged path
(``paged|sdpa`` on 5.17, ``sdpa`` on 5.19+), whose greedy tokens vmem's must equal."""

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch); benches/serving_check.py runs these on the GPU")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import blockflex
from harness import check as h

import vmem
import vmem.transformers as vt
from vmem.kernels import varlen as vt_fa
from vmem.transformers import versions as vt_versions

TOL = 1e-4  # fp32 on the CPU, relative to the largest logit
NEW = 4
# Prompt lengths cross blocks (256 tokens per-layer, 128 token-major) and Flex's 128-token blocks.
LENGTHS = [5, 140, 270, 17, 33, 64]
OPTS = dict(page_size="64K", max_requests=4, max_context=1024, memory="8M")


@pytest.fixture(autouse=True)
def _installed():
    h.fake_cpu_memory()
    vt.install(**OPTS)
    yield
    vt.uninstall()


def _check_clean(cache):
    """Nothing a finished or preempted request held stays mapped: only the trash row is."""
    u = cache.usage()
    assert u["rows_in_use"] == 0 and u["blocks_in_use"] == 0, u
    assert u["active_requests"] == 1, u  # the trash row
    assert u["mapped_bytes"] == cache.trash_bytes(), u
    assert cache.get_num_free_blocks() == cache.num_blocks


def _check_run(run, model, label):
    cmp = h.compare(run, model, NEW)
    assert cmp["counts_ok"], (label, cmp["requests"])
    assert cmp["max_rel_err"] < TOL, (label, cmp["max_rel_err"])
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], (label, cmp)
    return cmp


@pytest.mark.parametrize("arch", h.ARCHS)
def test_logits_match_paged_and_dynamic_cache(arch):
    """Chunked prefill (32-token budget), requests joining mid-run, streaming through the manager."""
    model = h.make_model(arch, torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    stagger = [0, 0, 0, 3, 6, 9]  # the last three join after that many results came back
    cbk = dict(max_batch_tokens=64)
    ours = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=cbk, stagger=stagger, streaming=True)
    _check_run(ours, model, "vmem")
    assert all(n == NEW for n in ours["streamed"].values()), ours["streamed"]
    _check_clean(ours["cache"])
    theirs = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=dict(cbk, **eng.engine_block(32), num_blocks=256),
                          stagger=stagger)
    _check_run(theirs, model, eng.ENGINE_SDPA)
    for rid in ours["ids"]:  # greedy: the same tokens as the engine's own path
        assert list(ours["results"][rid].generated_tokens) == list(theirs["results"][rid].generated_tokens)
    assert h.cross_compare(ours, theirs) < TOL


@pytest.mark.parametrize("kernel", ["fa", "flex"])  # "flashinfer": test_transformers_flashinfer.py
def test_token_major_layout(kernel, monkeypatch):
    calls = []
    real = vt_fa.fa_varlen_reference
    monkeypatch.setattr(vt_fa, "fa_varlen_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    with vt.serving(layout="token-major", kernel=kernel):
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(max_batch_tokens=64))
    cache = run["cache"]
    assert cache.layout == "token-major" and cache.kernel == kernel and cache.tokens_per_page == 64
    if kernel == "fa":  # FA reads exact lengths: a block is one page
        assert cache.block_size == 64 and cache.pages_per_block == 1
        layers = model.config.num_hidden_layers  # one call per layer per round (the CPU stand-in for the FA op)
        assert calls and len(calls) % layers == 0 and len(calls) >= run["rounds"] * layers, (len(calls), run["rounds"])
    else:  # Flex reads whole 128-token KV blocks
        assert cache.block_size == 128 and cache.pages_per_block == 2
        assert not calls
    _check_run(run, model, "token-major")
    _check_clean(cache)


def test_flex_kernel_matches():
    """``kernel="flex"`` (the BlockMask path, dense reference on the CPU) stays a working option."""
    with vt.serving(kernel="flex"):
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(max_batch_tokens=64),
                           stagger=[0, 0, 0, 3, 6, 9])
    assert run["cache"].kernel == "flex"
    _check_run(run, model, "flex")
    _check_clean(run["cache"])


def test_kernel_option_is_checked():
    with pytest.raises(vmem.InvalidArgument, match="kernel"):
        vt.install(kernel="sdpa")
    cache, _ = _cache()
    assert cache.kernel == "fa"  # the default


def test_preemption_under_memory_pressure():
    """A budget of 7 blocks for requests (256 tokens each), 4 rows: four 200-token requests hold
    a block each, then all cross into a second block together (4 needed, 3 free): the engine's
    scheduler preempts (soft reset) and readmits; logits still match."""
    with vt.serving(memory=str(8 * 4 * 65536), max_requests=4):  # 8 blocks of 4 pages, one is the trash row
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        lengths = [200] * 5
        prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
        new = 80
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, new, cb_kwargs=dict(max_batch_tokens=64))
    cache = run["cache"]
    assert cache.num_blocks == 7
    cmp = h.compare(run, model, new)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cache.readmissions > 0, "expected at least one preemption"
    # The benches' count, the same for every cache, is the engine's: it agrees with vmem's own.
    assert run["evictions"] == cache.readmissions
    _check_clean(cache)


def test_the_engines_own_cache_preempts_under_the_same_pressure_and_is_counted():
    """The engine's own paged cache with the blocks vmem had above (7 of 256 tokens): its
    preemptions are counted by the benches' wrapper (its cache keeps no count of them), and the
    wrapper comes off after the run."""
    from transformers.generation.continuous_batching import offloading_manager as om

    original = om.OffloadingManager.__dict__["offload_requests"]
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(5, [200] * 5, model.config.vocab_size)
    run = h.run_engine(model, "paged|sdpa", prompts, 80,
                       cb_kwargs=dict(max_batch_tokens=64, block_size=256, num_blocks=7, max_memory_percent=0.9))
    assert om.OffloadingManager.__dict__["offload_requests"] is original
    assert run["evictions"] > 0, "expected the engine to preempt"
    assert all(len(r.generated_tokens) == 80 for r in run["results"].values())


def test_blockflex_contender_matches():
    """The engine's own paged cache read by the same Flex core through its block table (the bench
    contender subclasses transformers 5.17's cache: on 5.19+ it is refused, naming 5.17)."""
    model = h.make_model("qwen2-bias", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    if not eng.IS_517:
        with pytest.raises(RuntimeError, match="reads transformers 5.17's paged cache"):
            h.run_engine(model, blockflex.BLOCKFLEX_ATTENTION, prompts[:1], NEW, cb_kwargs=dict(max_batch_tokens=48))
        return
    run = h.run_engine(model, blockflex.BLOCKFLEX_ATTENTION, prompts, NEW,
                       cb_kwargs=dict(max_batch_tokens=48, block_size=128, num_blocks=48), stagger=[0, 0, 2, 2, 4, 4])
    assert type(run["cache"]).__name__ == "RecordingPagedCache"
    _check_run(run, model, "blockflex")


def test_generate_batch():
    model = h.make_model("mistral", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(3, [9, 150, 33], model.config.vocab_size)
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    gen = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=64))
    assert len(out) == 3 and all(len(r.generated_tokens) == 4 for r in out.values())
    model.set_attn_implementation("sdpa")
    for r, p in zip(out.values(), prompts):
        ref = h.reference_logits(model, p + list(r.generated_tokens)[:-1])
        assert ref[len(p) - 1:].argmax(-1).tolist() == list(r.generated_tokens)


def _cache(sharing=True, **kw):
    cfg = h.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, allow_block_sharing=sharing)
    opts = vt.Options(**dict(OPTS, **kw))
    return vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=opts), cb


@pytest.mark.parametrize("sharing", [True, False])
def test_allocation_is_exact_and_never_raises(sharing):
    cache, cb = _cache(sharing, memory=str(5 * 4 * 65536), max_requests=2)  # 5 blocks: 4 for requests
    assert cb.allow_block_sharing is sharing and cache.sharing is sharing
    assert cb.max_blocks_per_request == 0 and cb.cpu_offload_space == 0
    assert cache.block_size == 256 and cache.num_blocks == 4
    assert cache.allocate_blocks(3, "a", 0) == 3
    assert cache.get_num_free_blocks() == 1
    assert cache.allocate_blocks(2, "b", 0) is None  # no memory: None, not an exception
    assert cache.allocate_blocks(1, "b", 0) == 1
    assert cache.get_num_free_blocks() == 0
    cache.free_blocks("a")
    assert cache.get_num_free_blocks() == 3
    assert cache.allocate_blocks(1, "c", 0) == 1
    assert cache.allocate_blocks(1, "d", 0) is None  # memory left, but no row (max_requests=2): None
    cache.flush()
    u = cache.usage()
    assert u["rows_in_use"] == 2 and u["blocks_in_use"] == 2
    assert u["mapped_bytes"] == 3 * cache.trash_bytes()  # b's and c's blocks and the trash row
    cache.free_blocks("b")
    cache.free_blocks("c")
    cache.free_blocks("never-allocated")  # a no-op
    cache.flush()
    u = cache.usage()
    assert u["mapped_bytes"] == cache.trash_bytes() and cache.get_num_free_blocks() == 4


def test_allocation_capped_at_max_context():
    cache, _ = _cache(memory="64M", max_requests=2)
    assert cache.max_context == 1024 and cache.block_size == 256
    assert cache.allocate_blocks(3, "a", 0) == 3
    assert cache.allocate_blocks(3, "a", 3) == 1  # only one block left in the row
    assert cache.allocate_blocks(1, "a", 4) is None


def test_refuses_flex_graphs_and_unknown_version(monkeypatch):
    cfg = h.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, use_cuda_graph=True)
    with pytest.raises(vmem.InvalidArgument, match="CUDA graphs with kernel='flex'"):
        vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**dict(OPTS, kernel="flex")))
    vt.uninstall()
    monkeypatch.setattr(vt_versions, "installed", lambda: "5.18.0")
    with pytest.raises(vmem.VmemError, match="5.18.0"):
        vt.install()


def test_attention_outside_the_engine_is_refused():
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    with pytest.raises(vmem.VmemError, match="continuous batching"):
        model(torch.tensor([[3, 4, 5]]))


# ------------------------------------------------------------------------------------------------
# kernel="fa": the round's varlen indices against an independent per-request computation
# ------------------------------------------------------------------------------------------------
def _attend_f64(q, k, v, scale):
    """Attention of ``q`` [sq, Hq, D] over ``k``/``v`` [nk, Hkv, D], bottom-right causal, float64,
    with explicit softmax (no SDPA): query j sees keys 0 .. nk - sq + j."""
    sq, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    out = torch.empty(sq, hq, d, dtype=torch.float64)
    for h_ in range(hq):
        kh, vh = k[:, h_ // g].double(), v[:, h_ // g].double()
        for j in range(sq):
            s = (kh @ q[j, h_].double()) * scale
            s[nk - sq + j + 1:] = float("-inf")
            p = torch.softmax(s, 0)
            out[j, h_] = p @ vh
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fa_varlen_indices_match_per_request_attention(seed):
    """Rows in random (unsorted) order, decodes and prefill chunks mixed: the packed FA call's
    emulation over the flat view equals per-request attention over each row's first past+q
    tokens; the slots past a request's length hold NaN and must not be read."""
    g = torch.Generator().manual_seed(seed)
    rows, ctx, hkv, hq, d = 7, 48, 2, 6, 8
    k4 = torch.full((rows, ctx, hkv, d), float("nan"))
    v4 = torch.full((rows, ctx, hkv, d), float("nan"))
    entries = eng.random_mixed_round(g, k4, v4)
    idx = vt_fa.fa_varlen_indices(entries, ctx)
    total = sum(e[2] for e in entries)
    assert idx.total_q == total and idx.max_q == max(e[2] for e in entries)
    assert idx.max_k == max(p + q for _, p, q in entries)
    n = len(entries)
    h_ = idx.host.tolist()
    assert h_[n + 1: 2 * n + 1] == [r * ctx for r, _, _ in entries]  # starts: the rows, in query order
    assert h_[2 * n + 2:] == [p + q for _, p, q in entries]
    q = torch.randn(total, hq, d, generator=g)
    kf, vf = k4.view(rows * ctx, hkv, d), v4.view(rows * ctx, hkv, d)
    scale = 0.3
    got = vt_fa.fa_varlen_reference(q, kf, vf, idx.to("cpu"), scale)
    assert torch.isfinite(got).all()
    start = 0
    for row, past, ql in entries:
        want = _attend_f64(q[start:start + ql], k4[row, :past + ql], v4[row, :past + ql], scale)
        torch.testing.assert_close(got[start:start + ql].double(), want, rtol=1e-5, atol=1e-5)
        start += ql


def test_fa_varlen_indices_refuse_bad_entries():
    with pytest.raises(vmem.VmemError):
        vt_fa.fa_varlen_indices([], 16)
    with pytest.raises(vmem.VmemError):
        vt_fa.fa_varlen_indices([(0, 10, 7)], 16)  # past + q past the row
    with pytest.raises(vmem.VmemError):
        vt_fa.fa_varlen_indices([(0, 0, 0)], 16)  # a request without queries


def test_compiled_flex_refuses_a_cache_past_32_bit_offsets():
    # Compiled Flex indexes [rows, Hkv, max_context, D] with 32-bit offsets: on the H100 a cache
    # of 257 x 8192 x 8 x 128 elements faulted once row 256 was used. The check runs before any
    # memory is reserved, so a CPU test can ask for the compiled kernel.
    cfg = h.make_config("llama-gqa")
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ctx = 8192
    rows_fit = (2**31 - 1) // (ctx * hkv * d)  # rows = max_requests + 1 (the trash row)
    too_many = rows_fit  # rows_fit + 1 rows: one past what 32-bit offsets reach
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    with pytest.raises(vmem.InvalidArgument, match="32-bit offsets"):
        vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**dict(
            OPTS, kernel="flex", compile=True, max_requests=too_many, max_context=ctx, memory="64M")))


@pytest.mark.parametrize("bad", [dict(compile="no"), dict(compile="yes"), dict(compile=1),
                                 dict(prealloc="no"), dict(max_context=0), dict(max_context=-1),
                                 dict(max_context="8"), dict(max_context=True), dict(layout=3)])
def test_mistyped_options_are_refused_not_coerced(bad):
    # compile="no" used to be truthy (a compiled kernel asked for), max_context=0 or "8" and
    # layout=3 went through to odd geometry or a TypeError instead of a typed error.
    with pytest.raises(vmem.InvalidArgument):
        _cache(**bad)


def test_preallocating_more_than_the_ram_on_the_cpu_is_refused_not_killed():
    # memory="1T" on the CPU with prealloc (the default) got the process killed (137) before the
    # host backend learnt to count its pages against the machine (issue #22 item 2): the
    # refusal comes from vmem's pool, before any page is created.
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(vmem.OutOfMemory, match="can be had"):
        _cache(memory=str(4 * ram))


# -- prefix sharing --------------------------------------------------------------------------------
SYSTEM = 200  # a shared "system prompt": 3 full token-major blocks of 64 tokens, and 8 tokens more
SUFFIXES = [5, 40, 70, 17, 33]


def _shared_prompts(vocab):
    system = h.make_prompts(1, [SYSTEM], vocab, seed=7)[0]
    return [system + p for p in h.make_prompts(len(SUFFIXES), SUFFIXES, vocab, seed=8)]


def _run_shared(attn, sharing, **cb):
    """The first request alone, then the rest once its first token streamed (its prompt is computed
    and published by then)."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _shared_prompts(model.config.vocab_size)
    stagger = [0] + [1] * (len(prompts) - 1)
    cbk = dict(max_batch_tokens=64, allow_block_sharing=sharing, **cb)
    run = h.run_engine(model, attn, prompts, NEW, cb_kwargs=cbk, stagger=stagger, streaming=True)
    return model, run


def test_requests_with_a_shared_system_prompt_map_its_pages_once_and_match():
    """vmem's sharing in place of the engine's: every later request adopts the system prompt's 3
    full blocks (the same pages, not recomputed); logits match DynamicCache and the unshared run;
    the distinct memory mapped at peak is smaller; afterwards only the trash row stays mapped and
    the cached blocks count as free."""
    with vt.serving(layout="token-major"):
        model, shared = _run_shared(vt.VMEM_ATTENTION, True)
        _, unshared = _run_shared(vt.VMEM_ATTENTION, False)
    cache, plain = shared["cache"], unshared["cache"]
    assert cache.sharing and not plain.sharing and cache.block_size == 64
    _check_run(shared, model, "vmem shared")
    _check_run(unshared, model, "vmem unshared")
    assert h.cross_compare(shared, unshared) < TOL
    for rid in shared["ids"]:
        assert list(shared["results"][rid].generated_tokens) == list(unshared["results"][rid].generated_tokens)
    later = len(SUFFIXES) - 1
    u = cache.usage()
    assert u["prefix_hit_tokens"] == later * 3 * 64 and cache._total_prefix_length == later * 3 * 64, u
    assert plain.usage()["prefix_hit_tokens"] == 0 and plain._total_prefix_length == 0
    # The shared blocks are mapped once, not once per request (how much that saves at peak
    # depends on how the engine's chunked prefills overlap; python/benches/prefix_serving.py
    # measures it on the GPU).
    assert cache.peak_mapped_bytes < plain.peak_mapped_bytes, (cache.peak_mapped_bytes, plain.peak_mapped_bytes)
    _check_clean(cache)
    _check_clean(plain)
    assert u["prefix_blocks"] > 0 and u["prefix_unmapped_bytes"] > 0  # cached for later requests


def test_vmem_sharing_hits_what_the_engines_block_sharing_hits():
    """The engine's own paged cache with its block sharing (64-token blocks, as vmem's) serves
    the same prefix tokens from cache as vmem does."""
    with vt.serving(layout="token-major"):
        _, ours = _run_shared(vt.VMEM_ATTENTION, True)
        with eng.engine_prefix_hits() as hits:
            model, theirs = _run_shared(eng.ENGINE_SDPA, True, **eng.engine_block(64), num_blocks=64)
    assert sum(hits) == ours["cache"]._total_prefix_length > 0
    _check_run(theirs, model, "the engine's own, shared")
    assert h.cross_compare(ours, theirs) < TOL


def test_a_small_prefix_cache_evicts_and_a_readmitted_request_recomputes():
    """``prefix_cache=0``: blocks stay shared only while a request maps them; once the first
    request finished, later ones find nothing and compute everything; logits still match."""
    with vt.serving(layout="token-major", prefix_cache=0):
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        prompts = _shared_prompts(model.config.vocab_size)
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts[:2], NEW, cb_kwargs=dict(max_batch_tokens=64))
    cache = run["cache"]
    assert cache.sharing
    _check_run(run, model, "prefix_cache=0")
    _check_clean(cache)
    assert cache.usage()["prefix_unmapped_bytes"] == 0


def test_sharing_is_off_for_the_flex_kernel_and_when_the_engine_disallows_it():
    cache, cb = _cache(True, kernel="flex")
    assert not cache.sharing and cb.allow_block_sharing is False and cache.search_prefix_match("a", [1] * 600) == 0
    cache, cb = _cache(False)
    assert not cache.sharing and cache.kv.prefix_stats()["block_tokens"] == 0
    for bad in ("lots", -1, 1.5):
        with pytest.raises(vmem.InvalidArgument):
            _cache(True, prefix_cache=bad)


def test_adopting_cached_blocks_never_overcommits_this_rounds_allocations():
    """An adoption maps cached blocks that ``get_num_free_blocks`` counted as free: after a
    running request was given the last free blocks this round, a new request adopting the
    cached prefix of a finished one took them too (free blocks -2), and the round's ``flush``
    raised OutOfMemory (the engine's loop dies). The adoption is refused instead (0 tokens,
    no row held): the request waits, and the free count stays exact."""
    cache, _ = _cache(memory=str(5 * 4 * 65536))  # 4 blocks of 256 tokens for requests
    bs = cache.block_size
    prompt = list(range(2 * bs + 10))
    assert cache.search_prefix_match("a", prompt) == 0
    assert cache.allocate_blocks(3, "a", 0) == 3
    cache.flush()
    assert cache.kv.publish_prefix(cache.table.get("a").index, prompt) == 2
    cache.free_blocks("a")  # its 2 full blocks stay cached, counted as free
    assert cache.get_num_free_blocks() == 4
    assert cache.allocate_blocks(2, "b", 0) == 2
    cache.flush()
    assert cache.allocate_blocks(2, "b", 2) == 2  # the cached blocks' memory, evicted at the flush
    assert cache.get_num_free_blocks() == 0
    assert cache.search_prefix_match("c", prompt) == 0  # would take the cached blocks back
    assert "c" not in cache.table and cache.get_num_free_blocks() == 0
    cache.flush()  # raised OutOfMemory
    assert cache.usage()["rows_in_use"] == 1
    cache.free_blocks("b")
    cache.flush()
    _check_clean(cache)


# -- the serving benchmarks' command lines ---------------------------------------------------------
BAD_FLAGS = [
    ["--requests", "0"], ["--new-tokens", "0"], ["--rounds", "0"], ["--layers", "0"], ["--max-requests", "0"],
    ["--max-context", "0"], ["--max-batch-tokens", "0"], ["--max-batch-tokens", "-5"],
    ["--memory-percent", "0"], ["--memory-percent", "nan"], ["--memory-percent", "7"],
    ["--page-size", "bogus"], ["--page-size", "0"], ["--page-size", "3"], ["--timeout", "0"], ["--timeout", "nan"],
    ["--trace", "/nonexistent/trace.csv"], ["--contenders", ","], ["--out", "/proc/version/x"],
]


@pytest.mark.parametrize("script, extra", [("prefix_serving", ["--tol", "-1"]), ("prefix_serving", ["--tol", "nan"]),
                                           ("prefix_serving", ["--system", "0"]), ("prefix_serving", ["--groups", "0"])]
                         + [("prefix_serving", f) for f in BAD_FLAGS])
def test_bench_command_lines_refuse_bad_flags_with_a_usage_error(script, extra, capsys, tmp_path):
    """Each bad flag is a usage error (exit 2, one line naming the flag) before any model is built:
    these ran with 0 contenders or rounds and exit 0, tracebacked (exit 1) from deep in the
    engine (--max-requests 0, --memory-percent nan, a missing --trace), or went on with a value
    --tiny overrode (--page-size bogus)."""
    mod = __import__(script)
    built = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(__import__("harness.serving").serving, "serving_model", lambda *a, **k: built.append(1) or 1 / 0)
    try:
        with pytest.raises(SystemExit) as e:
            mod.main(["--tiny", "--out", str(tmp_path / "out"), *extra])
    finally:
        monkey.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and not built, (e.value.code, err[-3:])
    assert ": error: " in err[-1] and extra[0] in err[-1], err[-1]


def test_in_the_engine_an_adoption_never_leaves_free_blocks_negative(monkeypatch):
    """The engine run of the case above: a request with a cached system prompt joins as the one
    running request crosses into a new block with the memory full (7 blocks of 64 tokens for
    requests). Its adoption took the cached blocks the running request's new block counted on:
    free blocks -1, and the engine soft-reset the adopter before the flush. Now the adoption is
    refused (vmem's cache counts it served, the engine's counter not), free blocks stay >= 0 after
    every search, and logits match.

    When the third request joins depends on the engine's thread (it is added after a number of
    streamed results), so the refused adoption happens in most runs, not all (1 in ~30 missed it):
    every run must keep free blocks >= 0 and match, and the refusal must happen in one of five."""
    seen = []
    real = vt.VmemCBCache.search_prefix_match

    def search(self, request_id, prompt_ids):
        got = real(self, request_id, prompt_ids)
        seen.append(self.get_num_free_blocks())
        return got

    monkeypatch.setattr(vt.VmemCBCache, "search_prefix_match", search)
    refused = False
    for _ in range(5):
        with vt.serving(layout="token-major", memory=str(8 * 65536)):
            model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
            vocab = model.config.vocab_size
            system = h.make_prompts(1, [192], vocab, seed=7)[0]
            prompts = [system + h.make_prompts(1, [10], vocab, seed=8)[0], h.make_prompts(1, [250], vocab, seed=9)[0],
                       system + h.make_prompts(1, [5], vocab, seed=10)[0]]
            run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 20, cb_kwargs=dict(max_batch_tokens=64),
                               stagger=[0, 20, 26], streaming=True)
        cache = run["cache"]
        assert seen and min(seen) >= 0, seen
        cmp = h.compare(run, model, 20)
        assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL and cmp["top1_agree"] == cmp["decisive"] > 0, cmp
        _check_clean(cache)
        if cache.usage()["prefix_hit_tokens"] > cache._total_prefix_length:
            refused = True
            break
    assert refused, "the refused adoption did not happen in five runs"


@pytest.mark.parametrize("bad", ["lots", -1, 1.5, True])
def test_a_bad_prefix_cache_option_is_refused_at_install_and_with_sharing_off(bad):
    # install(prefix_cache="lots") was accepted and failed only once the engine built its cache
    # (in its own thread); with the engine's sharing off the value was not looked at.
    with pytest.raises(vmem.InvalidArgument):
        vt.install(prefix_cache=bad)
    assert vt.options().prefix_cache is None  # nothing of the refused call stays
    with pytest.raises(vmem.InvalidArgument):
        _cache(False, prefix_cache=bad)
