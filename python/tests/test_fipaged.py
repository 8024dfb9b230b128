"""The ``fi-paged`` bench contender (python/benches/harness/fipaged.py) on the CPU: the block
table -> FlashInfer arguments conversion, checked by a pure-torch reference of FlashInfer's paged
attention over the engine's own pool (5.17's per-layer pool, 5.19+'s cross-layer block-major
one), end to end against the engine's own sdpa path; and the version-aware contender registry.
FlashInfer's kernels themselves need a GPU: the serving suite runs them there (its top-1 check)."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import check as h
from harness import contenders, fipaged
from tf_engine import graphed  # noqa: F401  (a fixture)

import vmem.transformers as vt
from vmem.kernels import fi_graphs
from vmem.kernels import flashinfer as vk_fi

TOL = 1e-4
NEW = 4
LENGTHS = [5, 140, 270, 17, 33, 64]


@pytest.fixture(autouse=True)
def _installed():
    h.fake_cpu_memory()
    vt.install()
    yield
    vt.uninstall()


def _dense(q, k, v, scale):
    """Causal attention of one request, bottom-right aligned: q [n, Hq, D], k/v [m, Hkv, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)


def test_plan_decode_pads_one_request_per_token():
    rnd = fipaged.plan_round([(5, 1, [3]), (16, 1, [1, 7])], page_size=16, trash_page=9, num_q_tokens=4, num_seqs=4)
    assert isinstance(rnd, vk_fi.PagedPlan)  # the package's plan: its wrappers and reference take it
    assert rnd.decode and rnd.kv_last_page_len.numel() == 4 and rnd.total_q == 4 and rnd.page_size == 16
    assert rnd.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert rnd.kv_indptr.tolist() == [0, 1, 3, 4, 5]
    assert rnd.kv_indices.tolist() == [3, 1, 7, 9, 9]
    assert rnd.kv_last_page_len.tolist() == [6, 1, 1, 1]


def test_plan_prefill_pads_sequences_and_tokens():
    # 2 real requests (20 + 3 tokens), the engine padded to 32 tokens and 4 sequences
    rnd = fipaged.plan_round([(0, 20, [4, 2, 8]), (30, 3, [1, 5, 6])], page_size=16, trash_page=0,
                             num_q_tokens=32, num_seqs=4)
    assert not rnd.decode and rnd.kv_last_page_len.numel() == 5 and rnd.total_q == 32
    assert rnd.qo_indptr.tolist() == [0, 20, 23, 23, 23, 32]
    assert rnd.kv_indptr.tolist() == [0, 2, 5, 6, 7, 8]  # 20 tokens need 2 of the 3 pages listed
    assert rnd.kv_indices.tolist() == [4, 2, 1, 5, 6, 0, 0, 0]
    assert rnd.kv_last_page_len.tolist() == [4, 1, 1, 1, 9]


@pytest.mark.parametrize("bad", [
    dict(requests=[(0, 20, [1])], num_q_tokens=20),  # pages do not hold the tokens
    dict(requests=[(0, 20, [1, 2])], num_q_tokens=10),  # more tokens than the round
    dict(requests=[(0, 4, [1]), (0, 4, [2])], num_q_tokens=8, num_seqs=1),  # fewer sequences than requests
    dict(requests=[(0, 0, [1])], num_q_tokens=0),  # an empty query
])
def test_plan_refuses_what_it_cannot_express(bad):
    with pytest.raises(fipaged.PlanError):
        fipaged.plan_round(page_size=16, trash_page=0, **bad)


