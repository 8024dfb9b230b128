"""``kernel="fa"``'s mixed rounds in two calls (:mod:`vmem.kernels.fa_mixed`): which rounds are
split, where each part's query tokens are, the split attention equal to the one-call one in any
query order, and the engine's greedy tokens with the split equal to those without it and to the
engine's own.

CPU, fp32 (the same split over the reference); needs torch, and for the engine test a
transformers vmem serves. On a GPU: ``test_gpu.py::test_fa_mixed_round_matches_one_call``."""

import random

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from vmem.kernels import fa_mixed  # noqa: E402
from vmem.kernels.buffers import RoundBuffers  # noqa: E402
from vmem.kernels.fa import FaReader, fa_varlen_indices, fa_varlen_reference  # noqa: E402
from vmem.kernels.rounds import Round  # noqa: E402

CPU = torch.device("cpu")


def _kv(rows, mc=512, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows * mc, hkv, d, generator=g), torch.randn(rows * mc, hkv, d, generator=g)


def _q(entries, hq=8, d=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(e[2] for e in entries), hq, d, generator=g)


def test_a_round_without_both_kinds_or_with_few_decode_keys_is_not_split(monkeypatch):
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 100)
    assert fa_mixed.plan_mixed([(0, 200, 1), (1, 300, 1)], 512, CPU) is None  # decodes only
    assert fa_mixed.plan_mixed([(0, 0, 40), (1, 10, 5)], 512, CPU) is None  # no decode
    assert fa_mixed.plan_mixed([(0, 50, 1), (1, 0, 40)], 512, CPU) is None  # 51 decode keys < 100
    mixed = fa_mixed.plan_mixed([(0, 150, 1), (1, 0, 40)], 512, CPU)
    assert mixed is not None and mixed.decode.index.max_q == 1 and mixed.rest.index.max_q == 40


def test_the_parts_find_their_query_tokens_in_the_engines_order(monkeypatch):
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    # decodes first, then two prefill chunks: both parts contiguous, slices
    m = fa_mixed.plan_mixed([(0, 9, 1), (1, 4, 1), (2, 0, 5), (3, 2, 3)], 64, CPU)
    assert m.decode.span == slice(0, 2) and m.rest.span == slice(2, 10)
    # interleaved: decodes at 0 and 6, the rest 1..5 and 7..8
    m = fa_mixed.plan_mixed([(0, 9, 1), (2, 0, 5), (1, 4, 1), (3, 2, 3)], 64, CPU)
    assert m.decode.span is None and m.decode.positions.tolist() == [0, 6]
    assert m.rest.span is None and m.rest.positions.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert m.rest.index.host.tolist()[:3] == [0, 5, 8]  # the rest's own cu_q


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_split_attention_equals_one_call_in_any_order(seed, slots, monkeypatch):
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    rng = random.Random(seed)
    mc, rows = 256, 10
    entries = []
    for row in rng.sample(range(rows), rng.randint(2, rows)):
        q = rng.choice([1, 1, rng.randint(2, 40)])
        entries.append((row, rng.randint(0, mc - q), q))
    if all(e[2] == 1 for e in entries) or all(e[2] > 1 for e in entries):
        entries.append((rows, 7, 1) if entries[0][2] > 1 else (rows, 3, 12))
    k, v = _kv(rows + 1, mc)
    q = _q(entries)
    whole = fa_varlen_indices(entries, mc)
    mixed = fa_mixed.plan_mixed(entries, mc, CPU, whole=whole, slots=slots)
    assert mixed is not None and (mixed.slots is not None) is slots
    if slots:  # the decodes' slot plan: two slots a decode, a long one split over several
        decodes = [e for e in entries if e[2] == 1]
        assert mixed.slots.rows == len(decodes) and mixed.slots.slots == 2 * len(decodes)
        counts = mixed.slots.host_part(4)
        assert all(c >= 1 for c in counts) and sum(counts) <= 2 * len(decodes)
    got = fa_mixed.attend(q, k, v, mixed, 0.3, lambda *a: fa_varlen_reference(*a))
    want = fa_varlen_reference(q, k, v, whole, 0.3)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("tokens,padded,captured,split", [(8, False, False, True), (12, True, False, True),
                                                          (12, True, True, False)])
