"""``kernel="fa+flashinfer"`` on the CPU (CI): decode rounds of at least ``decode_min`` sequences
through the FlashInfer reader (the stand-in wrappers of test_transformers_figraphs.py, which
follow FlashInfer 0.6's graph-mode rules and compute with the paged reference), every other
round through FlashAttention's reader (its CPU reference); greedy tokens equal kernel="fa"'s, in
the engine with its padding forced and without. FlashInfer's own kernels run on a GPU only
(``benches/serving_suite.py``'s ``vmem-token-major-fafi-graphs-async-compile``)."""

import contextlib
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI's lint stage has none)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from harness import check as h
from test_transformers_figraphs import LENGTHS, NEW, OPTS, PAD, TOL
from test_transformers_figraphs import fake_fi  # noqa: F401  (the stand-in FlashInfer, a fixture)
from tf_engine import forced_padding

import vmem
import vmem.transformers as vt
from vmem.kernels import fa_fi
from vmem.kernels import fi_graphs as vt_fig
from vmem.kernels.fa import FaReader
from vmem.kernels.fi_reader import FlashInferReader, PlannedRound
from vmem.kernels.rounds import Round
from vmem.transformers import graphs as vt_graphs


def _tokens(run):
    return [list(run["results"][rid].generated_tokens) for rid in run["ids"]]


def _run(model, prompts, kernel, monkeypatch, decode_min, *, padded):
    """One engine run of ``kernel`` (``decode_min`` for fa+flashinfer), with the rounds each
    reader got: ``(reader class, round)`` in order."""
    monkeypatch.setattr(fa_fi, "DECODE_MIN", decode_min)
    seen = []
    real = vt_graphs.prepare_round

    def prepare(cache, *a, **k):
        rnd = real(cache, *a, **k)
        seen.append(rnd)
        return rnd

    monkeypatch.setattr(vt_graphs, "prepare_round", prepare)
    # padded: a query padding of 2, so that decode rounds of 1-2 requests hold 2 sequences and
    # those of 3-4 hold 4 (the engine's graph key), and decode_min 4 splits them
    cb = dict(PAD, q_padding_interval_size=2) if padded else {"max_batch_tokens": 256}
    with vt.serving(**OPTS, kernel=kernel):
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=cb, stagger=[0, 0, 0, 2, 3, 5])
    monkeypatch.setattr(vt_graphs, "prepare_round", real)
    return run, seen


