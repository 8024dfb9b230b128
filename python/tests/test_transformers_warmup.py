"""vmem's part of the engine's warmup (python/vmem/transformers/warmup.py), on the CPU with the
engine's padding path forced (graphs cannot be captured here): a fake decode round runs for
every padded size and ``max_seqlen_k`` bucket a vmem graph key carries, its requests are freed,
a round that fails leaves nothing in the next, and serving after the warmup gives the tokens it
gives without. Runs under 5.17 and 5.19-5.24; the captures themselves: ``graphs_check.py`` and
the profile on a GPU."""

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from tf_engine import fake_memory_and_uninstall  # noqa: F401  (autouse: memory faked, patch off after)
from tf_engine import forced_padding, graphed  # noqa: F401  (graphed: a fixture)

eng.skip_unless_served()

from harness import check as h
from test_transformers_graphs import recorded_rounds

import vmem.transformers as vt
from vmem.transformers import warmup as vw

NEW = 4
LENGTHS = [5, 40, 17, 3, 9]
# graph_max_tokens=None: every varlen size graphed, so the warmup runs only the largest of them
OPTS = dict(page_size="64K", max_requests=8, max_context=4096, memory="32M", graph_max_tokens=None)
# Decode rounds pad to 4 or 8 tokens; rows of 4,096 tokens: buckets 1024 (past 0), 2048, 4096.
PAD = dict(max_batch_tokens=64, q_padding_interval_size=4, kv_padding_interval_size=256)


@pytest.fixture(autouse=True)
def _installed():
    """vmem's names registered before any engine is made (tf_engine's fixture uninstalls after)."""
    vt.install()


def _tokens(run):
    return [list(run["results"][rid].generated_tokens) for rid in run["ids"]]


def _manager(model, cb=None, **opts):
    """An engine on ``model`` served by vmem with ``opts`` (and ``cb`` over :data:`PAD`), warmed
    up; its cache."""
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with vt.serving(**dict(OPTS, **opts)):
        model.set_attn_implementation(vt.VMEM_ATTENTION)
        config = transformers.ContinuousBatchingConfig(**dict(PAD, **(cb or {})))
        mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
        mgr.warmup()
    return mgr, mgr.batch_processor.cache


@pytest.mark.parametrize("seqlen_k, expected", [
    ("bucket", {(4, 1024), (8, 1024), (4, 2048), (8, 2048), (4, 4096), (8, 4096)}),
    ("context", {(4, 4096), (8, 4096)}),  # max_seqlen_k is the row length: one graph a size
])
def test_warmup_runs_a_decode_round_of_every_size_and_bucket_and_frees_it(seqlen_k, expected, caplog):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    with forced_padding(), recorded_rounds() as rounds, caplog.at_level(logging.WARNING):
        mgr, cache = _manager(model, graph_seqlen_k=seqlen_k)
    # no round refused (the engine's own varlen warmup asked a vmem row for the whole budget)
    assert not [r.message for r in caplog.records if "warm" in r.message.lower()]
    assert all(padded for _, _, _, padded in rounds)
    # first the largest varlen round (one request of max_batch_tokens, sizing the graph pool) ...
    assert (rounds[0][2].decode, rounds[0][2].real, rounds[0][2].total_q) == (False, 1, PAD["max_batch_tokens"])
    assert sum(not m.decode for _, _, m, _ in rounds) == 1
    # ... then one decode round per padded size and bucket
    decode = [(m.total_q, m.max_k) for _, _, m, _ in rounds if m.decode]
    assert set(decode) == expected and len(decode) == len(expected), decode
    # the fewest fake requests a size needs (1 pads to 4, 5 to 8), each of one query token
    assert sorted({m.real for _, _, m, _ in rounds if m.decode}) == [1, 5]
    assert len(cache.table) == 0 and cache.usage()["rows_in_use"] == 0  # every fake request freed
    assert cache.get_num_free_blocks() == cache.num_blocks
    mgr.stop(block=True)


