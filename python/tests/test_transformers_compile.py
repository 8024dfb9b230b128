"""vmem under the engine's compiled forward (``varlen_compile_config``), on the CPU (fp32, host
backend): Dynamo compiles the layers around vmem's attention and leaves the attention out, so
every round is read from the cache's state. Checked here: the compiled runs give the greedy
tokens and logits of uncompiled ones and of the engine's own paged path; the graphs Dynamo built
hold the model's layers and none of vmem's cache writes; what cannot work is refused when the
cache is built, saying what to pass. Inductor's code itself is the GPU's:
``test_gpu.py::test_cb_compile`` and the serving suite's ``-compile`` contenders.

On a CPU-only host torch 2.11 crashes (SIGSEGV in ``c10::impl::ensureCUDADeviceGuardSet``,
which FakeTensorMode enters there) when a second engine thread traces a forward after the first
thread, which registered the no-op CUDA device guard, has ended. The fixture registers it once
on the main thread, which outlives every engine thread. A GPU host never enters that function.
The engine's own path is compared uncompiled."""

import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import check as h

import vmem
import vmem.transformers as vt
from vmem.transformers import attention as vt_attention

TOL = 1e-4
NEW = 5
LENGTHS = [5, 140, 70, 17, 33, 3]
OPTS = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
PAD = dict(max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=256)


@pytest.fixture(autouse=True)
def _installed():
    if not torch.cuda.is_available():
        torch._C._ensureCUDADeviceGuardSet()  # on the main thread: see the module's docstring
    h.fake_cpu_memory()
    vt.install(**OPTS)
    torch._dynamo.reset()
    yield
    vt.uninstall()
    torch._dynamo.reset()