@pytest.mark.parametrize("padded", [True, False])
def test_large_decode_rounds_go_to_flashinfer_and_the_rest_to_fa(fake_fi, monkeypatch, padded):  # noqa: F811
    """With ``decode_min`` at the middle of the run's decode rounds' sizes, some decode rounds go
    to FlashInfer (planned before the forward into decode wrappers only: no prefill wrapper, a
    workspace sized for the largest decode round) and every prefill, mixed or small decode round to
    FA; the greedy tokens equal kernel="fa"'s and the logits a plain forward's."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    ctx = forced_padding() if padded else contextlib.nullcontext()
    with ctx:
        fa_run, _ = _run(model, prompts, "fa", monkeypatch, 1, padded=padded)
        decode_min = 4 if padded else 2
        run, rounds = _run(model, prompts, "fa+flashinfer", monkeypatch, decode_min, padded=padded)
    assert _tokens(run) == _tokens(fa_run)
    cmp = h.compare(run, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    cache = run["cache"]
    reader = cache.read
    assert isinstance(reader, fa_fi.FaFlashInferReader) and reader.decode_min == decode_min
    fi_rounds = [r for r in rounds if isinstance(r.index, PlannedRound)]
    fa_rounds = [r for r in rounds if not isinstance(r.index, PlannedRound)]
    assert fi_rounds and fa_rounds, (len(fi_rounds), len(fa_rounds))
    # decode rounds went both ways (a small one to FA: 2 sequences padded, 1 request unpadded)
    assert any(all(q == 1 for _, _, q, _ in r.entries) for r in fa_rounds)
    for r in fi_rounds:
        assert all(q == 1 for _, _, q, _ in r.entries) and r.index.plan.decode
        assert (r.meta.n if padded else len(r.entries)) >= decode_min
    for r in fa_rounds:
        small = (r.meta.n if padded else len(r.entries)) < decode_min
        assert small or any(q > 1 for _, _, q, _ in r.entries) or (padded and not r.meta.decode)
    ws = reader.fi.wrappers
    assert ws is not None and ws.plans == len(fi_rounds)
    assert {decode for _, decode, _, _ in ws.wrappers} == {True}  # FlashInfer never planned a prefill
    assert all(w.graph == padded for w in ws.wrappers.values())
    d = reader.fi.rows_of(0)[0].shape[-1]
    # sized for the largest decode round (the most requests a round holds, rounded up to 64), not
    # for the engine's round of max_batch_tokens as kernel="flashinfer"'s is
    slots = cache.round_buffers.slots
    assert reader.fi.max_tokens == min(cache.max_batch_tokens, -(-slots // 64) * 64)
    assert padded or reader.fi.max_tokens < cache.max_batch_tokens == cache.round_buffers.capacity
    assert ws.workspace.numel() == vt_fig.workspace_bytes(padded, reader.fi.max_tokens, reader.fi.num_heads, d)


def _reader(decode_min=None, max_tokens=64):
    k4, v4 = torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    fi = FlashInferReader(16, lambda layer: (k4, v4), torch.device("cpu"), 4, trash_row=2, trash_tokens=4,
                          max_tokens=max_tokens)
    return fa_fi.FaFlashInferReader(FaReader(16), fi, decode_min), k4, v4


def test_the_choice_depends_on_the_rounds_size_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    reader, _, _ = _reader(2)
    rnd = Round()
    rnd.entries = [(0, 3, 1, None), (1, 5, 1, None)]
    assert reader.reads_with_flashinfer(rnd, padded=False)
    rnd.entries = [(0, 3, 1, None)]
    assert not reader.reads_with_flashinfer(rnd, padded=False)  # too few
    rnd.entries = [(0, 3, 1, None), (1, 5, 2, None)]
    assert not reader.reads_with_flashinfer(rnd, padded=False)  # a prompt chunk
    assert not reader.reads_with_flashinfer(rnd, padded=True)  # padded without metadata
    # padded: the padded sequences (the graph key's), whatever the real requests
    rnd.meta = types.SimpleNamespace(decode=True, n=2, real=1)
    assert reader.reads_with_flashinfer(rnd, padded=True)
    rnd.meta = types.SimpleNamespace(decode=True, n=1, real=1)
    assert not reader.reads_with_flashinfer(rnd, padded=True)
    rnd.meta = types.SimpleNamespace(decode=False, n=64, real=2)  # a padded prefill round
    assert not reader.reads_with_flashinfer(rnd, padded=True)
    rnd.meta = types.SimpleNamespace(decode=True, n=65, real=60)  # past what the workspace holds: FA's
    assert not reader.reads_with_flashinfer(rnd, padded=True)
    rnd.meta = types.SimpleNamespace(decode=True, n=64, real=60)
    assert reader.reads_with_flashinfer(rnd, padded=True)
    assert _reader()[0].decode_min == fa_fi.DECODE_MIN


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_a_bad_decode_min_is_refused(monkeypatch, bad):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with pytest.raises(vmem.VmemError, match="decode_min"):
        _reader(bad)


def test_a_round_outside_the_engine_hook_is_fas(monkeypatch):
    """A round no ``before_forward`` planned (a caller outside the engine) is FA's, and reads
    what the FA reader reads."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    reader, k4, v4 = _reader(1)
    rnd, alone = Round(), Round()
    rnd.entries = alone.entries = [(0, 3, 1, None), (1, 7, 1, None)]
    q = torch.randn(1, 4, 2, 8)
    flat_k, flat_v = k4.reshape(-1, 2, 8), v4.reshape(-1, 2, 8)
    out = reader(0, rnd, q, flat_k, flat_v, 0.25, True)
    assert not isinstance(rnd.index, PlannedRound)
    torch.testing.assert_close(out, FaReader(16)(0, alone, q, flat_k, flat_v, 0.25, True))


def test_the_kernel_is_an_option_that_needs_flashinfer(monkeypatch):
    opts = vt.Options(**OPTS, kernel="fa+flashinfer", split_decode=True)
    assert opts.kernel == "fa+flashinfer" and opts.split_decode
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    vt.install(**OPTS)
    with pytest.raises(vmem.InvalidArgument, match=r"'fa\+flashinfer' and prompt_reader='flashinfer' need FlashInfer"):
        vt.install(kernel="fa+flashinfer")
    assert vt.options().kernel == "fa"
    with pytest.raises(vmem.InvalidArgument, match="kernel"):
        vt.Options(**OPTS, kernel="fa+fi")


def test_flashinfer_refuses_a_padded_round_past_its_workspace(monkeypatch):
    """The FlashInfer reader's graph-mode workspace holds ``max_tokens`` tokens' split partials: a
    padded round of more is refused before FlashInfer could write past it."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    reader, _, _ = _reader(1, max_tokens=2)
    rnd = Round()
    rnd.entries = [(0, 3, 1, None), (1, 5, 1, None)]
    for n, ok in ((2, True), (4, False)):
        rnd.meta = types.SimpleNamespace(decode=True, n=n, real=2, total_q=n)
        state = PlannedRound(True, 0, None)
        if ok:
            reader.fi._plan(rnd, state, 0.25)
            assert state.plan.total_q == 2
        else:
            with pytest.raises(vmem.VmemError, match="past the 2"):
                reader.fi._plan(rnd, state, 0.25)
