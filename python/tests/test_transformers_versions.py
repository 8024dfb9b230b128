"""vmem.transformers across transformers versions: the version gate (5.17.x and 5.19-5.25 served,
5.18 and anything newer than 5.25 refused, naming the range), the ``transformers`` install extra
agreeing with it, the patch table against the installed engine (every target there, with the
parameters the table expects; every member restored by uninstall; other caches left to the
engine's code), one attention name (``vmem``) on every served version, the 5.19-5.25 allocation
surface, MLA models refused, and the default budget on a host whose memory transformers cannot
measure (no psutil).

The gate and extra tests need torch but not transformers; the others run on the CPU under
whichever served transformers the venv has (CI runs them under every version it installs)."""

from __future__ import annotations

import inspect
import os
import re
import types
import warnings

import pytest

pytest.importorskip("torch", reason="torch is not installed (vmem.transformers needs it)")

import vmem
from vmem.transformers import versions

PYPROJECT = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
SERVED = ["5.17.0", "5.17.3", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.23.1", "5.24.0", "5.25.0", "5.25.2"]
REFUSED = ["4.57.3", "5.0.0", "5.1.17", "5.16.2", "5.18.0", "5.18.1", "5.26.0", "5.26.1", "6.0.0", "5.170.0", "5.250.0",
           "5.2", "five", "", "5.25.0-x", "15.25.0"]


@pytest.mark.parametrize("version", SERVED)
def test_the_gate_serves_5_17_and_5_19_to_5_25(version):
    adapter = versions.adapter_for(version)
    assert adapter.__name__.endswith("engine517" if version.startswith("5.17.") else "engine519")


@pytest.mark.parametrize("version", REFUSED)
def test_the_gate_refuses_5_18_and_newer_naming_the_range(version):
    with pytest.raises(vmem.VmemError, match=re.escape(f"this is transformers {version}.")) as e:
        versions.adapter_for(version)
    assert versions.SUPPORTED_RANGE in str(e.value) and 'pip install "vmem-kv[transformers]"' in str(e.value)
    assert "5.25" in versions.SUPPORTED_RANGE


def _extra_requirement():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    requirements = pytest.importorskip("packaging.requirements", reason="packaging is not installed")
    with open(PYPROJECT, "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"].get("transformers")
    assert extra, "python/pyproject.toml has no 'transformers' extra"
    reqs = [requirements.Requirement(r) for r in extra]
    return {r.name: r for r in reqs}


def test_the_install_extra_pins_what_the_gate_serves():
    """``pip install "vmem-kv[transformers]"`` may only pick a transformers the gate serves, and
    takes every line it serves (the newest: 5.25)."""
    tf = _extra_requirement()["transformers"]
    for v in SERVED:
        assert tf.specifier.contains(v), v
    for v in REFUSED:
        assert not tf.specifier.contains(v), v
    assert "torch" in _extra_requirement()


# -- under the installed transformers ---------------------------------------------------------------
def _engine():
    pytest.importorskip("torch", reason="torch is not installed")
    eng = pytest.importorskip("tf_engine", reason="transformers is not installed")
    if not eng.SERVED:
        pytest.skip(f"vmem.transformers does not serve transformers {eng.VERSION}")
    return eng


@pytest.fixture
def tiny():
    _engine()
    from harness import check as h

    h.fake_cpu_memory()
    yield h
    import vmem.transformers as vt

    vt.uninstall()


OPTS = {"page_size": "64K", "max_requests": 4, "max_context": 1024, "memory": "8M"}


@pytest.mark.parametrize("name", ["vmem", "paged|vmem"])
def test_one_attention_name_serves_on_every_version(name, tiny):
    """``attn_implementation="vmem"`` on 5.17 and 5.19-5.25 alike (5.23's engine refused any name
    but paged|eager, sdpa or a flash one; 5.17 knew only paged|vmem), and ``paged|vmem`` still
    works; greedy tokens equal the engine's own path's, and the model keeps the name it had."""
    import torch
    import transformers

    import vmem.transformers as vt

    h = tiny
    eng = _engine()
    vt.install(**OPTS)
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(3, [9, 150, 33], model.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.19+: "the paged| prefix is no longer needed"
        model.set_attn_implementation(name)
    kept = model.config._attn_implementation
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=64))
    assert model.config._attn_implementation == kept
    model.set_attn_implementation(eng.ENGINE_SDPA)
    ref = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=transformers.ContinuousBatchingConfig(max_batch_tokens=64))
    got = [list(r.generated_tokens) for r in out.values()]
    assert got == [list(r.generated_tokens) for r in ref.values()] and all(len(t) == 5 for t in got)


