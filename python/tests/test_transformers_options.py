"""vmem.transformers' options: validated at install()/serving() (issue #30 item 7), bound to the
engine's manager when it is created (issue #31), the Flex CPU reference bounded by the tokens in
flight, and generate_batch failures raised, not returned as results (issue #30 item 11).

CPU, fp32, tiny models; needs torch and a transformers vmem serves (skipped otherwise, saying why)."""

import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng  # noqa: E402
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from harness import check as h
import vmem.transformers as vt

import vmem

BENCHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches")


# -- item 7: every option checked where it is given --------------------------------------------------
BAD = [dict(memory="lots"), dict(max_requests=0), dict(page_size="3M"), dict(compile="no"), dict(prealloc="no"),
       dict(max_context="8"), dict(max_context=0), dict(max_requests=True), dict(max_requests=2.0),
       dict(page_size="4K"), dict(page_size=3 << 20), dict(page_size=True), dict(memory=-1), dict(memory=0),
       dict(memory=1.5), dict(layout="rows"), dict(kernel="sdpa"), dict(kernel=None), dict(prefix_cache="x"),
       dict(compile=1), dict(prealloc=None), dict(colour="blue"), dict(prefix_cache=2**64), dict(memory=2**64)]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_install_refuses_a_bad_option_in_the_callers_thread(bad):
    """install(memory="lots"), max_requests=0, page_size="3M", compile="no", prealloc="no",
    max_context="8" were accepted; the error came later, in the engine's thread."""
    vt.install(memory="64M")
    with pytest.raises(vmem.InvalidArgument, match=next(iter(bad))):
        vt.install(**bad)
    with pytest.raises(vmem.InvalidArgument, match=next(iter(bad))):
        with vt.serving(**bad):
            pass
    assert vt.options() == vt.Options(memory="64M")  # nothing of the refused calls stays


