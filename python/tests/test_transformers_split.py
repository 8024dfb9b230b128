"""``kernel="fa"``'s padded decode rounds split along the keys (:mod:`vmem.kernels.fa_split`):
the slot plan covers every request's keys exactly once, the split attention equals the unsplit
one, the Triton merge equals the reference (run by Triton's interpreter on the CPU), greedy
tokens under the engine's padding path equal those with the option off and the engine's own,
and the option is validated.

CPU, fp32, tiny models; needs torch and a transformers vmem serves (skipped otherwise, saying why).
The kernels on a GPU: ``test_gpu.py::test_split_decode_matches_fa``."""

import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng  # noqa: E402
from tf_engine import fake_memory_and_uninstall, forced_padding  # noqa: E402,F401

eng.skip_unless_served()

from harness import check as h  # noqa: E402

import vmem  # noqa: E402
import vmem.transformers as vt  # noqa: E402
from vmem.kernels import fa_split  # noqa: E402
from vmem.kernels.buffers import RoundBuffers  # noqa: E402
from vmem.kernels.fa import fa_varlen_reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("seed", range(60))
def test_the_plan_covers_every_key_once_in_whole_runs(seed):
    rng = random.Random(seed)
    slots = rng.choice([1, 4, 16, 64, 256])
    n = rng.randint(1, slots)
    lengths = [rng.choice([1, 2, 127, 128, 129, rng.randint(1, 9000)]) for _ in range(n)]
    owner, start, first, counts = fa_split.plan_slots(lengths, slots)
    assert len(owner) == len(start) == slots and len(first) == len(counts) == n
    assert sum(counts) <= slots and min(counts) >= 1
    for b, u in enumerate(lengths):
        assert counts[b] <= max(1, -(-u // fa_split.MIN_KEYS))  # no run below MIN_KEYS keys but one
        mine = list(range(first[b], first[b] + counts[b]))
        assert [owner[j] for j in mine] == [b] * counts[b]
        run = -(-u // counts[b])
        assert [start[j] for j in mine] == [i * run for i in range(counts[b])]
        assert start[mine[-1]] < u <= start[mine[-1]] + run  # the last run is not empty
    assert owner.count(-1) == slots - sum(counts)
    most = [-(-u // fa_split.MIN_KEYS) for u in lengths]
    assert sum(counts) == min(slots, sum(most))  # every slot dealt while some request can take one


@pytest.mark.parametrize("seed", range(40))
def test_the_written_plan_is_plan_slots_laid_out(seed):
    """:class:`SplitBuffers` writes, per request rather than per slot, what :func:`plan_slots`
    deals, at :func:`plan_layout`'s offsets: each slot's first key (its row's start plus its
    run's), its keys (a run, the last what is left), its request; each row's first slot and
    count; zeros for padded slots and rows."""
    rng = random.Random(seed)
    rows = rng.choice([1, 3, 8, 64])
    per_row = rng.choice([1, 2])
    mc = 4096
    n = rng.randint(1, rows)
    entries = [(rng.randrange(50), rng.randint(0, mc - 1), 1) for _ in range(n)]
    split = fa_split.SplitBuffers(rows, torch.device("cpu"), slot_kernel=per_row == 2).fill(entries, rows, mc, None)
    slots = rows * per_row
    lengths = [past + q for _, past, q in entries]
    owner, start, first, counts = fa_split.plan_slots(lengths, slots)
    k = sum(counts)
    runs = [-(-u // c) for u, c in zip(lengths, counts)]
    want = [[entries[b][0] * mc + st for b, st in zip(owner[:k], start[:k])] + [0] * (slots - k + 1),
            [min(lengths[b] - st, runs[b]) for b, st in zip(owner[:k], start[:k])] + [0] * (slots - k),
            owner[:k] + [0] * (slots - k), first + [0] * (rows - n), counts + [0] * (rows - n)]
    assert [split.host_part(i) for i in range(5)] == want
    layout = fa_split.plan_layout(slots, rows)
    assert split.host.numel() == layout[-1][0] + rows
    ends = [at + length for at, length in layout]
    starts = [at for at, _ in layout[1:]] + [split.host.numel()]
    gaps = [j for end, nxt in zip(ends, starts) for j in range(end, nxt)]
    assert all(split.host[j] == 0 for j in gaps)  # the alignment padding between parts


def test_a_plan_that_cannot_be_made_is_refused():
    for lengths, slots in (([], 4), ([5, 5], 1), ([0], 4)):
        with pytest.raises(vmem.VmemError, match="cannot split"):
            fa_split.plan_slots(lengths, slots)


def _round(lengths, slots, hkv=2, hq=8, d=16, mc=512, seed=0):
    """A padded decode round over random K/V rows: (q [slots, Hq, D], k, v, entries, meta)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths) + 1
    k = torch.randn(rows * mc, hkv, d, generator=g)
    v = torch.randn(rows * mc, hkv, d, generator=g)
    entries = [(i, u - 1, 1) for i, u in enumerate(lengths)]  # (row, past, q): one query token each
    buffers = RoundBuffers(slots, mc, rows - 1, torch.device("cpu"), max_tokens=slots)
    meta = buffers.fill(entries, sequences=len(lengths), tokens=slots, padded=True, bucket_k=mc, decode=True)
    q = torch.randn(slots, hq, d, generator=g)
    return q, k, v, entries, meta


@pytest.mark.parametrize("lengths,slots", [([300, 7, 1, 512], 16), ([512] * 4, 4), ([1], 8), ([40, 200], 64)])
def test_split_attention_equals_the_unsplit_one(lengths, slots, monkeypatch):
    monkeypatch.setattr(fa_split, "MIN_KEYS", 16)  # many runs a request at these lengths
    q, k, v, entries, meta = _round(lengths, slots)
    want = fa_varlen_reference(q, k, v, meta, scale=0.25)
    split = fa_split.SplitBuffers(slots, q.device).fill(entries, slots, 512, None)
    assert max(split.host_part(4)) > 1 or max(lengths) <= 16 or slots == len(lengths)
    got = fa_split.attend(q, k, v, split, meta.max_k, 0.25)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.equal(got[len(lengths):], torch.zeros_like(got[len(lengths):]))  # padded rows read nothing


def test_the_triton_merge_equals_the_reference():
    """Run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before Triton is imported:
    a child process)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    code = """
import torch
from vmem.kernels import fa_split
from vmem.kernels._triton_combine import combine_slots
torch.manual_seed(0)
fa_split.MIN_KEYS = 4
lengths, slots = [50, 3, 17, 1], 12
split = fa_split.SplitBuffers(slots, torch.device("cpu")).fill([(i, u - 1, 1) for i, u in enumerate(lengths)],
                                                              slots, 64, None)
out = torch.randn(slots, 4, 32)
lse = torch.randn(4, slots) * 3
want = fa_split.combine_reference(out, lse, split)
got = combine_slots(out, lse, split.first, split.count)
assert max(split.host_part(4)) > 1
assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
assert torch.equal(got[4:], torch.zeros_like(got[4:]))
print("MERGED")
"""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "MERGED" in r.stdout, r.stderr[-3000:]


def test_the_triton_slot_kernel_equals_the_reference():
    """vmem's slot kernel (:mod:`vmem.kernels._triton_decode`) against the slots' reference, on
    grouped and ungrouped heads, run by Triton's interpreter on the CPU in float16 (the
    interpreter has no bfloat16). Triton 3.6's interpreter reads a loaded scalar as a
    one-element array, which NumPy 2 refuses as a loop bound; the child patches that one
    conversion."""
    pytest.importorskip("triton", reason="Triton is not installed")
    code = """
import random
import torch
import triton.runtime.interpreter as interp
_patch = interp._patch_lang_tensor
def _scalars(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interp._patch_lang_tensor = _scalars
from vmem.kernels import fa_split
from vmem.kernels._triton_decode import attend_slots
torch.manual_seed(0)
rng = random.Random(0)
fa_split.SLOTS_PER_ROW = 3
for hq, hkv, d, block in [(32, 8, 64, 0), (4, 4, 32, 16), (12, 2, 16, 16)]:
    mc = 512
    k = torch.randn(7 * mc, hkv, d).half()
    v = torch.randn_like(k)
    entries = [(r, rng.randint(0, 450), 1) for r in rng.sample(range(7), 4)] + [(5, 0, 1)]
    split = fa_split.SplitBuffers(8, torch.device("cpu"), slot_kernel=True).fill(entries, 6, mc, None)
    assert split.slots == 18 and split.rows == 6 and max(split.host_part(4)) > 1
    q = torch.randn(6, hq, d).half()
    want_out, want_lse = fa_split.attend_reference(q.index_select(0, split.owner), k, v, split, 0.3)
    out, lse = attend_slots(q, k, v, split.cu_k, split.used, split.owner, 0.3, block_n=block)  # 16: many blocks a slot
    for j, used in enumerate(split.host_part(1)):
        if used:
            assert torch.allclose(out[j], want_out[j].float(), atol=2e-3), (hq, j, (out[j] - want_out[j]).abs().max())
            assert torch.allclose(lse[:, j], want_lse[:, j], atol=1e-3), (hq, j)
    merged = fa_split.combine_reference(out, lse, split, torch.float16)
    whole = fa_split.combine_reference(want_out.float(), want_lse, split, torch.float16)
    assert merged.shape == (6, hq, d) and torch.allclose(merged.float(), whole.float(), atol=2e-3)
print("SLOTS")
"""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SLOTS" in r.stdout, r.stderr[-3000:]


def test_greedy_tokens_under_padding_equal_the_option_off_and_the_engines(monkeypatch):
    monkeypatch.setattr(fa_split, "MIN_KEYS", 8)  # the tiny prompts split into several runs
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    lengths = [5, 140, 70, 17, 33, 3]
    prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
    pad = dict(max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=256)
    plans = []
    fill = fa_split.SplitBuffers.fill

    def recording_fill(self, *a, **k):
        plans.append(fill(self, *a, **k))
        return plans[-1]

    monkeypatch.setattr(fa_split.SplitBuffers, "fill", recording_fill)
    opts = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
    vt.install(**opts)
    with forced_padding():
        split = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=pad, serving=dict(opts))
        whole = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=pad,
                             serving=dict(opts, split_decode=False))
        engine = h.run_engine(model, eng.ENGINE_SDPA, prompts, 6, cb_kwargs=pad)
        n_fa = len(plans)
        slots = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 6, cb_kwargs=pad,
                             serving=dict(opts, split_reader="triton"))
    assert plans[:n_fa] and any(max(p.host_part(4)) > 1 for p in plans[:n_fa]), "no decode round was split"
    # split_reader="triton": twice the sequences as slots (the CPU reads them with the reference)
    assert plans[n_fa:] and all(p.slots == 2 * p.rows and p.slot_kernel for p in plans[n_fa:])
    assert not any(p.slot_kernel for p in plans[:n_fa])
    runs = (split, whole, engine, slots)
    tokens = [[list(run["results"][rid].generated_tokens) for rid in run["ids"]] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
    for run in (split, slots):
        cmp = h.compare(run, model, 6)
        assert cmp["counts_ok"] and cmp["max_rel_err"] < 1e-4 and cmp["top1_agree"] == cmp["decisive"] > 0, cmp


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_a_bad_split_decode_is_refused(bad):
    with pytest.raises(vmem.InvalidArgument, match="split_decode"):
        vt.install(split_decode=bad)


def test_split_decode_with_another_kernel_is_refused():
    with pytest.raises(vmem.InvalidArgument, match="split_decode splits kernel='fa'"):
        vt.Options(kernel="flex", split_decode=True)
    vt.Options(kernel="flex", split_decode=False)  # off: nothing to refuse


@pytest.mark.parametrize("bad", ["flash", "", True, 1])
def test_a_bad_split_reader_is_refused(bad):
    with pytest.raises(vmem.InvalidArgument, match="split_reader"):
        vt.Options(split_reader=bad)


@pytest.mark.parametrize("kw,why", [(dict(split_decode=False), "split_decode=False splits none"),
                                    (dict(kernel="flex"), "kernel='flex' has none"),
                                    (dict(kernel="flashinfer"), "kernel='flashinfer' has none")])
def test_split_reader_triton_without_a_split_fa_round_is_refused(kw, why):
    with pytest.raises(vmem.InvalidArgument, match=f"split_reader='triton' reads .*; {why}"):
        vt.Options(split_reader="triton", **kw)
    assert vt.Options(split_reader="fa", **kw).split_reader == "fa"


def test_split_reader_unset_reads_with_the_slot_kernel_only_where_it_runs(monkeypatch):
    """The default (``None``): vmem's slot kernel on CUDA where it builds; on the CPU, or where it
    does not build, FA's slots with no error."""
    assert vt.Options().split_reader is None
    cfg = h.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    opts = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
    cpu = vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**opts))
    assert cpu.read.splits is not None and not cpu.read.splits.slot_kernel
    asked = []
    monkeypatch.setattr(fa_split, "slot_kernel_fails", lambda *a, **k: asked.append(a) or "no GPU here (x)")
    vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**opts))
    assert not asked  # the CPU never builds it
    given = vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**opts, split_reader="triton"))
    assert given.read.splits.slot_kernel and given.read.splits.per_row == fa_split.SLOTS_PER_ROW