def test_without_psutil_the_default_budget_says_what_to_pass(tiny, monkeypatch):
    """On a host where transformers cannot measure memory (no psutil: it reports 0 bytes) the
    default budget was transformers' own ``ValueError: Invalid values: ... num_blocks = -2``;
    now an InvalidArgument naming the option to pass, and with it the run works."""
    import torch
    import transformers
    from transformers.generation.continuous_batching import cache as engine

    import vmem.transformers as vt

    h = tiny
    monkeypatch.setattr(engine, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 0, 0, 0))
    vt.install(**dict(OPTS, memory=None))
    model = h.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(vmem.InvalidArgument, match=r"install\(memory=") as e:
        model.generate_batch([[5, 6, 7]], generation_config=gen)
    assert "psutil" in str(e.value)
    with vt.serving(memory="8M"):
        out = model.generate_batch([[5, 6, 7]], generation_config=gen)
    assert [len(r.generated_tokens) for r in out.values()] == [2]


def test_the_default_budget_is_what_the_engine_measures(tiny):
    """Without ``memory``, the budget comes from the engine's own measure of the device (here the
    harness's 8 GiB host): some blocks, at most what that memory holds."""
    import torch
    import transformers

    import vmem.transformers as vt

    cfg = tiny.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, max_memory_percent=0.5)
    opts = vt.Options(**dict(OPTS, memory=None, max_requests=2))
    cache = vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=opts)
    budget = (cache.num_blocks + 1) * cache.trash_bytes()
    assert 0 < budget <= 0.5 * (8 << 30)
    assert cache.max_batch_tokens == 64


class _State:
    """The part of the engine's RequestState the 5.19+ allocation surface reads."""

    def __init__(self, request_id: str, current: int = 0) -> None:
        self.request_id, self.position_offset = request_id, current

    def current_len(self) -> int:
        return self.position_offset


def _cache_519(**kw):
    """A 5.19-5.25 cache (its allocation surface is plain Python: it runs under 5.17 too)."""
    _engine()
    import torch
    import transformers
    from harness import check as h

    import vmem.transformers as vt
    from vmem.transformers.engine519 import VmemCBCache519

    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, allow_block_sharing=True)
    return VmemCBCache519(h.make_config("llama-gqa"), cb, "cpu", dtype=torch.float32,
                          options=vt.Options(**dict(OPTS, **kw)))