def test_the_reader_splits_a_mixed_round_run_eagerly_and_not_one_a_graph_captures(tokens, padded, captured, split,
                                                                                  monkeypatch):
    """Split at the round's first layer when it runs eagerly, the engine's padded tokens zeros as
    in the one call; a round being captured keeps the one call (the graph's shapes)."""
    from vmem.kernels import fa as fa_reader

    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    monkeypatch.setattr(fa_reader, "capturing", lambda: captured)
    mc, entries = 128, [(0, 40, 1), (1, 0, 6), (2, 90, 1)]
    k, v = _kv(4, mc)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, 8, 16, generator=g)
    rnd = Round()
    rnd.entries = [(r, p, n, None) for r, p, n in entries]
    rnd.meta = RoundBuffers(8, mc, 3, CPU, max_tokens=16).fill(entries, sequences=3, tokens=tokens, padded=padded,
                                                               bucket_k=mc)
    want = fa_varlen_reference(q, k, v, rnd.meta, 0.5)  # the one call: padded tokens read nothing, zeros
    reader = FaReader(mc)
    reader.before_forward(rnd, padded=padded, pair=0, stream=None)
    got = reader(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)[0]
    assert isinstance(rnd.index, fa_mixed.MixedRound) is split
    assert got.is_contiguous() and torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[8:], torch.zeros_like(got[8:]))


def test_an_eager_padded_round_is_read_over_its_real_requests_only():
    """A padded varlen round (the engine's 256 sequences and 8,192 tokens at full size) read
    eagerly: one call over its real requests, ``max_q`` their longest query (FA2's grid is
    ``max_q / 128 x sequences x heads``), the same output as over the padded metadata; the
    metadata views are prefixes of the round's. A decode round and a round without padding come
    back as they are."""
    mc, entries = 128, [(0, 40, 5), (1, 0, 6), (2, 90, 3)]
    bufs = RoundBuffers(8, mc, 3, CPU, max_tokens=32)
    meta = bufs.fill(entries, sequences=8, tokens=32, padded=True, bucket_k=mc)
    real = meta.real_only()
    assert (meta.n, meta.max_q, meta.max_k) == (8, 32, mc)
    assert (real.n, real.real, real.max_q, real.max_k, real.total_q) == (3, 3, 6, 93, 32)
    assert real.host.tolist() == [0, 5, 11, 14, 0, 128, 256, 384, 45, 6, 93]  # cu_k[3]: the trash row, not read
    assert real.cu_q.data_ptr() == meta.cu_q.data_ptr() and real.used.data_ptr() == meta.used.data_ptr()
    assert real.cu_k.data_ptr() == meta.cu_k.data_ptr() and real.cu_k.tolist() == [0, 128, 256, 384]
    k, v = _kv(4, mc)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(32, 8, 16, generator=g)
    assert torch.equal(fa_varlen_reference(q, k, v, real, 0.5), fa_varlen_reference(q, k, v, meta, 0.5))
    rnd = Round()
    rnd.entries = [(r, p, n, None) for r, p, n in entries]
    rnd.meta = meta
    got = FaReader(mc)(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, False)[0]
    assert rnd.index.n == 3 and rnd.index.max_q == 6
    assert torch.allclose(got, fa_varlen_reference(q, k, v, meta, 0.5), atol=1e-6)
    assert meta.real_only() is not meta
    decode = bufs.fill([(0, 40, 1), (1, 7, 1)], sequences=2, tokens=8, padded=True, decode=True)
    unpadded = bufs.fill(entries, sequences=3, tokens=14, padded=False)
    assert decode.real_only() is decode and unpadded.real_only() is unpadded
    full = bufs.fill(entries, sequences=3, tokens=32, padded=True, bucket_k=mc)  # no padded sequence
    assert (full.real_only().n, full.real_only().max_q, full.real_only().max_k) == (3, 6, 93)


@pytest.mark.parametrize("split", [False, True])
def test_a_graph_captured_after_the_eager_pass_reads_the_padded_metadata(monkeypatch, split):
    """The engine runs a round eagerly and then captures a graph of the same round: the eager
    pass plans the round over its own sizes (its real requests, or its decodes in a call of
    their own), but the capture must read the padded metadata, which every later round of the
    graph's size rewrites in place. A plan kept from the eager pass would bake this round's
    sequences and ``max_q`` into the graph, and a replay would drop a later round's extra
    requests."""
    from vmem.kernels import fa as fa_module

    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    mc, entries = 128, [(0, 40, 1), (1, 0, 6), (2, 90, 3)] if split else [(0, 40, 5), (1, 0, 6), (2, 90, 3)]
    meta = RoundBuffers(8, mc, 3, CPU, max_tokens=32).fill(entries, sequences=8, tokens=32, padded=True, bucket_k=mc)
    k, v = _kv(4, mc)
    q = torch.randn(32, 8, 16, generator=torch.Generator().manual_seed(5)).transpose(0, 1).unsqueeze(0)
    rnd = Round()
    rnd.entries = [(r, p, n, None) for r, p, n in entries]
    rnd.meta = meta
    reader = FaReader(mc)
    reader.before_forward(rnd, padded=True, pair=0, stream=None)
    eager = reader(0, rnd, q, k, v, 0.5, True)[0]
    assert isinstance(rnd.index, fa_mixed.MixedRound) if split else rnd.index.n == 3
    monkeypatch.setattr(fa_module, "capturing", lambda: True)  # the engine's capture of the same round
    captured = [reader(layer, rnd, q, k, v, 0.5, True)[0] for layer in range(2)]
    assert rnd.index is meta
    for out in captured:
        assert torch.allclose(out[:10], eager[:10], atol=1e-5)


