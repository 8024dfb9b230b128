"""``kernel="flashinfer"`` under the engine's CUDA graphs, on the CPU (CI): the padded plan
(real entries unchanged, padded requests on the trash row, batch fixed per padded size), checked
with the pure-torch paged reference against FA's; the graph-mode wrappers (one per IO pair, kind
and batch; buffer addresses stable; a run reads only what the last plan wrote). FlashInfer does
not run on the CPU: stand-in wrapper classes follow its graph-mode rules (fixed batch, the first
plan fixes the rows, plan() copies into the fixed buffers) and compute with the reference from
those buffers. In the engine, the padding path is forced (graphs cannot be captured here).
``benches/graphs_check.py --kernels fa,flashinfer`` runs the real kernels under graphs on a GPU
(not yet run)."""

import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI's lint stage has none)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from fake_flashinfer import FakeFlashInfer
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from harness import check as h
from tf_engine import forced_padding

import vmem
import vmem.transformers as vt
from vmem.kernels import fa as vk_fa
from vmem.kernels import fi_graphs as vt_fig
from vmem.kernels import flashinfer as vt_fi
from vmem.transformers import graphs as vt_graphs

OPTS = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
PAD = dict(max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=256)
LENGTHS = [5, 140, 70, 17, 33, 3]
NEW = 5
TOL = 1e-4


@pytest.fixture
def fake_fi(monkeypatch):
    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    monkeypatch.setattr(vt_fi, "kernels_on", lambda device: True)
    monkeypatch.setattr(vt_fig, "WORKSPACE_BYTES", 1 << 10)  # no 128 MiB of CPU memory for a stand-in
    return fake


# -- the padded plan --------------------------------------------------------------------------------
TRASH = 6


def _padded(entries, tokens, sequences, trash_tokens=4, ctx=48, page=None):
    return vt_fig.padded_paged_plan(entries, ctx, trash_row=TRASH, trash_tokens=trash_tokens, tokens=tokens,
                                    sequences=sequences, page=page)


def test_a_padded_decode_round_is_one_request_per_token():
    entries = [(3, 10, 1), (0, 0, 1), (5, 47, 1)]
    plain, plan = vt_fi.paged_plan(entries, 48), _padded(entries, tokens=16, sequences=4)
    assert plan.decode and plan.total_q == 16 and plan.kv_last_page_len.numel() == 16
    for name in ("kv_indices", "kv_last_page_len"):  # the real entries as unpadded
        assert getattr(plan, name)[:3].tolist() == getattr(plain, name).tolist()
    assert plan.kv_indices[3:].tolist() == [TRASH] * 13 and plan.kv_last_page_len[3:].tolist() == [1] * 13
    assert plan.qo_indptr.tolist() == list(range(17)) and plan.kv_indptr.tolist() == list(range(17))
    assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                                 plan.kv_last_page_len))