def test_token_allocation_is_exact_all_or_nothing_and_never_raises(caplog):
    """5.19+'s ``can_store_request_tokens`` allocates by tokens, all or nothing; the capacity,
    ``needs_new_blocks`` and ``count_storable_requests`` the preemption relies on agree with it."""
    cache = _cache_519(memory=str(5 * 4 * 65536), max_requests=2)  # 5 blocks of 256 tokens: 4 for requests
    alloc = cache.cache_allocators["full_attention"]
    assert cache.block_size == 256 and cache.num_blocks == 4 and cache.compute_free_capacity() == 1.0
    assert cache.can_store_request_tokens(_State("a"), 600)  # 3 blocks
    assert cache.compute_free_capacity() == 0.25 and cache.compute_free_capacity(relative=False) == cache.trash_bytes()
    assert alloc.needs_new_blocks("a", 600, 1) == 0 and alloc.needs_new_blocks("a", 768, 1) == 1
    assert alloc.block_table == {"a": [0, 1, 2]}
    assert not cache.can_store_request_tokens(_State("b"), 300)  # 2 blocks, 1 free: nothing taken
    assert "b" not in cache.table and cache.get_num_free_blocks() == 1
    assert cache.can_store_request_tokens(_State("b"), 300, dry_run=True) is False
    assert cache.can_store_request_tokens(_State("b"), 200, dry_run=True) and "b" not in cache.table
    assert cache.can_store_request_tokens(_State("b"), 200)
    assert cache.count_storable_requests([{"full_attention": 0}, {"full_attention": 1}]) == 1
    cache.free_blocks("a", no_cache=True)
    cache.free_blocks("a")  # the engine frees a preempted request twice: a no-op
    assert cache.count_storable_requests([{"full_attention": 2}, {"full_attention": 1}, {"full_attention": 1}]) == 2
    assert cache.can_store_request_tokens(_State("c"), 1)
    assert not cache.can_store_request_tokens(_State("d"), 1)  # memory left, no row (max_requests=2)
    with caplog.at_level("WARNING", logger="vmem.transformers.engine519"):
        for _ in range(2):  # the engine retries a request it cannot schedule: said once
            assert not cache.can_store_request_tokens(_State("c", 1000), 25)  # past max_context (1024)
        # The warmup's probes (dry runs of growing lengths, 5.19+) are refused silently.
        assert not cache.can_store_request_tokens(_State("e", 1000), 25, dry_run=True)
    assert [r.getMessage() for r in caplog.records if "max_context" in r.getMessage()] == [
        "vmem: request c needs 1025 tokens, more than max_context (1024): it cannot be scheduled; raise max_context"]
    assert not cache.can_store_request_tokens(None, 1)  # never an exception (it would kill the engine's loop)
    assert cache.prepare_fork_request(_State("c"), ["c1"], {}) == []  # no forks: children start afresh
    cache.reset()
    cache.flush()
    assert len(cache.table) == 0 and cache.usage()["mapped_bytes"] == cache.trash_bytes()
    assert cache.compute_free_capacity() == 1.0


def test_prefix_blocks_complete_in_two_steps():
    """5.19+: ``count_new_complete_blocks`` before the forward, ``mark_complete_blocks`` after it
    publishes them; a later request adopts them."""
    cache = _cache_519(layout="token-major")  # 64-token blocks
    bs = cache.block_size
    prompt = list(range(3, 3 + 2 * bs + 10))
    assert cache.can_store_request_tokens(_State("a"), len(prompt))
    done = cache.count_new_complete_blocks(_State("a"), len(prompt))
    assert done == {"full_attention": 2}
    cache.extend_read_and_write_indices("a", 0, len(prompt), None, [[]])  # the forward's round

    class Req(_State):
        status = None
        initial_tokens = prompt
        generated_tokens = ()

    cache.mark_complete_blocks(Req("a", len(prompt)), done)
    assert cache.search_prefix_match("b", prompt + [7]) == 2 * bs


def test_vmem_is_never_switched_to_flash(tiny, monkeypatch):
    """With FlashAttention installed, the engine's switch_to_cb_friendly_attn switches a name that
    is neither paged nor flash to flash_attention_3 (5.17 and 5.19+), and 5.19+ refuses any other
    name: `vmem` stays vmem's (5.17 runs it as paged|vmem), and the model gets it back at stop."""
    import torch
    import transformers
    from transformers.generation.continuous_batching import continuous_api

    import vmem.transformers as vt

    eng = _engine()
    monkeypatch.setattr(continuous_api, "is_flash_attn_3_available", lambda *a, **k: True)
    vt.install(**OPTS)
    model = tiny.make_model("llama-gqa", torch.float32, "cpu")
    model.set_attn_implementation("vmem")
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    m = model.init_continuous_batching(generation_config=gen)
    assert model.config._attn_implementation == ("paged|vmem" if eng.IS_517 else "vmem")
    m.start()
    try:
        m.add_request([5, 6, 7], request_id="r", max_new_tokens=2)
        r = m.get_result(request_id="r", timeout=60)
        assert r is not None and r.error is None
        assert type(m.batch_processor.cache) is vt.cache_class()
    finally:
        m.stop(block=True, timeout=30)
    assert model.config._attn_implementation == "vmem"