def test_the_reader_reads_a_mixed_rounds_decodes_with_the_slot_kernel_when_it_reads_decode_rounds(monkeypatch):
    """A cache whose decode rounds vmem's slot kernel reads (``split_reader="triton"``) reads a
    mixed round's decodes with it too, over a slot plan of their own; the output is the one
    call's (the CPU reference of both)."""
    from vmem.kernels import fa_split

    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    mc, entries = 128, [(0, 100, 1), (1, 0, 6), (2, 90, 1), (3, 50, 1)]
    k, v = _kv(5, mc)
    q = torch.randn(16, 8, 16, generator=torch.Generator().manual_seed(4))
    meta = RoundBuffers(8, mc, 4, CPU, max_tokens=16).fill(entries, sequences=4, tokens=16, padded=True, bucket_k=mc)
    want = fa_varlen_reference(q, k, v, meta, 0.5)
    for slot_kernel in (False, True):
        rnd = Round()
        rnd.entries = [(r, p, n, None) for r, p, n in entries]
        rnd.meta = meta
        reader = FaReader(mc, splits=fa_split.SplitBuffers(8, CPU, slot_kernel=slot_kernel))
        reader.before_forward(rnd, padded=True, pair=0, stream=None)
        got = reader(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, True)[0]
        assert isinstance(rnd.index, fa_mixed.MixedRound) and (rnd.index.slots is not None) is slot_kernel
        assert torch.allclose(got, want, atol=1e-5)


def test_a_round_without_grouped_heads_is_read_in_one_call(monkeypatch):
    monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
    calls = []

    def recording(q, *a):
        calls.append(a)
        return q

    monkeypatch.setattr(fa_mixed, "attend", recording)
    mc, entries = 128, [(0, 40, 1), (1, 0, 6), (2, 90, 1)]
    k, v = _kv(4, mc, hkv=8)
    q = _q(entries)
    want = fa_varlen_reference(q, k, v, fa_varlen_indices(entries, mc), 0.5)
    rnd = Round()
    rnd.entries = [(r, p, n, None) for r, p, n in entries]
    got = FaReader(mc)(0, rnd, q.transpose(0, 1).unsqueeze(0), k, v, 0.5, False)[0]
    assert not calls and not isinstance(rnd.index, fa_mixed.MixedRound)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("padding", [False, True])
def test_greedy_tokens_with_mixed_rounds_split_equal_one_call_and_the_engines(padding, monkeypatch):
    """Also under the engine's padding (what graphs and compile turn on): its varlen rounds run
    eagerly on the CPU, padded, and are split."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import contextlib

    import tf_engine as eng

    eng.skip_unless_served()
    from harness import check as h

    import vmem.transformers as vt

    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    lengths = [5, 140, 70, 17, 33, 3, 90, 60]
    prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
    plans = []
    plan = fa_mixed.plan_mixed

    def recording(*a, **k):
        plans.append(plan(*a, **k))
        return plans[-1]

    monkeypatch.setattr(fa_mixed, "plan_mixed", recording)
    cb = dict(max_batch_tokens=48)  # prompts in chunks beside the decodes of the requests before them
    if padding:
        cb.update(q_padding_interval_size=16, kv_padding_interval_size=256)
    opts = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
    vt.install(**opts)
    with eng.forced_padding() if padding else contextlib.nullcontext():
        monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1)
        split = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=cb, serving=dict(opts))
        assert any(p is not None for p in plans), "no mixed round was split"
        monkeypatch.setattr(fa_mixed, "MIN_DECODE_KEYS", 1 << 40)
        plans.clear()
        whole = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=cb, serving=dict(opts))
        assert plans and all(p is None for p in plans)
        engine = h.run_engine(model, eng.ENGINE_SDPA, prompts, 6, cb_kwargs=cb)
    tokens = [[list(run["results"][rid].generated_tokens) for rid in run["ids"]] for run in (split, whole, engine)]
    assert tokens[0] == tokens[1] == tokens[2]
    cmp = h.compare(split, model, 6)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < 1e-4 and cmp["top1_agree"] == cmp["decisive"] > 0, cmp