def test_reference_matches_dense_attention_over_scattered_pages():
    """The reference reads pages through the plan exactly as contiguous K/V would be read."""
    g = torch.Generator().manual_seed(0)
    page, hq, hkv, d = 8, 4, 2, 16
    pool_k, pool_v = torch.randn(40, page, hkv, d, generator=g), torch.randn(40, page, hkv, d, generator=g)
    perm = torch.randperm(39, generator=g).tolist()
    reqs, cursor = [], 0
    for past, query in [(0, 13), (21, 1), (7, 9), (40, 1)]:
        n = -(-(past + query) // page)
        reqs.append((past, query, perm[cursor:cursor + n]))
        cursor += n
    total = sum(q for _, q, _ in reqs)
    q = torch.randn(total + 5, hq, d, generator=g)
    rnd = fipaged.plan_round(reqs, page, 39, total + 5, num_seqs=6)
    out = vk_fi.paged_reference(q, pool_k, pool_v, rnd, 0.25)
    start = 0
    for past, query, pages in reqs:
        k = pool_k[pages].reshape(-1, hkv, d)[:past + query]
        v = pool_v[pages].reshape(-1, hkv, d)[:past + query]
        want = _dense(q[start:start + query], k, v, 0.25)
        assert torch.allclose(out[start:start + query], want, atol=1e-5)
        start += query
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias"])
def test_fi_paged_matches_engine_sdpa(arch):
    """Chunked prefill (48-token budget), requests joining mid-run, blocks of 32 tokens: the
    engine's own pool, read through the converted block table, gives the engine's sdpa logits."""
    model = h.make_model(arch, torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    cbk = dict(max_batch_tokens=48, num_blocks=128, **eng.engine_block(32))
    stagger = [0, 0, 2, 2, 4, 4]
    ours = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk, stagger=stagger)
    cache = ours["cache"]
    assert isinstance(cache, fipaged.FiPagedMixin) and cache.fi_backend_name == "reference"
    assert cache.fi_wrappers is None
    assert cache.page_size == 32
    cmp = h.compare(ours, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp
    theirs = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=cbk, stagger=stagger)
    for rid in ours["ids"]:
        assert list(ours["results"][rid].generated_tokens) == list(theirs["results"][rid].generated_tokens)
    assert h.cross_compare(ours, theirs) < TOL


def test_fi_paged_reads_in_place_without_the_engines_gather(monkeypatch):
    """No read indices are built and the engine's gathering ``update`` never runs."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(2, [40, 9], model.config.vocab_size)
    calls = []
    from transformers.generation.continuous_batching import cache as cb_cache

    monkeypatch.setattr(cb_cache.PagedAttentionCache, "update", lambda *a, **k: calls.append(1))
    run = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW,
                       cb_kwargs=dict(max_batch_tokens=64, num_blocks=64, **eng.engine_block(32)))
    assert h.compare(run, model, NEW)["counts_ok"]
    assert not calls


def test_a_refused_warmup_round_leaks_nothing_into_serving():
    """A pool smaller than a round (64 tokens against max_batch_tokens 96): the engine's warmup
    asks for a varlen round at a negative past, which the plan refuses; then the decode warmup
    the benchmarks give every contender with graphs. The first real round plans only its own
    requests (seen on the H200: the refused round's entries failed the next one)."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(2, [20, 9], model.config.vocab_size)
    cbk = dict(max_batch_tokens=96, num_blocks=2, q_padding_interval_size=16, **eng.engine_block(32))
    with eng.forced_padding():
        plain = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk)
        warm = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk, warmup=True,
                            decode_warmup=True)
    tokens = [[list(r["results"][rid].generated_tokens) for rid in r["ids"]] for r in (plain, warm)]
    assert tokens[0] == tokens[1] and all(len(t) == NEW for t in tokens[1])


def test_the_peer_takes_graph_max_tokens_as_vmem_does(graphed):
    """``fi-paged-graphs-async-512``'s option, on the CPU: prefill rounds above the limit run
    without a graph, planned for that, and give the same tokens; decode rounds keep theirs."""
    from tf_engine import forced_padding

    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    cbk = dict(max_batch_tokens=48, num_blocks=128, q_padding_interval_size=8, **eng.engine_block(32))
    planned = []
    real = fipaged.FiPagedMixin.fi_plan

    def fi_plan(self, batch_data, graph, pair=0):
        planned.append((int(batch_data["input_ids"].shape[-1]), graph, any(q != 1 for _, q, _ in self.fi_round)))
        return real(self, batch_data, graph, pair)

    with forced_padding():
        plain = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk)
        fipaged.FiPagedMixin.fi_plan = fi_plan
        graphed.clear()
        try:
            limited = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk,
                                   serving={"graph_max_tokens": 16})
        finally:
            fipaged.FiPagedMixin.fi_plan = real
    tokens = [[list(r["results"][rid].generated_tokens) for rid in r["ids"]] for r in (plain, limited)]
    assert tokens[0] == tokens[1]
    assert all(graph == (not prefill or t <= 16) for t, graph, prefill in planned), planned
    assert any(not graph for _, graph, _ in planned) and any(graph for _, graph, _ in planned)
    assert graphed == [t for t, graph, _ in planned if graph]


