"""``prompt_reader="flashinfer"`` (:mod:`vmem.kernels.fa_prompts`): which rounds FlashInfer's
prefill reads (a round with a prompt run eagerly; a split mixed round's prompts; never a decode
round or a round being captured), its output equal to FlashAttention's in any query order and
with the engine's padding (zeros past the requests), one wrapper per IO pair, the option's
checks, and the engine's greedy tokens equal with and without it.

CPU, fp32: FlashInfer's kernels need a CUDA GPU, so the reader runs the paged reference over its
plan, or a stand-in FlashInfer (``fake_flashinfer.py``) that checks what a plan passes. On a GPU:
``test_gpu.py::test_fa_prompts_match_flash_attention``."""

import random
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import vmem  # noqa: E402
from vmem.kernels import fa as fa_module  # noqa: E402
from vmem.kernels import fa_mixed, fa_prompts  # noqa: E402
from vmem.kernels import flashinfer as vk_fi  # noqa: E402
from vmem.kernels.buffers import RoundBuffers  # noqa: E402
from vmem.kernels.fa import FaReader, fa_varlen_indices, fa_varlen_reference  # noqa: E402
from vmem.kernels.rounds import Round  # noqa: E402

CPU = torch.device("cpu")
HQ, HKV, D = 8, 2, 16


@pytest.fixture
def flashinfer_module(monkeypatch):
    """An importable ``flashinfer`` (the reader imports it; on the CPU it runs the reference)."""
    from fake_flashinfer import FakeFlashInfer

    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    return fake


def _reader(mc, **kw):
    return fa_prompts.PromptReader(mc, CPU, HQ, HKV, D, torch.float32, **kw)


def _kv(rows, mc, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows * mc, HKV, D, generator=g), torch.randn(rows * mc, HKV, D, generator=g)


def _round(entries, meta=None, pair=0):
    rnd = Round()
    rnd.entries = [(r, p, n, None) for r, p, n in entries]
    rnd.meta, rnd.pair = meta, pair
    return rnd


def _random_round(rng, rows, mc, decodes):
    entries = []
    for row in rng.sample(range(rows), rng.randint(1, rows)):
        q = 1 if decodes and rng.random() < 0.5 else rng.randint(2, 40)
        entries.append((row, rng.randint(0, mc - q), q))
    if all(e[2] == 1 for e in entries):
        entries.append((rows, 3, 12))
    return entries


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decodes", [False, True])
def test_an_eager_round_with_prompts_reads_what_flash_attention_reads(seed, decodes, monkeypatch, flashinfer_module):
    """Prompts only, or prompts beside decodes (split or not), in any query order: the reader
    with FlashInfer's prompts gives FlashAttention's output (both references here)."""
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1 if seed % 2 else 1 << 40)
    rng = random.Random(seed)
    mc, rows = 256, 9
    entries = _random_round(rng, rows, mc, decodes)
    k, v = _kv(rows + 1, mc, seed)
    q = torch.randn(sum(e[2] for e in entries), HQ, D, generator=torch.Generator().manual_seed(seed))
    want = fa_varlen_reference(q, k, v, fa_varlen_indices(entries, mc), 0.3)
    prompts = _reader(mc)
    attend, read = prompts.attend, []

    def counted(q, *a):
        read.append(q.shape[0])
        return attend(q, *a)

    monkeypatch.setattr(prompts, "attend", counted)
    reader = FaReader(mc, prompts=prompts)
    rnd = _round(entries)
    outs = [reader(layer, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.3, True)[0] for layer in range(2)]
    split = isinstance(rnd.index, fa_mixed.MixedRound)
    assert split == (decodes and seed % 2 == 1 and any(e[2] == 1 for e in entries))
    assert isinstance(rnd.index.prompts if split else rnd.index, fa_prompts.PromptPlan)
    assert prompts.plans == 1  # planned once, at the first layer
    prompt_tokens = sum(e[2] for e in entries if e[2] > 1) if split else q.shape[0]
    assert read == [prompt_tokens] * 2  # FlashInfer read the prompts (a split round's: only those) at every layer
    for out in outs:
        assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()