def recorder():
    """A Dynamo backend that runs each graph as traced (no Inductor: the CPU has no time for it)
    and keeps the graphs in ``backend.graphs`` (a function: the engine deep-copies its config,
    and a function is copied as itself)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend.graphs = graphs
    return backend


def targets(backend):
    """What the calls of the graphs ``backend`` kept call."""
    return [str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _serve(model, attn, prompts, **cb):
    return h.run_engine(model, attn, prompts, NEW, cb_kwargs=dict(PAD, **cb))


def _tokens(run):
    return [list(run["results"][rid].generated_tokens) for rid in run["ids"]]


@pytest.mark.parametrize("layout", ["token-major"])  # per-layer: the same graph break (CI's time)
def test_compiled_rounds_match_uncompiled_ones_and_the_engines_own_path(layout):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with vt.serving(**dict(OPTS, layout=layout)):
        plain = _serve(model, vt.VMEM_ATTENTION, prompts)
        ours = recorder()
        compiled = _serve(model, vt.VMEM_ATTENTION, prompts,
                          varlen_compile_config=transformers.CompileConfig(fullgraph=False, mode="default",
                                                                           dynamic=True, backend=ours))
    engine = _serve(model, eng.ENGINE_SDPA, prompts)
    # The forward was compiled: graphs with the model's matmuls, and none writing vmem's rows
    # (the attention, index_copy_ into the cache, is left out and runs eagerly).
    assert any("linear" in t for t in targets(ours))
    assert not any("index_copy" in t for t in targets(ours))
    assert _tokens(compiled) == _tokens(plain) == _tokens(engine)
    cmp = h.compare(compiled, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp


def test_the_attention_is_left_out_of_a_compiled_function():
    """Called under ``torch.compile`` (fullgraph off), vmem's attention is a graph break: the
    graph Dynamo builds holds what surrounds the call, not the call."""
    seen = recorder()

    def around(x, cache):
        y = x * 2
        out, _ = vt_attention.paged_attention(types.SimpleNamespace(layer_idx=0), y, y, y, cache=cache,
                                              write_index=[torch.zeros(1, dtype=torch.long)])
        return out + 1

    class Cache:
        calls = 0

        def kv_layer(self, layer):
            return torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)

        class rounds:  # noqa: N801 - a stand-in for the cache's Rounds
            @staticmethod
            def close():
                return None

        def read(self, layer, rnd, query, k, v, scaling, gqa):
            Cache.calls += 1
            return query.transpose(1, 2) * Cache.calls  # a Python int a trace would bake in

    x = torch.ones(1, 1, 1, 2)
    fn = torch.compile(around, backend=seen, fullgraph=False)
    first, second = fn(x, Cache()), fn(x, Cache())
    assert Cache.calls == 2 and not torch.equal(first, second)  # read ran eagerly each call
    assert seen.graphs and not any("index_copy" in t for t in targets(seen))


def _build(kernel="fa", **cb):
    cfg = h.make_config("llama-gqa")
    return vt.cache_class()(cfg, transformers.ContinuousBatchingConfig(max_batch_tokens=64, **cb), "cpu",
                            dtype=torch.float32, options=vt.Options(**dict(OPTS, kernel=kernel)))


@pytest.mark.parametrize("which", ["varlen_compile_config", "decode_compile_config"])
@pytest.mark.parametrize("kernel", ["fa", "flashinfer"])
def test_a_compiled_forward_is_taken_by_fa_and_flashinfer(kernel, which, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    for mode in ("default", "max-autotune-no-cudagraphs"):
        config = transformers.CompileConfig(fullgraph=False, mode=mode)
        cache = _build(kernel, **{which: config})
        assert cache.kernel == kernel


@pytest.mark.parametrize("which", ["varlen_compile_config", "decode_compile_config"])
def test_what_a_compiled_forward_cannot_do_is_refused_saying_what_to_pass(which):
    cases = [
        (dict(fullgraph=True, mode="default"), "fa", "fullgraph=True.*CompileConfig\\(fullgraph=False"),
        (dict(fullgraph=False), "fa", "'reduce-overhead' turns on Inductor's CUDA graphs.*mode='default'"),
        (dict(fullgraph=False, mode="max-autotune"), "fa", "'max-autotune' turns on Inductor's CUDA graphs"),
        (dict(fullgraph=False, mode="default", options={"triton.cudagraphs": True}), "fa", "Inductor's CUDA graphs"),
        (dict(fullgraph=False, mode="default"), "flex", "kernel='flex' is not supported.*kernel='fa'"),
    ]
    for kw, kernel, message in cases:
        with pytest.raises(vmem.InvalidArgument, match=message):
            _build(kernel, **{which: transformers.CompileConfig(**kw)})
    for wrong in ("yes", True, 1):  # the engine keeps them as given (a dict it makes a CompileConfig)
        with pytest.raises(vmem.InvalidArgument, match="must be a transformers.CompileConfig"):
            _build("fa", **{which: wrong})


def test_the_engines_default_compile_level_is_refused_on_517_and_taken_on_519():
    """``default_compile_level=1`` resolves to ``fullgraph=True`` for 5.17's varlen path: refused
    when the engine builds the cache, in its thread, before any round (the engine fails the
    requests with vmem's message; the harness raises the first). 5.19+ resolves it to
    ``fullgraph=False``, which vmem takes."""
    if eng.IS_517:
        model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
        prompts = h.make_prompts(2, [5, 9], model.config.vocab_size)
        with pytest.raises(RuntimeError, match="req0 failed: vmem: a compile config with fullgraph=True.*"
                                               "CompileConfig\\(fullgraph=False"):
            _serve(model, vt.VMEM_ATTENTION, prompts, default_compile_level=1)
        return
    from transformers.generation.continuous_batching import initialization

    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, default_compile_level=1)
    initialization.resolve_compile_configs(cb_config=cb, fallback_compile_config=None, is_flash_attn=False,
                                           decode_fast_path_available=False)
    assert cb.varlen_compile_config is not None and not cb.varlen_compile_config.fullgraph
    cache = vt.cache_class()(h.make_config("llama-gqa"), cb, "cpu", dtype=torch.float32, options=vt.Options(**OPTS))
    assert cache.kernel == "fa"