def test_with_the_default_options_the_warmup_captures_every_graph_a_round_can_replay():
    """graph_seqlen_k="context" and graph_max_tokens=512 (above this engine's 64-token rounds):
    every varlen size once, largest first, and every decode size once; no bucket."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    defaults = vt.Options()
    assert (defaults.graph_seqlen_k, defaults.graph_max_tokens) == ("context", 512)
    with forced_padding(), recorded_rounds() as rounds:
        mgr, _ = _manager(model, graph_seqlen_k=defaults.graph_seqlen_k, graph_max_tokens=defaults.graph_max_tokens)
    varlen = [m.total_q for _, _, m, _ in rounds if not m.decode]
    assert varlen == list(range(64, 0, -4))
    assert [m.total_q for _, _, m, _ in rounds if m.decode] == [4, 8]
    assert {m.max_k for _, _, m, _ in rounds} == {4096}
    mgr.stop(block=True)


def test_a_varlen_round_longer_than_a_row_is_skipped_quietly(caplog):
    """max_batch_tokens above max_context: the largest varlen round cannot come up (a row holds
    fewer tokens), so it is not tried; no warning, the next size down is captured."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    with forced_padding(), recorded_rounds() as rounds, caplog.at_level(logging.WARNING):
        mgr, cache = _manager(model, cb=dict(max_batch_tokens=512, q_padding_interval_size=64),
                              max_context=16, graph_seqlen_k="context", graph_max_tokens=512)
    assert cache.max_context == 256  # whole blocks
    assert not [r.message for r in caplog.records if "warm" in r.message.lower()]
    assert [m.total_q for _, _, m, _ in rounds if not m.decode] == [256, 192, 128, 64]
    mgr.stop(block=True)


def test_serving_after_the_warmup_gives_the_tokens_it_gives_without():
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with forced_padding():
        plain = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD, serving=OPTS)
        warm = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD, serving=OPTS, warmup=True)
    assert _tokens(warm) == _tokens(plain) and all(len(t) == NEW for t in _tokens(warm))


def test_a_fake_round_that_fails_is_skipped_and_leaks_nothing_into_serving(monkeypatch, caplog):
    """The first fake round fails after its requests were recorded for the round (the IOs'
    ``prepare_batch_tensors`` raises once): logged, its requests freed, the round dropped, so the
    first real round reads only its own requests."""
    from transformers.generation.continuous_batching import input_outputs as cb_io

    real = cb_io.ContinuousBatchingIOs.prepare_batch_tensors
    failed = []

    def prepare(self, *a, **k):
        out = real(self, *a, **k)
        states = a[0] if a else next(iter(k.values()))  # the engine passes the round's states first, by name
        if not failed and any(s.state.request_id.startswith("__warmup_DECODING") for s in states):
            failed.append(len(states))
            raise RuntimeError("injected")
        return out

    monkeypatch.setattr(cb_io.ContinuousBatchingIOs, "prepare_batch_tensors", prepare)
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with forced_padding():
        plain = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD, serving=OPTS)
        with caplog.at_level(logging.WARNING, logger=vw.__name__):
            warm = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD, serving=OPTS, warmup=True)
    assert failed == [1]
    assert any("warmup round of 1 requests (1 query tokens after 0) failed: injected" in r.message
               for r in caplog.records)
    assert _tokens(warm) == _tokens(plain)


def test_other_caches_keep_the_engines_warmup():
    """The engine's own cache: no fake decode round of vmem's (the hook looks for round buffers)."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(2, [5, 9], model.config.vocab_size)
    vt.install()
    with forced_padding(), recorded_rounds() as rounds:
        run = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=PAD, warmup=True)
    assert rounds == [] and all(len(t) == NEW for t in _tokens(run))


def test_the_engines_own_cache_takes_the_same_decode_warmup():
    """What the benchmarks give a contender on the engine's cache (the fi-paged peer): the same
    fake decode rounds, their blocks given back, and the same tokens after."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with forced_padding():
        model.set_attn_implementation(eng.ENGINE_SDPA)
        cb = transformers.ContinuousBatchingConfig(**PAD, max_requests_per_batch=8)
        mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        mgr.warmup()
        cache = mgr.batch_processor.cache
        free_now = getattr(cache, "get_num_free_blocks", None) or (lambda: cache.compute_free_capacity(relative=False))
        free = free_now()  # 5.17 counts free blocks; 5.19+ its free capacity
        runner = mgr.batch_processor.model_runner
        sizes = vw.decode_sizes(runner)
        assert len(sizes) >= 2 and vw.capture_graphs(runner, model, max_context=4096) == 3 * len(sizes)
        assert free_now() == free
        plain = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=PAD)
        warm = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=PAD, warmup=True, decode_warmup=True)
    assert _tokens(warm) == _tokens(plain) and all(len(t) == NEW for t in _tokens(warm))


def test_graph_max_tokens_runs_larger_prefill_rounds_without_a_graph(graphed):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with forced_padding():
        plain = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD, serving=OPTS)
        graphed.clear()
        with recorded_rounds() as rounds:
            limited = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=PAD,
                                   serving=dict(OPTS, graph_max_tokens=16))
    assert _tokens(limited) == _tokens(plain)
    expected = [m.total_q for _, _, m, _ in rounds if m.decode or m.total_q <= 16]
    assert graphed == expected and len(expected) < len(rounds)  # some prefill rounds ran without one