@pytest.mark.parametrize("captured", [False, True])
def test_the_engines_padding_gets_zeros_and_a_capture_reads_the_metadata(captured, monkeypatch, flashinfer_module):
    """A padded round run eagerly (above ``graph_max_tokens``): FlashInfer reads the real
    requests, the padded tokens are zeros, as FA's one call over the metadata gives; the capture
    of the same round (the engine captures after its eager pass) reads the padded metadata with
    FlashAttention, never the eager plan."""
    mc, entries = 128, [(0, 40, 5), (1, 0, 6), (2, 90, 3)]
    meta = RoundBuffers(8, mc, 3, CPU, max_tokens=32).fill(entries, sequences=8, tokens=32, padded=True, bucket_k=mc)
    k, v = _kv(4, mc)
    q = torch.randn(32, HQ, D, generator=torch.Generator().manual_seed(5))
    want = fa_varlen_reference(q, k, v, meta, 0.5)
    reader = FaReader(mc, prompts=_reader(mc))
    rnd = _round(entries, meta)
    reader.before_forward(rnd, padded=True, pair=0, stream=None)
    eager = reader(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)[0]
    assert isinstance(rnd.index, fa_prompts.PromptPlan) and rnd.index.tokens == 14 and rnd.index.total_q == 32
    assert torch.allclose(eager, want, atol=1e-5) and torch.equal(eager[14:], torch.zeros_like(eager[14:]))
    if captured:
        monkeypatch.setattr(fa_module, "capturing", lambda: True)
        graph = reader(1, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)[0]
        assert rnd.index is meta and torch.allclose(graph, want, atol=1e-5)


def test_decode_rounds_stay_flash_attentions(flashinfer_module):
    mc, entries = 128, [(0, 40, 1), (1, 7, 1)]
    k, v = _kv(3, mc)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(2))
    prompts = _reader(mc)
    rnd = _round(entries)
    got = FaReader(mc, prompts=prompts)(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)[0]
    assert prompts.plans == 0 and not isinstance(rnd.index, fa_prompts.PromptPlan)
    assert torch.allclose(got, fa_varlen_reference(q, k, v, fa_varlen_indices(entries, mc), 0.5), atol=1e-5)


def test_a_layer_with_another_scale_or_token_count_is_refused(flashinfer_module):
    mc, entries = 128, [(0, 0, 6), (1, 3, 4)]
    k, v = _kv(2, mc)
    q = torch.randn(10, HQ, D)
    reader = FaReader(mc, prompts=_reader(mc))
    rnd = _round(entries)
    reader(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)
    with pytest.raises(vmem.VmemError, match="softmax scale"):
        reader(1, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.25, True)
    with pytest.raises(vmem.VmemError, match="query tokens"):
        reader(1, rnd, q[:9].transpose(0, 1).unsqueeze(0), k, v, 0.5, True)
    with pytest.raises(vmem.VmemError, match="passed as"):
        _reader(mc).plan(entries, pair=0, scale=0.5, total_q=9)
    with pytest.raises(vmem.VmemError):
        _reader(mc).plan([(0, 120, 9)], pair=0, scale=0.5)  # past the row


def test_a_plan_the_pair_has_replaced_and_bad_arguments_are_refused(flashinfer_module):
    """FlashInfer's wrapper holds one plan per IO pair: a round planned before the pair's last
    plan is refused, not read with another round's schedule; so are a pair that is no whole
    number, queries of another shape or dtype, and K/V that are not whole rows."""
    mc, entries = 128, [(0, 0, 6), (1, 3, 4)]
    k, v = _kv(2, mc)
    q = torch.randn(10, HQ, D)
    prompts = _reader(mc)
    old = prompts.plan(entries, pair=1, scale=0.5)
    new = prompts.plan(entries, pair=1, scale=0.5)
    other = prompts.plan(entries, pair=0, scale=0.5)
    assert prompts.pairs_planned == [0, 1]
    with pytest.raises(vmem.VmemError, match="before the pair's last plan"):
        prompts.attend(q, k, v, old, 0.5)
    for planned in (new, other):
        got = prompts.attend(q, k, v, planned, 0.5)
        assert torch.allclose(got, fa_varlen_reference(q, k, v, fa_varlen_indices(entries, mc), 0.5), atol=1e-5)
    for pair in (True, -1, "0", 1.0):
        with pytest.raises(vmem.VmemError, match="IO pair"):
            prompts.plan(entries, pair=pair, scale=0.5)
    with pytest.raises(vmem.VmemError, match="passed as"):
        prompts.plan(entries, pair=0, scale=0.5, total_q=10.0)
    for bad in (q[:, :4], q.double(), q.unsqueeze(0)):
        with pytest.raises(vmem.VmemError, match="queries of shape"):
            prompts.attend(bad, k, v, other, 0.5)
    with pytest.raises(vmem.VmemError, match="not rows of"):
        prompts.attend(q, k[:100], v[:100], other, 0.5)