# -- the patch table against the installed engine -----------------------------------------------------
def _rows():
    eng = _engine()
    from vmem.transformers import patches

    return patches, patches.patches_for(versions.check(eng.VERSION))


def test_every_target_of_the_table_is_there_with_the_parameters_it_expects():
    """For the installed transformers, each row that applies names a member the engine defines
    itself (in the class's or module's own ``__dict__``) with exactly the parameters the table
    says; one row per member; every served release has rows for each member vmem needs."""
    patches, rows = _rows()
    assert len(rows) == (14 if versions.release(transformers_version()) == (5, 17) else 13)
    targets = [p.target for p in rows]
    assert len(set(targets)) == len(targets), targets
    for p in rows:
        member = p.holder().__dict__.get(p.member)
        assert member is not None, f"{p.target} is not defined in transformers {transformers_version()}"
        params = tuple(inspect.signature(member).parameters)
        assert params == p.params, f"{p.target}: the table expects {p.params}, transformers has {params}"
    assert patches.target_problems(versions.check(transformers_version())) == []
    for release in versions.SERVED:  # the members every served release must have replaced
        names = {p.target for p in patches.patches_for(release)}
        assert {"continuous_api.PagedAttentionCache", "continuous_api.ContinuousBatchingManager.__init__",
                "continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn",
                "model_runner.ModelRunner.compute_batch", "scheduler.Scheduler.__init__"} <= names, release


def transformers_version():
    import transformers

    return transformers.__version__


def test_a_moved_target_is_reported(monkeypatch):
    """The check can fail: a member gone, or one whose parameters changed, is named."""
    patches, rows = _rows()
    release = versions.check(transformers_version())
    runner = next(p for p in rows if p.member == "maybe_pad_inputs").holder()
    monkeypatch.delattr(runner, "maybe_pad_inputs")
    monkeypatch.setattr(runner, "warmup", lambda self, model, extra=None: None)
    problems = patches.target_problems(release)
    assert len(problems) == 2, problems
    assert "ModelRunner.maybe_pad_inputs: not defined there" in problems[0] + problems[1]
    assert "('self', 'model', 'extra')" in problems[0] + problems[1]


def test_no_row_acts_for_every_cache():
    patches, _ = _rows()
    assert {p.scope for p in patches.PATCHES} <= {patches.VMEM_CACHE, patches.VMEM_NAME}
    assert all(p.puts and p.versions.first <= p.versions.last for p in patches.PATCHES)


def test_uninstall_restores_every_member_and_install_is_idempotent(tiny):
    import vmem.transformers as vt

    _, rows = _rows()
    vt.uninstall()
    originals = {p.target: p.holder().__dict__[p.member] for p in rows}
    vt.install()
    vt.install(**OPTS)  # again: nothing applied twice
    for p in rows:
        now = p.holder().__dict__[p.member]
        assert now is not originals[p.target] and now.__wrapped__ is originals[p.target], p.target
    vt.uninstall()
    for p in rows:
        assert p.holder().__dict__[p.member] is originals[p.target], p.target


def test_an_unknown_version_is_refused_before_anything_is_patched(tiny, monkeypatch):
    import vmem.transformers as vt

    _, rows = _rows()
    vt.uninstall()
    originals = {p.target: p.holder().__dict__[p.member] for p in rows}
    monkeypatch.setattr(versions, "installed", lambda: "5.26.0")
    with pytest.raises(vmem.VmemError, match="5.26.0"):
        vt.install()
    assert all(p.holder().__dict__[p.member] is originals[p.target] for p in rows)