def test_with_graph_max_tokens_the_warmup_captures_every_varlen_size_up_to_it(graphed):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    with forced_padding(), recorded_rounds() as rounds:
        mgr, _ = _manager(model, graph_seqlen_k="bucket", graph_max_tokens=16)
    # First the largest round the engine can give (max_batch_tokens), run without a graph: it
    # sizes the graphs' memory pool, which every later round fits in.
    first = rounds[0][2]
    assert not first.decode and first.total_q == PAD["max_batch_tokens"] > 16
    varlen = [(m.total_q, m.max_k) for _, _, m, _ in rounds[1:] if not m.decode]
    assert varlen[0][0] == 16  # then the largest graphed one
    assert sorted(varlen) == sorted((q, b) for q in (4, 8, 12, 16) for b in (1024, 2048, 4096))
    assert len(graphed) == len(rounds) - 1  # every other warmup round is one the engine graphs
    mgr.stop(block=True)


class _Runner:
    """The two members :func:`vw.decode_sizes` reads, padding as the engine does."""

    def __init__(self, most, interval, max_tokens):
        from transformers.generation.continuous_batching.utils import pad_to_interval

        self.cb_config = SimpleNamespace(max_requests_per_batch=most)
        self._pad = lambda n: pad_to_interval(n, interval, max_tokens)

    def maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path):
        assert not use_decode_fast_path  # vmem's decode rounds run the varlen path
        return self._pad(num_q_tokens), max_kv_read


@pytest.mark.parametrize("most, interval, max_tokens, expected", [
    (130, 64, 4096, [(1, 64), (65, 128), (129, 192)]),
    (64, 64, 4096, [(1, 64)]),
    (300, 64, 100, [(1, 64), (65, 100)]),  # capped at max_batch_tokens
    (8, 0, 32, [(1, 32)]),  # no interval: the engine pads to max_batch_tokens
    (0, 64, 4096, []),
])
def test_decode_sizes_are_the_fewest_requests_for_each_padded_size(most, interval, max_tokens, expected):
    assert vw.decode_sizes(_Runner(most, interval, max_tokens)) == expected


@pytest.mark.parametrize("context, seqlen_k, expected", [
    (5000, "bucket", [0, 2048, 4096, 8192]),  # 4,097-5,000 tokens pad to 8,192
    (4096, "bucket", [0, 2048, 4096]),
    (1024, "bucket", [0]),
    (5000, "context", [0]),
])
def test_buckets_are_the_max_seqlen_k_a_graph_key_can_carry(context, seqlen_k, expected):
    cache = SimpleNamespace(max_context=context, options=vt.Options(graph_seqlen_k=seqlen_k))
    assert vw.buckets(cache) == expected


def test_pairs_visits_both_io_pairs_under_async_batching_and_swaps_back():
    class Async:
        swaps = 0

        def swap_io_pairs(self):
            self.swaps += 1

    io = Async()
    assert len(list(vw._pairs(io, Async))) == 2 and io.swaps == 2
    assert len(list(vw._pairs(object(), Async))) == 1


@pytest.mark.parametrize("cache, expected", [
    # every varlen round graphed, or none above the limit: nothing to run
    (dict(limit=None, bs=256, mc=4096, tokens=8192, blocks=64, rows=9), None),
    (dict(limit=8192, bs=256, mc=4096, tokens=8192, blocks=64, rows=9), None),
    # max_batch_tokens in two rows' worth of requests
    (dict(limit=512, bs=256, mc=4096, tokens=8192, blocks=64, rows=9), (2, 4096)),
    # the KV budget holds less: whole blocks of it
    (dict(limit=512, bs=256, mc=4096, tokens=8192, blocks=13, rows=9), (1, 3328)),
    # more than the rows hold: as many requests as rows (but the trash row), each a row at most
    (dict(limit=512, bs=256, mc=1024, tokens=8192, blocks=64, rows=4), (3, 1024)),
    (dict(limit=512, bs=256, mc=1024, tokens=8192, blocks=64, rows=2), (1, 1024)),
])
def test_the_largest_eager_round_fits_the_rows_and_the_budget(monkeypatch, cache, expected):
    runs = []
    monkeypatch.setattr(vw, "_fake_round", lambda runner, model, mr, requests, q, past: runs.append((requests, q)) or 1)
    c = SimpleNamespace(options=SimpleNamespace(graph_max_tokens=cache["limit"]), block_size=cache["bs"],
                        max_context=cache["mc"], max_batch_tokens=cache["tokens"], num_blocks=cache["blocks"],
                        rows=cache["rows"])
    runner = SimpleNamespace(cache=c, cb_config=SimpleNamespace(max_requests_per_batch=32))
    ran = vw._largest_eager_round(runner, c, None, None)
    assert runs == ([] if expected is None else [expected]) and ran == len(runs)