def test_the_engine_hook_gives_the_round_its_io_pair():
    pytest.importorskip("transformers", reason="transformers is not installed")
    import tf_engine as eng

    eng.skip_unless_served()
    import types

    from vmem.kernels.rounds import Rounds
    from vmem.transformers import Options
    from vmem.transformers import graphs as vt_graphs

    mc = 64
    cache = types.SimpleNamespace(rounds=Rounds(), round_buffers=RoundBuffers(4, mc, 3, CPU, max_tokens=16),
                                  options=Options(), read=None, round_kind=None)
    for pair in (1, 0):
        cache.rounds.record(0, 5, 3)
        cache.rounds.record(1, 0, 2)
        batch = {"cu_seq_lens_q": torch.tensor([0, 3, 5]), "input_ids": torch.zeros(1, 5, dtype=torch.long)}
        rnd = vt_graphs.prepare_round(cache, batch, padded=False, stream=None, pair=pair)
        assert rnd.pair == pair and rnd.meta.total_q == 5


def test_one_wrapper_per_io_pair_planned_with_the_rounds_arrays(monkeypatch, flashinfer_module):
    """With FlashInfer's wrappers (the stand-in): one eager prefill wrapper per IO pair, made at
    its first plan, over one float workspace; the plan's pages and each request's keys passed
    (the stand-in checks they agree); the run writes the requests' tokens into the output, the
    padded ones zeros."""
    monkeypatch.setattr(vk_fi, "kernels_on", lambda device: True)
    mc = 128
    prompts = _reader(mc)
    k, v = _kv(4, mc)
    g = torch.Generator().manual_seed(7)
    rounds = [([(0, 40, 5), (2, 0, 6)], 0, 11), ([(1, 0, 130 - 2), (3, 2, 9)], 1, 140), ([(2, 3, 3)], 0, 3)]
    for entries, pair, total in rounds:
        planned = prompts.plan(entries, pair=pair, scale=0.5, total_q=total)
        assert planned.wrapper is prompts.wrappers[pair] and planned.wrapper.backend == "fa2"
        q = torch.randn(total, HQ, D, generator=g)
        got = prompts.attend(q, k, v, planned, 0.5)
        n = planned.tokens
        want = fa_varlen_reference(q[:n], k, v, fa_varlen_indices(entries, mc), 0.5)
        assert torch.allclose(got[:n], want, atol=1e-5) and torch.equal(got[n:], torch.zeros_like(got[n:]))
    assert sorted(prompts.wrappers) == [0, 1] and len(flashinfer_module.made) == 2  # made with the reader
    assert prompts.wrappers[0].workspace is prompts.wrappers[1].workspace
    assert prompts.plans == 3