def test_rows_times_context_past_int32_is_refused_at_install():
    """install(max_requests=65535, max_context=32768) was accepted; FlashAttention's int32 row
    starts overflow, and the error came in the engine's thread."""
    with pytest.raises(vmem.InvalidArgument, match="int32"):
        vt.install(max_requests=65535, max_context=32768)
    vt.install(max_requests=65535, max_context=32768, kernel="flex")  # Flex's limit depends on the model
    vt.install(max_requests=2**31 // 32768 - 2, max_context=32768, kernel="fa")  # just below


def test_more_requests_than_vmem_has_request_ids_are_refused_at_install():
    """max_requests=300000 (with kernel="flex", or any max_context under FA's int32 limit) was
    accepted, and the engine's thread failed building the cache: a cache's rows, the trash row
    included, are vmem request ids, at most 65,536."""
    for n in (65536, 300000, 2**31 - 2):
        with pytest.raises(vmem.InvalidArgument, match="max_requests must be <= 65535"):
            vt.install(max_requests=n, max_context=16, kernel="flex")
    vt.install(max_requests=65535, max_context=16)
    kv = vmem.KVCache(layers=1, kv_heads=1, head_dim=8, dtype="fp16", max_batch=vt.options().max_requests + 1,
                      max_context=16, page_size="64K", backend="sim")  # the core takes what the bound lets through
    kv.close()
    with pytest.raises(vmem.InvalidArgument, match="65536 request ids"):
        vmem.KVCache(layers=1, kv_heads=1, head_dim=8, dtype="fp16", max_batch=65537, max_context=16, page_size="64K",
                     backend="sim")


# -- every option, refused in the caller's thread with bad values of every kind (issue 48 item 15) ---------------
def _bad_values():
    """Per option, values it must refuse: NumPy scalars (ints, bools, floats), strings for
    numbers and booleans, floats, huge ints, bools for numbers, the wrong type."""
    np = pytest.importorskip("numpy")
    huge = [10**30, 2**64, -(2**63)]
    numbers = [np.bool_(True), np.float64(8.0), np.float32(8.0), 8.0, 1.5, float("nan"), "8", "true", True, b"8", [8]]
    flags = [1, 0, np.int64(1), np.float64(1.0), 1.0, "true", "True", "False", "no", "", b"1", [True]]
    sizes = [-1, np.int64(-1), np.bool_(True), np.float64(8e6), 8e6, "lots", "true", "-8M", "8 M B", True, b"8M"] + huge
    return {
        "layout": ["Per-layer", "per_layer", "", np.str_("rows"), np.int64(0), np.bool_(True), True, 1.0, None, b"per-layer"],
        "page_size": [0, 1, 3 << 20, "4K", "3M", "true", np.int64(3 << 20), np.float64(65536.0),
                      65536.0, None, *sizes],
        "max_requests": [0, -1, np.int64(0), np.int64(-1), np.int64(2**40), np.uint64(2**40), 65536, None, *numbers, *huge],
        "max_context": [0, -1, np.int64(0), np.int64(-3), np.int64(2**40), 2**31, *numbers, *huge],
        "memory": [0, np.int64(0), *sizes],
        "prealloc": [None, *flags],
        "compile": flags,
        "kernel": ["FA", "flash", "sdpa", "", None, np.str_("flex "), np.bool_(True), 1, True],
        "prefix_cache": [1.5, *sizes],
        "graph_seqlen_k": ["Bucket", "", None, 1, True, np.bool_(False)],
        "graph_max_tokens": [0, -1, np.int64(0), 2**31, *numbers, *huge],
        "pool": [np.int64(2), np.bool_(True), 1.5, True, "", "x" * 32, "a b", b"svc", 10**30, ["svc"]],
        "pool_idle_s": [-1, -0.5, np.float64(-1.0), np.int64(-5), float("nan"), np.float64("nan"), float("inf"),
                        "2", "true", True, np.bool_(True), 10**400, b"2"],
        "pool_keep": [None, 1.5, *sizes],
        "deferred_reclaim": [None, *flags],
        "admit_while_unmapping": [None, *flags],
        "reuse_while_unmapping": [None, *flags],
        "background_unmap": flags,
        "split_decode": flags,
        "split_reader": ["Triton", "", 1, True, np.bool_(False), b"fa", np.array("triton"),
                         np.array(["fa", "triton"])],
        "prompt_reader": [None, "FlashInfer", "", 1, True, np.bool_(False), b"fa", np.array("flashinfer"),
                          ["fa"], "triton"],
    }


def test_every_option_is_walked():
    assert set(_bad_values()) == set(vt.Options.names())


@pytest.mark.parametrize("name", vt.Options.names())
def test_every_option_refuses_bad_values_of_every_kind_in_the_callers_thread(name):
    """Options(), install() and serving() refuse each bad value of each option where it is
    given (InvalidArgument naming the option; a pool name the ledger refuses: PoolError), and a
    refused call changes nothing: the options in force stay, serving() patches nothing and does
    not run its block."""
    from vmem.transformers import patches

    for bad in _bad_values()[name]:
        errors = (vmem.PoolError, vmem.InvalidArgument) if name == "pool" else vmem.InvalidArgument
        with pytest.raises(errors) as e:
            vt.Options(**{name: bad})
        assert name in str(e.value) or name == "pool", (bad, str(e.value))
        vt.uninstall()
        vt.install(memory="64M")
        with pytest.raises(errors):
            vt.install(**{name: bad})
        assert vt.options() == vt.Options(memory="64M"), bad
        vt.uninstall()
        with pytest.raises(errors):
            with vt.serving(**{name: bad}):
                pytest.fail(f"the serving block ran with {name}={bad!r}")
        assert not patches.installed() and vt.options() == vt.Options(), bad


def test_numpy_scalars_that_are_values_become_python_ones():
    """A NumPy int where an int goes and a NumPy bool where a bool goes are taken, as Python's
    own (an Options never holds a NumPy scalar the engine would carry around)."""
    np = pytest.importorskip("numpy")
    o = vt.Options(max_requests=np.int64(8), max_context=np.uint32(1024), graph_max_tokens=np.int16(64),
                   prealloc=np.bool_(False), compile=np.bool_(True), split_decode=np.bool_(False),
                   admit_while_unmapping=np.bool_(False))
    assert (o.max_requests, o.max_context, o.graph_max_tokens) == (8, 1024, 64)
    assert (o.prealloc, o.compile, o.split_decode, o.admit_while_unmapping) == (False, True, False, False)
    for v in (o.max_requests, o.max_context, o.graph_max_tokens, o.prealloc, o.compile, o.split_decode,
              o.admit_while_unmapping):
        assert type(v) in (int, bool), type(v)
    # Sizes too: a NumPy integer is a number of bytes, as a Python int is.
    sized = vt.Options(memory=np.int64(8 << 20), page_size=np.uint64(2 << 20), prefix_cache=np.int32(1 << 20),
                       pool_keep=np.int64(2 << 20))
    assert sized == vt.Options(memory=8 << 20, page_size="2M", prefix_cache="1M", pool_keep="2M")
    for v in (sized.memory, sized.page_size, sized.prefix_cache, sized.pool_keep):
        assert type(v) is int, type(v)
    # Choices: a NumPy string spelled as one is that choice, a Python str.
    chosen = vt.Options(layout=np.str_("token-major"), kernel=np.str_("fa"), split_reader=np.str_("triton"),
                        graph_seqlen_k=np.str_("bucket"))
    assert chosen == vt.Options(layout="token-major", split_reader="triton", graph_seqlen_k="bucket")
    for v in (chosen.layout, chosen.kernel, chosen.split_reader, chosen.graph_seqlen_k):
        assert type(v) is str, type(v)
    hash(chosen)


def test_what_needs_the_model_is_refused_when_the_manager_is_made():
    """A budget of one byte (or of a page: less than two blocks of this model) passed every
    option check and was refused in the engine's thread, at start(), failing every request; so
    were pages made up front past what vmem makes at once. Both are refused where the engine's
    manager is made (init_continuous_batching, generate_batch), in the caller's thread, naming
    the option; nothing is started."""
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    vt.install(page_size="64K", max_requests=4, max_context=1024)
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    for memory, why in ((1, "hold 0 blocks"), ("64K", "hold 0 blocks"), (2**63, "made up front")):
        with vt.serving(memory=memory):
            with pytest.raises(vmem.InvalidArgument, match=why):
                model.init_continuous_batching(generation_config=gen)
            with pytest.raises(vmem.InvalidArgument, match=why):
                model.generate_batch([[5, 6, 7]], generation_config=gen)
    with vt.serving(memory=2**63, prealloc=False):  # nothing made up front: a cap, taken
        m = model.init_continuous_batching(generation_config=gen)
    assert not m.is_running()
    with vt.serving(memory="8M"):
        out = model.generate_batch([[5, 6, 7]], generation_config=gen)
    assert [len(r.generated_tokens) for r in out.values()] == [2]


def test_serving_blocks_nest_and_stay_in_their_thread():
    import threading

    vt.install(memory="64M")
    seen = {}
    with vt.serving(layout="token-major") as outer:
        with vt.serving(max_requests=5) as inner:
            t = threading.Thread(target=lambda: seen.setdefault("other", vt.options()))
            t.start()
            t.join()
            assert vt.options() is inner
        assert vt.options() is outer
    assert (inner.layout, inner.max_requests, inner.memory) == ("token-major", 5, 64 << 20)
    assert seen["other"] == vt.Options(memory="64M")  # another thread sees install()'s options
    assert vt.options() == vt.Options(memory="64M")


@pytest.mark.parametrize("name, factory", [("", len), ("paged|", len), ("paged|a|b", len), ("eager", len), (3, len), ("paged|x", "not callable")])
def test_register_cache_refuses_what_the_engine_could_not_use(name, factory):
    with pytest.raises(vmem.InvalidArgument):
        vt.register_cache(name, factory)


def test_a_registered_cache_gets_the_engines_request_and_serves():
    """register_cache plugs a cache in: here a factory that records its CacheRequest and builds a
    VmemCBCache with the bound options (max_requests=2)."""
    requests = []

    def factory(request):
        requests.append(request)
        return request.cache_class(request.config, request.continuous_batching_config, request.device,
                              dtype=request.dtype, options=request.options, tp_size=request.tp_size)

    vt.install(memory="8M", page_size="64K", max_context=512)
    vt.register_cache("paged|mine", factory)
    try:
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        prompts = h.make_prompts(3, [9, 140, 30], model.config.vocab_size)
        with vt.serving(max_requests=2):
            run = h.run_engine(model, "paged|mine", prompts, 3, cb_kwargs=dict(max_batch_tokens=64))
    finally:
        vt.unregister_cache("paged|mine")
    (req,) = requests
    assert req.options.max_requests == 2 and req.tp_size == 1 and req.dtype == torch.float32
    assert req.engine_cache.__name__ == "PagedAttentionCache" and run["cache"].max_requests == 2
    cmp = h.compare(run, model, 3)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < 1e-4, cmp


def test_options_are_canonical_and_frozen():
    o = vt.Options(page_size="64K", memory="8M", prefix_cache="1M", max_requests=4)
    assert (o.page_size, o.memory, o.prefix_cache) == (65536, 8 << 20, 1 << 20)
    with pytest.raises(Exception):
        o.memory = 1  # type: ignore[misc]
    assert o.replace(kernel="flex").kernel == "flex" and o.kernel == "fa"


# -- issue #31: options bound to the manager --------------------------------------------------------
OPTS = dict(layout="token-major", memory="8M", max_requests=3, page_size="64K", max_context=512)


def _wait_for_cache(manager, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        bp = getattr(manager, "batch_processor", None)
        if bp is not None:
            return bp.cache
        if not manager.is_running():
            break
        time.sleep(0.01)
    raise AssertionError("the engine built no cache")


def _manager(model):
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def _check_bound(cache):
    assert isinstance(cache, vt.VmemCBCache)
    assert (cache.layout, cache.max_requests, cache.rows, cache.page_bytes) == ("token-major", 3, 4, 65536)
    assert cache.max_context == 512 and cache.kv.config()["memory_cap"] <= 8 << 20


@pytest.mark.parametrize("start_inside", [False, True])
def test_serving_options_reach_the_cache_the_engine_builds_later(start_inside):
    """vt.install(); with vt.serving(...): m = model.init_continuous_batching(gc); then m.start()
    after the block built a cache of 256 rows at the default size: the options were lost."""
    vt.install()
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    with vt.serving(**OPTS):
        m = _manager(model)
        if start_inside:
            m.start()
    if not start_inside:
        m.start()
    try:
        _check_bound(_wait_for_cache(m))
    finally:
        m.stop(block=True, timeout=30)


def test_start_inside_the_block_never_races_the_engines_thread():
    """m.start() inside the block, the block left at once: the engine's thread builds the cache
    after the block; 7 of 8 runs lost the options."""
    vt.install()
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    lost = []
    for run in range(12):
        with vt.serving(**OPTS):
            m = _manager(model)
            m.start()
        try:
            cache = _wait_for_cache(m)
            if (cache.layout, cache.max_requests) != ("token-major", 3):
                lost.append(run)
        finally:
            m.stop(block=True, timeout=30)
    assert not lost, f"runs {lost} of 12 lost the options"


def test_the_options_in_force_when_the_manager_is_created_are_the_ones_used():
    """A manager created outside any block keeps install()'s options, even when it starts inside
    a serving block (the options travel with the manager, not with the moment of start)."""
    vt.install(**dict(OPTS, layout="per-layer", max_requests=2))
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    m = _manager(model)
    with vt.serving(**OPTS):
        m.start()
        try:
            cache = _wait_for_cache(m)
        finally:
            m.stop(block=True, timeout=30)
    assert (cache.layout, cache.max_requests) == ("per-layer", 2)


# -- item 11: kernel="flex" on the CPU, bounded; failures raised ----------------------------------
FLEX_RUN = """
import torch, transformers, vmem.transformers as vt
from harness import check as h
h.fake_cpu_memory()
vt.install(kernel="flex", page_size="64K")
model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
model.set_attn_implementation(vt.VMEM_ATTENTION)
prompts = h.make_prompts(9, [400, 390, 410, 405, 395, 400, 420, 380, 400], model.config.vocab_size)
gen = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
out = model.generate_batch(prompts, generation_config=gen)
print("TOKENS", sorted(len(r.generated_tokens) for r in out.values()))
"""


def test_flex_on_the_cpu_fits_in_memory_bounded_by_the_tokens_in_flight():
    """9 requests of ~400 tokens, kernel="flex" on the CPU, default options (256 rows of 1,024
    tokens), in a process limited to 3 GiB of address space beyond what importing torch takes:
    the dense reference spanned every row's max_context (5 GB RSS, 38 s), and every request
    came back empty while generate_batch returned normally."""
    probe = subprocess.run([sys.executable, "-c", "import harness.check, torch, transformers, vmem.transformers\n"
                            "print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])"],
                           env=dict(os.environ, PYTHONPATH=BENCHES), capture_output=True, text=True, check=True)
    limit = int(probe.stdout.strip()) * 1024 + (3 << 30)
    t0 = time.monotonic()
    r = subprocess.run(["prlimit", f"--as={limit}", sys.executable, "-c", FLEX_RUN],
                       env=dict(os.environ, PYTHONPATH=BENCHES), capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TOKENS [4, 4, 4, 4, 4, 4, 4, 4, 4]" in r.stdout, (r.stdout[-500:], r.stderr[-3000:])
    assert took < 120, took


def test_generate_batch_raises_when_the_engines_thread_failed():
    """An error in the engine's thread (here: a layer that raises) failed every request, and
    generate_batch logged it and returned them as results; now it raises, naming the error, with
    the partial results attached."""
    vt.install(memory="8M", page_size="64K", max_requests=4)
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)

    def boom(module, args):
        raise RuntimeError("layer exploded")

    handle = model.model.layers[1].register_forward_pre_hook(boom)
    prompts = h.make_prompts(3, [9, 50, 20], model.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with pytest.raises(vmem.VmemError, match="layer exploded") as e:
            model.generate_batch(prompts, generation_config=gen,
                                 continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=64))
    finally:
        handle.remove()
    assert len(e.value.results) == 3 and all(r.error is not None for r in e.value.results.values())


def test_generate_batch_with_several_return_sequences_is_not_a_failure():
    """transformers 5.17 returns one result per prompt whatever num_return_sequences is (vmem does
    not fork: the children run as fresh requests), 5.19+ one per prompt and sequence: the failure
    check counted prompts x sequences on 5.17 and raised 'never came back' for a run that went
    well."""
    vt.install(memory="8M", page_size="64K", max_requests=8, max_context=512)
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    prompts = h.make_prompts(2, [9, 30], model.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=3, do_sample=True, num_return_sequences=2, eos_token_id=None,
                                        pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=64))
    per_prompt = 1 if eng.IS_517 else 2  # 5.19+ returns the children too (run afresh: vmem does not fork)
    assert len(out) == 2 * per_prompt and all(len(r.generated_tokens) == 3 and r.error is None for r in out.values())