@pytest.mark.parametrize("trash_tokens", [1, 4, 64])
def test_a_padded_prefill_round_has_a_fixed_batch_and_reads_only_the_trash_rows_mapped_block(trash_tokens):
    tokens, sequences = 32, 8
    holders = max(1, -(-(tokens - 1) // trash_tokens))
    rounds = [[(3, 10, 5), (0, 0, 1)], [(1, 2, 20), (2, 0, 3), (4, 7, 1), (5, 30, 2)], [(0, 0, 31)]]
    for entries in rounds:
        plain, plan = vt_fi.paged_plan(entries, 48), _padded(entries, tokens, sequences, trash_tokens)
        n, pad = len(entries), tokens - plain.total_q
        assert not plan.decode and plan.kv_last_page_len.numel() == sequences + holders  # fixed per (T, S)
        assert plan.qo_indptr[: n + 1].tolist() == plain.qo_indptr.tolist() and int(plan.qo_indptr[-1]) == tokens
        assert plan.kv_indices[:n].tolist() == plain.kv_indices.tolist()
        assert plan.kv_last_page_len[:n].tolist() == plain.kv_last_page_len.tolist()
        assert plan.kv_indices[n:].tolist() == [TRASH] * (sequences - n + holders)
        qs = (plan.qo_indptr[1:] - plan.qo_indptr[:-1]).tolist()
        lens = plan.kv_last_page_len.tolist()
        assert qs[n:sequences] == [0] * (sequences - n) and lens[n:sequences] == [1] * (sequences - n)
        assert sum(qs[sequences:]) == pad
        assert all(1 <= kv <= trash_tokens and kv >= q for q, kv in zip(qs[sequences:], lens[sequences:]))


@pytest.mark.parametrize("page, trash_tokens", [(48, 4), (16, 4), (8, 24), (1, 4)])
@pytest.mark.parametrize("decode", [False, True])
def test_the_padded_plan_reads_what_the_unpadded_one_reads(decode, page, trash_tokens):
    """Over rows with NaN past every length (the trash row's too, past its mapped block), read as
    pages of ``page`` tokens: the paged reference over the padded plan equals FA's reference for
    the real tokens, and every padded token's output is finite (nothing past a mapped token is
    read)."""
    g = torch.Generator().manual_seed(3)
    rows, ctx, hkv, hq, d = 7, 48, 2, 6, 8
    k4, v4 = (torch.full((rows, ctx, hkv, d), float("nan")) for _ in range(2))
    entries = [(r, p, 1) for r, p, _ in eng.random_mixed_round(g, k4, v4)] if decode else \
        eng.random_mixed_round(g, k4, v4)
    entries = [e for e in entries if e[0] != TRASH]
    for r, p, q in entries:  # the entries' own lengths (decode may have shortened them)
        k4[r, p + q:] = float("nan")
        v4[r, p + q:] = float("nan")
    k4[TRASH, :trash_tokens] = torch.randn(trash_tokens, hkv, d, generator=g)
    v4[TRASH, :trash_tokens] = torch.randn(trash_tokens, hkv, d, generator=g)
    real = sum(e[2] for e in entries)
    plan = _padded(entries, tokens=real + 11, sequences=len(entries) + 2, trash_tokens=trash_tokens, page=page)
    assert int(plan.qo_indptr[-1]) == plan.total_q == real + 11
    q = torch.randn(real + 11, hq, d, generator=g)
    got = vt_fi.paged_reference(q, vt_fi.page_view(k4, page), vt_fi.page_view(v4, page), plan, 0.3)
    flat = [t.as_strided((rows * ctx, hkv, d), t.stride()[1:]) for t in (k4, v4)]
    want = vk_fa.fa_varlen_reference(q[:real], *flat, vk_fa.fa_varlen_indices(entries, ctx).to("cpu"), 0.3)
    torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("bad", [
    dict(entries=[(TRASH, 0, 1)], tokens=4, sequences=1),  # a request on the trash row
    dict(entries=[(0, 0, 5)], tokens=4, sequences=1),  # fewer tokens than the round's
    dict(entries=[(0, 0, 1), (1, 0, 1)], tokens=4, sequences=1),  # fewer sequences than requests
    dict(entries=[(0, 0, 1)], tokens=4, sequences=1, trash_tokens=0),
    dict(entries=[], tokens=4, sequences=1),
])
def test_the_padded_plan_refuses_what_it_cannot_pad(bad):
    with pytest.raises(vmem.VmemError):
        _padded(**bad)


# -- the graph-mode wrappers ------------------------------------------------------------------------
def test_one_wrapper_per_pair_kind_batch_and_tokens_with_stable_buffers(fake_fi):
    ws = vt_fig.WrapperSet(fake_fi.module, torch.device("cpu"), 1024, 6, 2, 8, torch.float32)
    g = torch.Generator().manual_seed(1)
    k4, v4 = torch.randn(7, 48, 2, 8, generator=g), torch.randn(7, 48, 2, 8, generator=g)
    # Padded to 14 and to 16 tokens, a prefill round is 8 sequences and 4 trash holders: one batch
    # of 12, two row counts (FlashInfer's graph mode fixes the rows at the first plan: H200 run of
    # 2026-11-27, "qo_indptr 2688 ... cannot exceed ... 2112" when both shared a wrapper).
    rounds = [([(3, 10, 5), (0, 0, 1)], 14), ([(3, 10, 5), (0, 0, 1)], 16), ([(1, 2, 9), (2, 0, 3), (4, 7, 1)], 16),
              ([(3, 11, 1)], 16), ([(3, 12, 1), (0, 1, 1)], 16), ([(1, 11, 2)], 32)]
    seen = {}
    for pair in (0, 1):
        for entries, tokens in rounds:
            plan = _padded(entries, tokens, min(tokens, 8))
            w = ws.plan(plan, pair=pair, graph=True, scale=0.3)
            key = (pair, plan.decode, int(plan.kv_last_page_len.numel()), tokens)
            assert seen.setdefault(key, w) is w and w.graph
            ptrs = tuple(b.data_ptr() for b in ws.buffers[key])
            assert seen.setdefault(("ptrs", key), ptrs) == ptrs  # the addresses a graph captured
            q = torch.randn(tokens, 6, 8, generator=g)
            # A replay reads what the last plan wrote into the fixed buffers: this round, not the last.
            torch.testing.assert_close(w.run(q, (k4, v4)), vt_fi.paged_reference(q, k4, v4, plan, 0.3))
    # 4 shapes (prefill 12 x 14, prefill 12 x 16, decode 16, prefill 32) x 2 pairs
    assert len(fake_fi.made) == len(ws.wrappers) == 8
    assert ws.plans == 2 * len(rounds)
    # One int workspace and one pinned staging buffer per pair, whatever the number of shapes.
    for pair in (0, 1):
        mine = [w for (p, *_), w in ws.wrappers.items() if p == pair]
        assert len({id(w._int_workspace_buffer) for w in mine}) == 1
        assert len({id(w._pin_memory_int_workspace_buffer) for w in mine}) == 1
    assert ws.wrappers[(0, False, 12, 16)]._int_workspace_buffer is not ws.wrappers[(1, False, 12, 16)]._int_workspace_buffer
    eager = ws.plan(vt_fi.paged_plan([(3, 10, 5)], 48), pair=0, graph=False, scale=0.3)
    assert not eager.graph and ws.plan(vt_fi.paged_plan([(1, 0, 2)], 48), pair=0, graph=False, scale=0.3) is eager


def test_the_eager_workspace_holds_the_split_partials_of_the_gpu():
    """Outside graphs: room for the split partials of twice the planner's units on an H100 (132
    SMs): a 33-unit split of a 64-head model needs 138 MB, past FlashInfer's 128 MiB."""
    assert vt_fig.workspace_bytes(False, 8192, 32, 128) == vt_fig.WORKSPACE_BYTES  # the GPU unknown
    llama = vt_fig.workspace_bytes(False, 8192, 32, 128, kv_heads=8, sms=132)
    big = vt_fig.workspace_bytes(False, 8192, 64, 128, kv_heads=8, sms=132)
    assert llama >= 32 * 33 * 128 * 129 * 4 and big >= 64 * 33 * 128 * 129 * 4 > vt_fig.WORKSPACE_BYTES
    assert vt_fig.workspace_bytes(True, 8192, 64, 128, kv_heads=8, sms=132) >= big


def test_the_graph_workspace_is_sized_for_the_padded_round():
    assert vt_fig.workspace_bytes(False, 8192, 32, 128) == vt_fig.WORKSPACE_BYTES
    assert vt_fig.workspace_bytes(True, 8192, 32, 128) > 2_684_354_560  # what fi-paged's graphs needed
    small, big = vt_fig.workspace_bytes(True, 16, 4, 64), vt_fig.workspace_bytes(True, 8192, 32, 128)
    assert vt_fig.WORKSPACE_BYTES <= small < big


# -- in the engine (forced padding, the stand-in wrappers) ------------------------------------------
def _tokens(run):
    return [list(run["results"][rid].generated_tokens) for rid in run["ids"]]


@pytest.mark.parametrize("split", [256, 16])
def test_flashinfer_with_the_engines_padding_matches_fa(fake_fi, split, monkeypatch):
    """Padded rounds through the graph-mode wrappers: greedy tokens equal kernel="fa"'s (padded
    too), logits match a plain forward, every round is planned once, before its forward, into
    the wrapper of its padded size and kind, whose buffers never move. Rows are read as pages of
    up to ``split`` tokens (16: requests span several; the fixed index buffers hold a row's
    pages a request)."""
    monkeypatch.setattr(vt_fi, "SPLIT_TOKENS", split)
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    hooks = [model.register_forward_pre_hook(lambda *_: fake_fi.inside.append(1)),
             model.register_forward_hook(lambda *_: fake_fi.inside.pop() and None)]
    rounds = []
    real = vt_graphs.prepare_round

    def prepare(cache, *a, **k):
        rnd = real(cache, *a, **k)
        rounds.append((cache, rnd))
        return rnd

    vt_graphs.prepare_round = prepare
    runs = {}
    try:
        with forced_padding():
            for kernel in ("flashinfer", "fa"):
                with vt.serving(**OPTS, kernel=kernel):
                    runs[kernel] = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(PAD),
                                                stagger=[0, 0, 0, 2, 3, 5])
    finally:
        vt_graphs.prepare_round = real
        for hk in hooks:
            hk.remove()
    ours = runs["flashinfer"]
    assert _tokens(ours) == _tokens(runs["fa"])
    cmp = h.compare(ours, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp
    fi_rounds = [rnd for cache, rnd in rounds if cache.kernel == "flashinfer"]
    cache = ours["cache"]
    ws = cache.read.wrappers
    assert ws is not None and ws.plans == len(fi_rounds) == ours["rounds"]
    # sized for padded rounds (graph-mode split partials) though no graph was captured: the
    # engine pads every round under a compiled forward too (an 8B-x8 prefill overflowed the eager
    # size on the H200, docs/serving.md)
    d = cache.read.rows_of(0)[0].shape[-1]
    assert ws.workspace.numel() == vt_fig.workspace_bytes(True, cache.max_batch_tokens, cache.read.num_heads, d)
    assert all(w.graph for w in ws.wrappers.values()) and all(w.plans for w in fake_fi.made)
    assert {d for _, d, _, _ in ws.wrappers} == {True, False}  # decode and prefill rounds both ran padded
    assert cache.read.page == split and ws.max_pages == OPTS["max_context"] // split
    if split == 16:  # some request read several pages
        assert any(plan.kv_indptr[-1] > plan.kv_indptr.numel() - 1 for plan in (r.index.plan for r in fi_rounds))
    for rnd in fi_rounds:
        plan = rnd.index.plan
        assert rnd.index.padded and plan.total_q == rnd.meta.total_q and plan.decode == rnd.meta.decode
        assert rnd.index.wrapper is ws.wrappers[(0, plan.decode, int(plan.kv_last_page_len.numel()), plan.total_q)]
    assert sum(w.plans for w in fake_fi.made) == len(fi_rounds)
    # Only the reader's first round plans inside its forward (the scale comes with the first layer;
    # the engine runs a round eagerly before capturing it); every later one before its forward.
    assert fake_fi.planned_inside[0] and not any(fake_fi.planned_inside[1:])


def test_flashinfer_padded_on_the_cpu_runs_the_reference_over_the_padded_plan(monkeypatch):
    """Without kernels (the CPU), a padded round runs the paged reference over the padded plan:
    the same greedy tokens as kernel="fa"."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    runs = {}
    with forced_padding():
        for kernel in ("flashinfer", "fa"):
            with vt.serving(**OPTS, kernel=kernel):
                runs[kernel] = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(PAD))
    assert runs["flashinfer"]["cache"].read.wrappers is None
    assert _tokens(runs["flashinfer"]) == _tokens(runs["fa"])
    cmp = h.compare(runs["flashinfer"], model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp


def test_a_layer_with_another_scale_is_refused(fake_fi):
    from vmem.kernels.fi_reader import FlashInferReader
    from vmem.kernels.rounds import Round

    k4, v4 = torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    reader = FlashInferReader(16, lambda layer: (k4, v4), torch.device("cpu"), 4, trash_row=2, trash_tokens=4)
    rnd = Round()
    rnd.entries = [(0, 3, 2, None)]
    q = torch.randn(1, 4, 2, 8)
    assert reader(0, rnd, q, None, None, 0.25, True).shape == (1, 2, 4, 8)  # plans at the first layer
    with pytest.raises(vmem.VmemError, match="softmax scale"):
        reader(1, rnd, q, None, None, 0.5, True)


def test_the_gpu_checks_flashinfer_runs_work_on_the_cpu(monkeypatch):
    """graphs_check.py's check() with FlashInfer's runs (the CPU: the reference, no graphs): each
    fi-* run is teacher-forced and compared with FA's run of the same switches (the plumbing the
    GPU call relies on; the kernels and replays are the GPU's to show)."""
    import graphs_check as gc

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(gc, "NEW", 3)
    vt.install(**OPTS)
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(4, [5, 40, 17, 30], model.config.vocab_size)
    out = gc.check("tiny", model, prompts, ["off", "graphs", "fi-off", "fi-graphs"])
    for name in ("fi-off", "fi-graphs"):
        r = out[name]
        assert "error" not in r and r["top1"][0] == r["top1"][1] > 0 and r["rows_left"] == 0, r
        assert r["same_tokens_as_fa"] == [4, 4], r
    assert "same_tokens_as_fa" not in out["graphs"]
    assert gc.RUNS["fi-graphs-async"] == ({"use_cuda_graph": True, "use_async_batching": True},
                                          {"kernel": "flashinfer"})



def test_a_padded_round_after_unpadded_ones_is_refused(fake_fi):
    """The workspace is sized at the first round planned; the engine pads every round or none,
    so a padded round after unpadded ones is a misuse, refused before FlashInfer could overflow."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(2, [9, 20], model.config.vocab_size)
    with vt.serving(**OPTS, kernel="flashinfer"):
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 3, cb_kwargs={"max_batch_tokens": 64})
    reader = run["cache"].read
    d = reader.rows_of(0)[0].shape[-1]
    assert reader.wrappers.workspace.numel() == vt_fig.workspace_bytes(False, 64, reader.num_heads, d)
    assert reader._wrappers(False) is reader.wrappers
    with pytest.raises(vmem.VmemError, match="a padded round after unpadded ones"):
        reader._wrappers(True)


def test_the_eager_prefill_wrappers_take_the_backend_asked_for(fake_fi):
    """``eager_prefill="fa3"`` (FlashInfer's Hopper kernel, the fi-paged peer's
    ``prompt_reader="flashinfer"``): the eager prefill wrappers use it; the graph-mode ones and the
    decode wrappers keep theirs; another backend name is refused."""
    ws = vt_fig.WrapperSet(fake_fi.module, torch.device("cpu"), 1024, 6, 2, 8, torch.float32, eager_prefill="fa3")
    eager = ws.plan(vt_fi.paged_plan([(3, 10, 5)], 48), pair=0, graph=False, scale=0.3)
    graph = ws.plan(_padded([(3, 10, 5), (0, 0, 1)], 16, 8), pair=0, graph=True, scale=0.3)
    decode = ws.plan(vt_fi.paged_plan([(3, 10, 1)], 48), pair=0, graph=False, scale=0.3)
    assert (eager.backend, graph.backend) == ("fa3", "fa2") and decode.decode
    assert vt_fig.WrapperSet(fake_fi.module, torch.device("cpu"), 1024, 6, 2, 8, torch.float32).eager_prefill == "fa2"
    with pytest.raises(vmem.VmemError, match="backend"):
        vt_fig.WrapperSet(fake_fi.module, torch.device("cpu"), 1024, 6, 2, 8, torch.float32, eager_prefill="auto")
    assert vt_fi.prefill_backend(torch.device("cpu")) == "fa2"