def test_a_layers_pages_are_a_view_of_its_rows_made_once(flashinfer_module):
    """Token-major strides (a token's K of every layer side by side): page ``row * P + j`` is the
    row's tokens ``[j * page, (j + 1) * page)``, a view of the layer's flat K."""
    mc, layers = 512, 3
    prompts = _reader(mc)
    whole = torch.randn(2 * mc, 2 * layers * HKV, D)
    flat = whole[:, 2 * HKV:3 * HKV]  # layer 1's K
    pages = prompts.pages(flat)
    page = vk_fi.page_tokens(mc)
    assert pages.shape == (2 * mc // page, page, HKV, D) and pages.data_ptr() == flat.data_ptr()
    assert torch.equal(pages[mc // page + 1], flat[mc + page:mc + 2 * page])
    assert prompts.pages(flat) is pages


def test_without_flashinfer_the_reader_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(vmem.InvalidArgument, match=r"prompt_reader='flashinfer' need FlashInfer.*pip install"):
        _reader(128)


def test_the_option_is_checked():
    pytest.importorskip("transformers", reason="transformers is not installed")
    from vmem.transformers import Options

    assert Options().prompt_reader == "fa"
    assert Options(prompt_reader="flashinfer").prompt_reader == "flashinfer"
    assert Options(kernel="fa+flashinfer", prompt_reader="flashinfer").prompt_reader == "flashinfer"
    for bad in ("FlashInfer", "", None, True, 1, "triton"):
        with pytest.raises(vmem.InvalidArgument, match="prompt_reader"):
            Options(prompt_reader=bad)
    for kernel in ("flex", "flashinfer"):
        with pytest.raises(vmem.InvalidArgument, match="reads them itself"):
            Options(kernel=kernel, prompt_reader="flashinfer")


@pytest.mark.parametrize("padding", [False, True])
def test_greedy_tokens_with_flashinfers_prompts_equal_flash_attentions(padding, monkeypatch, flashinfer_module):
    """The engine's rounds (prompts in chunks beside the decodes before them; under its padding
    too, what graphs and compile turn on) read with ``prompt_reader="flashinfer"`` (the stand-in
    wrappers, every plan of a prompt round checked) give FA's greedy tokens."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import contextlib

    import tf_engine as eng

    eng.skip_unless_served()
    from harness import check as h

    import vmem.transformers as vt

    monkeypatch.setattr(vk_fi, "kernels_on", lambda device: True)
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 64)
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    lengths = [5, 140, 70, 17, 33, 3, 90, 60]
    prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
    cb = dict(max_batch_tokens=48)
    if padding:
        cb.update(q_padding_interval_size=16, kv_padding_interval_size=256)
    opts = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
    try:
        with eng.forced_padding() if padding else contextlib.nullcontext():
            vt.install(**opts)
            fa = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=cb, serving=dict(opts))
            made = len(flashinfer_module.made)
            fi_opts = dict(opts, prompt_reader="flashinfer")
            vt.install(**fi_opts)
            fi = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=cb, serving=fi_opts)
    finally:
        vt.uninstall()
    planned = flashinfer_module.made[made:]
    assert made == 0 and planned and sum(w.plans for w in planned) > 0, "no round was read by FlashInfer"
    tokens = [[list(run["results"][rid].generated_tokens) for rid in run["ids"]] for run in (fi, fa)]
    assert tokens[0] == tokens[1]
    cmp = h.compare(fi, model, 6)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < 1e-4 and cmp["top1_agree"] == cmp["decisive"] > 0, cmp


def test_a_model_flashinfer_does_not_serve_is_refused_naming_the_option():
    """The cache's geometry on CUDA (checked before anything touches the device): a head dim
    FlashInfer's prefill does not serve is refused in the prompt reader's words, with its way
    out; ``kernel='flashinfer'`` keeps its own."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import vmem.transformers as vt
    from vmem.transformers.sizing import Geometry

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=64)
    with pytest.raises(vmem.InvalidArgument, match=r"prompt_reader='flashinfer' serves head_dim 64 or 128, not 256; "
                                                   r"use prompt_reader='fa'$"):
        Geometry(config, torch.bfloat16, torch.device("cuda"), vt.Options(prompt_reader="flashinfer"), 1 << 30)
    vk_fi.check_model(torch.bfloat16, 128, asked_by="prompt_reader='flashinfer'", other_dtypes="prompt_reader='fa'")
    with pytest.raises(vmem.InvalidArgument, match=r"serves float16 and bfloat16.*use prompt_reader='fa'$"):
        vk_fi.check_model(torch.float32, 128, asked_by="prompt_reader='flashinfer'", other_dtypes="prompt_reader='fa'")
    with pytest.raises(vmem.InvalidArgument, match=r"kernel='flashinfer' serves head_dim .* use kernel='fa'$"):
        vk_fi.check_model(torch.bfloat16, 96)
    with pytest.raises(vmem.InvalidArgument, match=r"kernel='flashinfer' serves float16 .* use kernel='flex'$"):
        vk_fi.check_model(torch.float32, 64)


def test_install_refuses_the_prompt_reader_without_flashinfer_and_keeps_the_options(monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed")
    import tf_engine as eng

    eng.skip_unless_served()
    import vmem.transformers as vt

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    try:
        vt.install(page_size="64K", max_requests=8)
        with pytest.raises(vmem.InvalidArgument, match=r"prompt_reader='flashinfer' need FlashInfer"):
            vt.install(prompt_reader="flashinfer")
        assert vt.options().prompt_reader == "fa" and vt.options().max_requests == 8
    finally:
        vt.uninstall()