def test_every_row_leaves_other_caches_and_models_to_the_engine(tiny):
    """Called with the engine's own cache (not a VmemCBCache, though it has every field vmem's
    has) and a model on ``sdpa``, each replacement calls the engine's member with the same
    arguments and returns what it returns: installing vmem changes nothing for them."""
    _, rows = _rows()
    config = types.SimpleNamespace(_attn_implementation="sdpa")
    model = types.SimpleNamespace(config=config)
    other = types.SimpleNamespace(max_context=64, round_kind="decode", round_buffers=object(), admission_margin=0.1,
                                  table={}, kv=None, options=None)
    pair = types.SimpleNamespace(host_io=types.SimpleNamespace(cache=other))
    me = type("Engine", (), {})()  # the engine's manager, scheduler, runner or IOs
    me.__dict__.update(cache=other, config=config, io_pairs=[pair, pair], current_pair=0, generation_config=None)
    for p in rows:
        engine_member = p.holder().__dict__[p.member]
        signature = inspect.signature(engine_member)
        seen = []

        def original(*args, _signature=signature, **kwargs):
            seen.append(_signature.bind(*args, **kwargs).arguments)
            return "engine's"

        values = {"self": me, "config": config, "model": model, "cache": other, "inputs": [[1, 2]], "kwargs": None}
        args = [values.get(name, object()) for name in p.params if name != "kwargs"]
        got = p.make(original)(*args)
        assert len(seen) == 1, f"{p.target}: the engine's member ran {len(seen)} times"
        assert list(seen[0].values()) == args, f"{p.target}: the engine's member got other arguments"
        if p.member != "__init__":
            assert got == "engine's", p.target


def test_an_mla_model_is_refused_with_invalid_argument(tiny):
    """DeepSeek-V3-style models (``kv_lora_rank``: one compressed latent per token, which 5.25
    serves in continuous batching) are refused before the engine starts, in the caller's thread,
    on every version; the cache refuses them too, and so does VmemCache for generate()."""
    import torch
    import transformers

    import vmem.transformers as vt

    config_cls = getattr(transformers, "DeepseekV3Config", None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3Config")
    cfg = config_cls(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                     q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    vt.install(**OPTS)
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(vmem.InvalidArgument, match="MLA.*kv_lora_rank=16"):
        model.generate_batch([[5, 6, 7]], generation_config=gen)
    with pytest.raises(vmem.InvalidArgument, match="MLA"):
        model.init_continuous_batching(generation_config=gen)
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    with pytest.raises(vmem.InvalidArgument, match="MLA"):
        vt.cache_class()(model.config, cb, "cpu", dtype=torch.float32, options=vt.Options(**OPTS))
    with pytest.raises(vmem.InvalidArgument, match="MLA"):
        vt.VmemCache(model.config, 1, 64, device="cpu", backend="host")
    if versions.release(transformers.__version__) >= (5, 25):  # the engine's own cache serves it (latents)
        model.set_attn_implementation("sdpa")
        out = model.generate_batch([[5, 6, 7]], generation_config=gen)
        assert [len(r.generated_tokens) for r in out.values()] == [2]


def test_the_benches_build_models_without_hub_kernels():
    """transformers 5.25 kernelizes ``from_pretrained`` models with hub kernels by default; the
    benches' model builder pins them off (``USE_HUB_KERNELS=NO``) so vmem and the engine run the
    same non-attention code, and its models are not kernelized."""
    _engine()
    import torch
    from harness import models

    assert os.environ.get("USE_HUB_KERNELS") == "NO"
    model = models.random_model(models.check_config("llama-gqa"), torch.float32, "cpu")
    assert getattr(model, "use_kernels", False) is False
    from transformers.integrations import hub_kernels

    if callable(getattr(hub_kernels, "_kernels_enabled", None)):  # 5.25+: what from_pretrained asks first
        assert hub_kernels._kernels_enabled() is False
