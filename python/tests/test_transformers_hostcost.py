"""The host work vmem's engine cache does per round (issue #32, docs/serving.md "Host cost per
round"), on the CPU: what each cut keeps doing, and that the cut holds (kernels and calls counted,
so each test fails on the code before it).

Needs torch and a transformers vmem serves (as test_transformers_cb.py)."""


import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import check as h

import vmem
import vmem.transformers as vt

OPTS = dict(page_size="64K", max_requests=4, max_context=1024, memory="8M")


@pytest.fixture(autouse=True)
def _fake_memory():
    h.fake_cpu_memory()


def _cache(sharing=True, **kw):
    cfg = h.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, allow_block_sharing=sharing)
    return vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**dict(OPTS, **kw)))


def _row(cache, request_id, tokens):
    """A request's ``[layers, 2, tokens, Hkv, D]`` K/V (its first ``tokens``)."""
    index = cache.table.get(request_id).index
    return torch.stack([torch.stack([k[index, :tokens], v[index, :tokens]]) for k, v in zip(cache._k4, cache._v4)])


def _fill(cache, request_id, tokens, value):
    index = cache.table.get(request_id).index
    for k, v in zip(cache._k4, cache._v4):
        k[index, :tokens] = value
        v[index, :tokens] = value


@pytest.mark.parametrize("layout", ["per-layer", "token-major"])
def test_a_round_zeroes_exactly_its_fresh_blocks(layout):
    """Fresh blocks read zeros (a freed row's pages come back with NaN in them), and a row that
    grew keeps what its old blocks hold: only ``[old, new)`` of each grown row is zeroed."""
    cache = _cache(sharing=False, layout=layout)
    bs = cache.block_size
    assert cache.allocate_blocks(1, "a", 0) == 1 and cache.allocate_blocks(2, "b", 0) == 2
    cache.flush()
    _fill(cache, "a", bs, 1.0)
    _fill(cache, "b", 2 * bs, float("nan"))
    cache.free_blocks("b")  # its pages, NaN inside, go back to the pool
    assert cache.allocate_blocks(2, "c", 0) == 2 and cache.allocate_blocks(1, "a", 1) == 1
    cache.flush()
    a, c = _row(cache, "a", 2 * bs), _row(cache, "c", 2 * bs)
    assert torch.equal(a[:, :, :bs], torch.ones_like(a[:, :, :bs])), "a's old block was zeroed"
    assert torch.equal(a[:, :, bs:], torch.zeros_like(a[:, :, bs:])), "a's new block was not zeroed"
    assert torch.equal(c, torch.zeros_like(c)), "c's fresh blocks hold the freed row's NaN"


@pytest.mark.parametrize("layout", ["per-layer", "token-major"])
def test_a_round_zeroes_its_fresh_blocks_with_one_kernel_or_two_a_layer(monkeypatch, layout):
    """However many rows grew, a round zeroes with one kernel per layer's K and V (2 x layers)
    with the per-layer layout, and with one kernel in all with the token-major one (a block of
    a row is one range for every layer): each is a launch on the GPU, and a prefill round of 64
    new requests at 16 layers made 2,048 (2 per layer per row), then 32; a decode round at 32
    layers spent 0.8 ms of the host's time on its 64 (the H200 profile, docs/serving.md)."""
    cache = _cache(sharing=False, layout=layout)
    layers = len(cache._k4)
    for i in range(3):
        assert cache.allocate_blocks(1 + i, f"r{i}", 0) == 1 + i
    calls = []
    for op in ("zero_", "index_fill_", "fill_", "copy_", "masked_fill_"):
        real = getattr(torch.Tensor, op)
        monkeypatch.setattr(torch.Tensor, op, lambda self, *a, _real=real, _op=op, **k: calls.append(_op)
                            or _real(self, *a, **k))
    cache.flush()
    monkeypatch.undo()
    assert len(calls) == (1 if layout == "token-major" else 2 * layers), (len(calls), calls[:8])
    assert all(torch.equal(_row(cache, f"r{i}", (1 + i) * cache.block_size),
                           torch.zeros_like(_row(cache, f"r{i}", (1 + i) * cache.block_size))) for i in range(3))


