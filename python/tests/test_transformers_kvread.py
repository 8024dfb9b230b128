"""No KV read in a vmem cache's rounds (``vmem/transformers/kvread.py``): the engine neither fills
nor copies its ``read_index`` gather for a vmem cache, padded or not, while its own cache still
reads through it (so each test can fail); and on 5.19+ a one-row ``max_tokens_read`` does not
bind the rounds, which still batch more keys than one row holds.

Needs torch and a transformers vmem serves (as test_transformers_cb.py)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import check as h
from transformers.generation.continuous_batching import input_outputs, model_runner

import vmem.transformers as vt

OPTS = dict(eng.TINY_OPTS, memory="16M")
LENGTHS = [300, 500, 700, 900]  # 2,400 prompt tokens: more than one 1,024-token row
NEW = 24


@pytest.fixture(autouse=True)
def _fake_memory():
    h.fake_cpu_memory()


def _recorded(monkeypatch):
    """Each round's ``(requests, max_kv_read, keys held)``, as the engine prepares it."""
    seen = []
    real = input_outputs.ContinuousBatchingIOs.prepare_batch_tensors

    def prepare(self, requests_in_batch, *args, max_kv_read, **kwargs):
        held = sum(r.state.position_offset for r in requests_in_batch)
        seen.append((len(requests_in_batch), int(max_kv_read), held))
        return real(self, requests_in_batch, *args, max_kv_read=max_kv_read, **kwargs)

    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
    return seen


def _serve(attn, model, prompts):
    with vt.serving(**OPTS):
        return h.run_engine(model, attn, prompts, NEW,
                            cb_kwargs={"max_batch_tokens": 256, "allow_block_sharing": False})


def test_a_vmem_round_reads_no_kv_through_the_engine_and_still_batches_past_one_row(monkeypatch):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    seen = _recorded(monkeypatch)
    ours = _serve(vt.VMEM_ATTENTION, model, prompts)
    vmem_rounds = list(seen)
    seen.clear()
    theirs = _serve(eng.ENGINE_SDPA, model, prompts)
    assert vmem_rounds and all(kv == 0 for _, kv, _ in vmem_rounds), vmem_rounds
    # The engine's own cache reads through its gather (what the check above would catch).
    assert any(kv > 0 for _, kv, _ in seen), seen
    # Rounds of every request, holding more keys than one row: the one-row read budget (5.19+)
    # never bound, and no round was split for it.
    assert max(held for _, _, held in vmem_rounds) > OPTS["max_context"]
    assert max(n for n, _, _ in vmem_rounds) == len(LENGTHS)
    for rid in ours["ids"]:
        assert list(ours["results"][rid].generated_tokens) == list(theirs["results"][rid].generated_tokens)


def test_the_cache_counts_no_read_against_the_round_budget():
    cache = eng.tiny_cache(OPTS, sharing=False)
    if eng.IS_517:  # 5.17 keeps the budget on the scheduler: every row full, which never binds
        assert cache.num_pages == cache.rows * cache.max_context
    else:  # 5.19+: no read counted, and the engine's gather sized to one row
        assert cache.read_cache_limit == 0
        assert cache.max_tokens_read == cache.max_context < cache.rows * cache.max_context


@pytest.mark.parametrize("vmem_cache", [True, False])
def test_a_padded_round_keeps_no_kv_read_for_a_vmem_cache_only(vmem_cache):
    """The engine pads a graphed round's KV read to at least one interval, even a read of 0: for
    a vmem cache the installed ``maybe_pad_inputs`` gives 0; for any other, the engine's."""
    fields = dict(max_batch_tokens=64, max_tokens_read=4096, num_pages=4096, round_buffers=object())
    if vmem_cache:  # a vmem cache: its type is what the hook recognises
        cache = object.__new__(vt.VmemCBCache)
        cache.__dict__.update(fields)
    else:  # another cache, though it has the same fields
        cache = SimpleNamespace(**fields)
    runner = SimpleNamespace(pad_inputs=True, cache=cache,
                             cb_config=SimpleNamespace(q_padding_interval_size=16, kv_padding_interval_size=256))
    with vt.serving(**OPTS):
        pad = model_runner.ModelRunner.maybe_pad_inputs
        q, kv = pad(runner, 5, 0, False)
        q2, kv2 = pad(runner, 5, 300, False)
    assert q == q2 == 16
    assert (kv, kv2) == ((0, 0) if vmem_cache else (256, 512))