def test_the_async_peer_asks_for_graphs_and_async_batching():
    """``fi-paged-graphs-async``: the engine's graphs and its async batching (the engine refuses
    async batching without CUDA; on the GPU the serving suite checks the peer's tokens with graphs
    and async batching off)."""
    args = type("A", (), {"max_requests": 8, "page_size": "2M", "max_context": 1024})()
    budget = {"kv_bytes": 64 << 20, "token_bytes": 4096}
    kw, opts = contenders.contender_config(None, contenders.spec("fi-paged-graphs-async-512-compile"), args, budget)
    assert kw["use_cuda_graph"] is True and kw["use_async_batching"] is True and opts == {"graph_max_tokens": 512}
    assert kw["varlen_compile_config"].fullgraph is False and kw["num_blocks"] == (64 << 20) // (256 * 4096)
    kw, opts = contenders.contender_config(None, contenders.spec("fi-paged"), args, budget)
    assert "use_cuda_graph" not in kw and "use_async_batching" not in kw and opts == {}
    kw, opts = contenders.contender_config(None, contenders.spec("fi-paged-fa3-graphs-async-512-compile"), args,
                                           budget)
    assert opts == {"graph_max_tokens": 512, "prompt_reader": "flashinfer"} and kw["use_cuda_graph"] is True


def test_the_peer_takes_flashinfers_hopper_prefill_from_the_prompt_reader_option(monkeypatch):
    """``prompt_reader="flashinfer"`` in the options (``fi-paged-fa3-...``): the peer's eager
    prefill wrappers use the backend :func:`~vmem.kernels.flashinfer.prefill_backend` names
    (``fa3`` on Hopper; here a stand-in FlashInfer and the backend forced); without it, ``fa2``;
    the tokens are the reference run's."""
    from fake_flashinfer import FakeFlashInfer

    fake = FakeFlashInfer()
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    cbk = dict(max_batch_tokens=48, num_blocks=128, **eng.engine_block(32))
    plain = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk)
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    monkeypatch.setattr(vk_fi, "kernels_on", lambda device: True)
    monkeypatch.setattr(vk_fi, "prefill_backend", lambda device: "fa3")
    monkeypatch.setattr(fi_graphs, "WORKSPACE_BYTES", 1 << 10)
    runs = {}
    for reader in ("fa", "flashinfer"):
        runs[reader] = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk,
                                    serving={"prompt_reader": reader})
        ws = runs[reader]["cache"].fi_wrappers
        backends = {w.backend for (_, decode, _, _), w in ws.wrappers.items() if not decode}
        assert ws.eager_prefill == ("fa3" if reader == "flashinfer" else "fa2") and backends == {ws.eager_prefill}
        assert [list(runs[reader]["results"][r].generated_tokens) for r in runs[reader]["ids"]] == \
            [list(plain["results"][r].generated_tokens) for r in plain["ids"]]