def test_the_free_blocks_query_is_one_call_building_no_dict(monkeypatch):
    """With sharing on, the engine asks for free blocks once per scheduling candidate (every
    request, every round): the answer is exact (shared blocks once) and comes from one
    ``KVCache.distinct_mapped_bytes`` call, not ``usage()`` and ``prefix_stats()`` (two dicts,
    and an O(rows) loop each time: 5 µs a call at 256 rows, 130 calls a round)."""
    cache = _cache(sharing=True, layout="token-major", prefix_cache="1M")
    bs = cache.block_size
    prompt = list(range(3, 3 + 2 * bs + 5))
    assert cache.allocate_blocks(3, "a", 0) == 3
    cache.flush()
    cache.table.get("a").computed = 2 * bs + 5
    cache.kv.publish_prefix(cache.table.get("a").index, prompt)
    assert cache.search_prefix_match("b", prompt) == 2 * bs  # b maps a's first two blocks
    kv = cache.kv
    assert kv.prefix_stats()["shared_savings_bytes"] > 0
    assert kv.distinct_mapped_bytes() == kv.usage()["mapped_bytes"] - kv.prefix_stats()["shared_savings_bytes"]
    block_bytes = cache.pages_per_block * cache.page_bytes
    expected = cache.num_blocks - (kv.distinct_mapped_bytes() // block_bytes - 1) - cache.table.pending_blocks
    read = []
    monkeypatch.setattr(kv, "usage", lambda: read.append("usage") or {})
    monkeypatch.setattr(kv, "prefix_stats", lambda: read.append("prefix_stats") or {})
    assert cache.get_num_free_blocks() == expected == cache.num_blocks - 3  # a's 3 blocks, b's 2 of them once
    assert read == []


class _CountingRs:
    """``KVCache._rs`` counting the calls of each method."""

    def __init__(self, rs):
        self._rs, self.calls = rs, {}

    def __getattr__(self, name):
        attr = getattr(self._rs, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)

        return call


def test_outside_a_pool_the_scheduler_reads_no_tenant_slot(monkeypatch):
    """Outside a pool the free blocks query and the loop's room check read nothing of a tenant
    (``tenant()`` built a dict of 9 entries, with a ``getpid`` system call and the ledger's
    path, per candidate and per loop turn); the budget is the cache's own."""
    cache = _cache(sharing=False)
    rs = _CountingRs(cache.kv._rs)
    monkeypatch.setattr(cache.kv, "_rs", rs)
    assert [cache.get_num_free_blocks() for _ in range(5)] == [cache.num_blocks] * 5
    assert cache.tenant.yield_room() == 0 and cache.tenant.budget_blocks() == cache.num_blocks
    assert cache.tenant.release_when_idle() == 0  # each loop turn, as yield_room
    assert "tenant" not in rs.calls and "is_asleep" not in rs.calls, rs.calls


def test_in_a_pool_the_budget_follows_the_limit_without_building_the_tenant_dict(tmp_path, monkeypatch):
    """A pool tenant's budget follows its limit and its neighbours' use, read each time it is
    asked (once per scheduling candidate) with ``pool_room()``: three of the ledger's numbers,
    not ``tenant()``'s dict of 9 entries with a ``getpid`` system call and the ledger's path."""
    ledger = vmem.pool.create(str(tmp_path / "pool"), size="64M")
    cache = _cache(sharing=False, layout="token-major",
                   pool=vmem.pool.Join("t", limit=8 * 65536, ledger=ledger.path))
    rs = _CountingRs(cache.kv._rs)
    monkeypatch.setattr(cache.kv, "_rs", rs)
    assert cache.tenant.budget_blocks() == 7 == cache.get_num_free_blocks()
    ledger.set_limit("t", 20 * 65536)
    assert cache.tenant.budget_blocks() == 19
    other = vmem.KVCache(layers=2, kv_heads=1, head_dim=64, dtype="float32", max_batch=2, max_context=65536,
                         page_size="64K", backend="host", pool=vmem.pool.Join("o", limit=64 << 20, ledger=ledger.path),
                         overlap=False, eager_tokens=0)  # no mapping in the background between two reads
    other.step({other.alloc(): 64512})  # the neighbour takes all but 1 MB of the pool
    t = rs._rs.tenant()  # read past the counter
    room = t["pool_room"] + t["usage"]  # no floors here: the pool's free room plus its own
    assert room // 65536 - 1 < 19 and cache.tenant.budget_blocks() == room // 65536 - 1
    assert rs.calls.get("pool_room") == 4 and "tenant" not in rs.calls, rs.calls
    other.close()
    cache.kv.close()


def test_the_round_clock_counts_the_requests_the_engine_scheduled_not_the_graph_padding():
    """Under CUDA graphs the forward gets a padded batch (here 64 tokens and sequences for 3
    decoding requests, then 2 requests of 5 and 1 query tokens padded to 64): the clock files
    each round with the requests and tokens the engine prepared (sync and async IO), and its kind
    from them; the padded sizes are kept apart."""
    import types

    import torch
    from harness.hostclock import HookClock, real_round

    def fs(q):
        return types.SimpleNamespace(query_length=q)

    sync = types.SimpleNamespace(requests_in_batch=[fs(1), fs(1), fs(1)])
    pair = types.SimpleNamespace(host_io=types.SimpleNamespace(requests_in_batch=[fs(5), fs(1)]))
    async_ios = types.SimpleNamespace(io_pairs=[types.SimpleNamespace(host_io=None), pair], current_pair=1)
    assert real_round(types.SimpleNamespace(inputs_and_outputs=sync)) == (3, 3)
    assert real_round(types.SimpleNamespace(inputs_and_outputs=async_ios)) == (2, 6)
    assert real_round(types.SimpleNamespace()) is None

    clock = HookClock()
    prepare = clock.round_starts(lambda processor: True)
    compute = clock.round_kind(lambda runner, model, data: None)
    padded = {"cu_seq_lens_q": torch.arange(65), "input_ids": torch.zeros(1, 64)}
    for ios in (sync, async_ios):
        prepare(types.SimpleNamespace(inputs_and_outputs=ios))
        compute(None, None, padded)
    clock.close_round()
    got = [(r["kind"], r["sequences"], r["tokens"], r["padded_sequences"], r["padded_tokens"]) for r in clock.rounds]
    assert got == [("decode", 3, 3, 64, 64), ("prefill", 2, 6, 64, 64)]