def test_the_slot_kernel_where_it_cannot_run_says_why():
    cuda = torch.device("cuda", 0)
    for d in (96, 8, 512):
        with pytest.raises(vmem.InvalidArgument, match=f"power of two from 16 to 256, not {d}; use split_reader='fa'"):
            fa_split.check_slot_kernel(cuda, d)
    if not torch.cuda.is_available():  # a real failure: Triton missing, or no device to launch on
        with pytest.raises(vmem.InvalidArgument, match="split_reader='triton': it does not run here"):
            fa_split.check_slot_kernel(cuda, 128)


def test_where_it_cannot_run_true_says_why_and_none_stays_off():
    cuda = torch.device("cuda", 0)
    assert fa_split.splits_for(None, torch.device("cpu"), 96)  # the CPU merges on the host
    assert not fa_split.splits_for(None, cuda, 96)
    with pytest.raises(vmem.InvalidArgument, match="^split_decode=True: .*power of two, not 96; leave split_decode"):
        fa_split.splits_for(True, cuda, 96)
    with pytest.raises(vmem.InvalidArgument, match="^split_reader='triton': .*not 96; use split_reader='fa'$"):
        fa_split.splits_for(True, cuda, 96, asked_by="split_reader='triton'", instead="use split_reader='fa'")
    assert not fa_split.splits_for(False, torch.device("cpu"), 128)


def test_a_merge_kernel_that_does_not_run_turns_splitting_off_or_says_why(monkeypatch):
    """Triton present but unable to build or launch its kernel (no C compiler; here: no GPU) must
    not stop the engine's loop at the first decode round: the cache checks it once, when built."""
    cuda = torch.device("cuda", 0)
    if not torch.cuda.is_available():  # a real failure: the kernel's first launch has no device
        assert fa_split._merge_kernel_fails(cuda, 128) is not None
    monkeypatch.setattr(fa_split, "_merge_kernel_fails", lambda device, d, dtype: "the merge kernel does not run here (x)")
    assert not fa_split.splits_for(None, cuda, 128)
    with pytest.raises(vmem.InvalidArgument, match="does not run here"):
        fa_split.splits_for(True, cuda, 128)