def test_fi_paged_plans_into_the_packages_flashinfer_wrappers(graphed, monkeypatch):
    """Where FlashInfer's kernels run (a stand-in FlashInfer here, following its graph-mode rules),
    fi-paged plans every round, before its forward, into vmem's own
    :class:`~vmem.kernels.fi_graphs.WrapperSet` (no second set of wrappers in the harness): padded
    rounds into graph-mode wrappers, one per kind and padded size, over a workspace sized for
    padded rounds; the tokens are those of the reference run."""
    from fake_flashinfer import FakeFlashInfer
    from tf_engine import forced_padding

    fake = FakeFlashInfer()
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    cbk = dict(max_batch_tokens=48, num_blocks=128, q_padding_interval_size=8, **eng.engine_block(32))
    with forced_padding():
        plain = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk)
        monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
        monkeypatch.setattr(vk_fi, "kernels_on", lambda device: True)
        monkeypatch.setattr(fi_graphs, "WORKSPACE_BYTES", 1 << 10)  # no 128 MiB of CPU memory for a stand-in
        graphed.clear()
        ours = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, cb_kwargs=cbk)
    cache = ours["cache"]
    ws = cache.fi_wrappers
    assert isinstance(ws, fi_graphs.WrapperSet) and cache.fi_backend_name == "flashinfer"
    assert ws.plans == len(graphed) > 0 and sum(w.plans for w in fake.made) == ws.plans
    assert all(w.graph for w in ws.wrappers.values()) and {d for _, d, _, _ in ws.wrappers} == {True, False}
    cfg = model.config
    assert ws.workspace.numel() == fi_graphs.workspace_bytes(True, cache.max_batch_tokens, cfg.num_attention_heads,
                                                             cfg.head_dim)
    assert ws.max_pages == -(-cfg.max_position_embeddings // cache.page_size) + 1
    assert [list(ours["results"][r].generated_tokens) for r in ours["ids"]] == \
        [list(plain["results"][r].generated_tokens) for r in plain["ids"]]
    cmp = h.compare(ours, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp


def test_contenders_offer_only_what_this_version_serves():
    names = contenders.offered()
    assert "fi-paged" in names and "fi-paged-graphs-async-512-compile" in names
    if eng.IS_517:
        assert {"paged-sdpa-256", "paged-sdpa-256-graphs-async-compile", "paged-flex-256"} <= set(names)
        assert "sdpa-256-graphs-async-compile" not in names
    else:
        assert {"sdpa-256", "sdpa-256-graphs-async-compile"} <= set(names)
        assert not any(n.startswith("paged-") for n in names)
    assert contenders.engine_best() in names and contenders.is_engine_native("x", contenders.spec(contenders.engine_best()))
    for name in names:
        assert contenders.spec(name)["attn"]
    refused = "sdpa-256-graphs-async-compile" if eng.IS_517 else "paged-flex-256"
    with pytest.raises(ValueError, match=f"{refused}.*transformers {transformers.__version__}"):
        contenders.spec(refused)
    with pytest.raises(ValueError, match="unknown contender"):
        contenders.spec("no-such-contender")


def test_graph_key_names_the_round_kind():
    """A decode round and a mixed round of the same engine key must not share a captured graph
    (their FlashInfer kernels differ): the patched key adds the round's kind, for fi-paged only."""
    import types

    from transformers.generation.continuous_batching import input_outputs as io

    fipaged._install_hooks()
    ks = {"full_attention": 1024}
    state = dict(use_block_table=False, num_q_tokens=64, max_kv_read=0, max_seqlen_k=ks, max_length_k=ks)
    keys = {}
    for kind in ("decode", "prefill"):
        cache = types.SimpleNamespace(fi_kind=kind)
        keys[kind] = io.ContinuousBatchingIOs._get_graph_key(types.SimpleNamespace(cache=cache, **state))
    engine = io.ContinuousBatchingIOs._get_graph_key(types.SimpleNamespace(cache=object(), **state))
    assert keys["decode"] != keys["prefill"]
    assert keys["decode"][:-1] == keys["prefill"][:-1] == engine


def test_fi_paged_reads_shared_prefix_blocks():
    """The engine's block sharing stays on under fi-paged: requests adopting another's full prompt
    blocks read them through their block table (the plan lists the shared blocks) and their
    logits still match the reference."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    system = h.make_prompts(1, [70], model.config.vocab_size, seed=5)[0]
    tails = h.make_prompts(4, [9, 30, 3, 17], model.config.vocab_size, seed=6)
    prompts = [system + t for t in tails]
    with eng.engine_prefix_hits() as hits:
        run = h.run_engine(model, fipaged.FI_PAGED_ATTENTION, prompts, NEW, stagger=[0, 1, 2, 3],
                           cb_kwargs=dict(max_batch_tokens=64, num_blocks=64, allow_block_sharing=True,
                                          **eng.engine_block(32)))
    assert sum(hits) >= 3 * 64, hits  # two full 32-token blocks of the system prompt, for each later request
    cmp = h.compare(run, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp
