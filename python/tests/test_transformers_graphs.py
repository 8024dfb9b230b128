"""vmem under the engine's CUDA-graph path, on the CPU (fp32, host backend): graphs cannot be
captured here, so the engine's padding path (what graphs and compile turn on) is forced, and
what a graph would bake in is checked: the static round buffers keep their address, padded
rounds give the same greedy tokens (and logits) as unpadded ones and as the engine's own paged
path, padded tokens write only to the trash row, no page is mapped or unmapped inside the
forward, and what is refused says why. Runs under 5.17 and 5.19-5.24. The capture and replay
themselves: ``test_gpu.py::test_cb_graphs`` and ``benches/graphs_check.py`` on a GPU."""

import contextlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from tf_engine import forced_padding

eng.skip_unless_served()

from harness import check as h

import vmem
import vmem.transformers as vt
from vmem.kernels import fa as vk_fa
from vmem.transformers import attention as vt_attention
from vmem.transformers import graphs as vt_graphs
from vmem.transformers.cache import VmemCBCache
from vmem.transformers import hooks as vt_hooks

TOL = 1e-4
NEW = 5
LENGTHS = [5, 140, 70, 17, 33, 3]
OPTS = dict(page_size="64K", max_requests=8, max_context=1024, memory="16M")
# Small padding intervals so rounds are padded with tokens and sequences.
PAD = dict(max_batch_tokens=64, q_padding_interval_size=16, kv_padding_interval_size=256)


@pytest.fixture(autouse=True)
def _installed():
    h.fake_cpu_memory()
    vt.install(**OPTS)
    yield
    vt.uninstall()


@contextlib.contextmanager
def recorded_rounds():
    """Every round vmem's engine hook prepared: ``(cache, batch_data, meta)``."""
    seen = []
    real = vt_graphs.prepare_round

    def prepare(cache, batch_data, padded, stream, **kw):
        rnd = real(cache, batch_data, padded, stream, **kw)
        data = {"tokens": int(batch_data["input_ids"].shape[-1]),  # copies: the engine reuses its buffers
                "write_index": batch_data["write_index"][0].clone()}
        seen.append((cache, data, rnd.meta, padded))
        return rnd

    vt_graphs.prepare_round = prepare
    try:
        yield seen
    finally:
        vt_graphs.prepare_round = real


def _tokens(run):
    return [list(run["results"][rid].generated_tokens) for rid in run["ids"]]


def _serve(model, attn, prompts, serving=None, **cb):
    return h.run_engine(model, attn, prompts, NEW, cb_kwargs=dict(PAD, **cb), serving=serving)


@pytest.mark.parametrize("layout", ["per-layer", "token-major"])
def test_padded_rounds_match_unpadded_ones_and_the_engines_own_path(layout):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    plain = _serve(model, vt.VMEM_ATTENTION, prompts, serving=dict(layout=layout))
    with forced_padding(), recorded_rounds() as rounds:
        padded = _serve(model, vt.VMEM_ATTENTION, prompts, serving=dict(layout=layout))
    with forced_padding():
        engine = h.run_engine(model, eng.ENGINE_SDPA, prompts, NEW, cb_kwargs=dict(PAD))
    # The padding path was taken: rounds with padded tokens and with padded sequences.
    assert all(r[3] for r in rounds)
    assert any(m.total_q > int(m.host[m.real]) for _, _, m, _ in rounds), "no round had padded tokens"
    assert any(m.n > m.real for _, _, m, _ in rounds), "no round had padded sequences"
    assert _tokens(padded) == _tokens(plain) == _tokens(engine)
    # Teacher-forced logits of the padded run against a plain forward.
    cmp = h.compare(padded, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp


def test_round_buffers_keep_their_address_across_rounds():
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with forced_padding(), recorded_rounds() as rounds:
        _serve(model, vt.VMEM_ATTENTION, prompts)
    assert len(rounds) > NEW
    caches = {id(c) for c, _, _, _ in rounds}
    assert len(caches) == 1
    cache = rounds[0][0]
    base = cache.round_buffers.buffer.data_ptr()
    by_size = {}
    for _, _, meta, _ in rounds:
        ptrs = (meta.cu_q.data_ptr(), meta.cu_k.data_ptr(), meta.used.data_ptr())
        assert ptrs[0] == base  # views of the one buffer, at fixed offsets
        assert by_size.setdefault(meta.n, ptrs) == ptrs  # the same views for the same padded size
    assert cache.round_buffers.buffer.data_ptr() == base
    assert cache.round_buffers.fills == len(rounds)


def test_padded_tokens_write_only_to_the_trash_row():
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    with forced_padding(), recorded_rounds() as rounds:
        _serve(model, vt.VMEM_ATTENTION, prompts)
    cache = rounds[0][0]
    mc, trash = cache.max_context, cache.trash_row
    padded_writes = 0
    for _, data, meta, _ in rounds:
        t = data["tokens"]
        real = int(meta.host[meta.real])  # cu_q at the last real request
        write = data["write_index"][:t].tolist()
        assert all(w // mc != trash for w in write[:real]), "a real token wrote to the trash row"
        assert all(w == trash * mc for w in write[real:]), "a padded token wrote outside the trash row"
        padded_writes += t - real
        used = meta.host[2 * meta.n + 2:].tolist()
        assert used[meta.real:] == [0] * (meta.n - meta.real)  # padded sequences read nothing
        rows = [int(k) // mc for k in meta.host[meta.n + 1: meta.n + 1 + meta.real].tolist()]
        assert trash not in rows and len(set(rows)) == len(rows)
    assert padded_writes > 0


class _Layer:
    layer_idx = 0


def _direct_cache():
    cfg = h.make_config("llama-gqa")
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    return vt.cache_class()(cfg, cb, "cpu", dtype=torch.float32, options=vt.Options(**OPTS))


def test_the_trash_row_absorbs_padded_writes_and_no_real_row_changes():
    cache = _direct_cache()
    for rid in ("a", "b"):
        assert cache.allocate_blocks(1, rid, 0) == 1
    entries = {"a": (3, 2), "b": (0, 4)}  # (past, q)
    write = [[]]
    for rid, (past, q) in entries.items():
        cache.extend_read_and_write_indices(rid, past, q, None, write)
    k4, v4 = cache.kv_rows(0)
    bs, mc, trash = cache.block_size, cache.max_context, cache.trash_row
    rows = {rid: cache.table.get(rid).index for rid in entries}
    mapped = [rows["a"], rows["b"], trash]  # one block each (the round's step mapped a and b); the rest is unmapped
    torch.manual_seed(0)
    for r in mapped:
        k4[r, :bs].normal_()
        v4[r, :bs].normal_()
    before_k = [k4[r, :bs].clone() for r in mapped]
    before_v = [v4[r, :bs].clone() for r in mapped]
    real_t, pad_t, seqs = 6, 16, 4  # 10 padded tokens, 2 padded sequences
    write_index = torch.tensor(write[0] + [trash * mc] * (pad_t - real_t))
    cu_q = torch.tensor([0, 2, 6, 6, 6], dtype=torch.int32)
    batch = {"input_ids": torch.zeros(1, pad_t, dtype=torch.long), "cu_seq_lens_q": cu_q, "max_seqlen_k": 1024}
    rnd = vt_graphs.prepare_round(cache, batch, True, None)
    assert rnd.meta.n == seqs and rnd.meta.real == 2 and rnd.meta.max_q == pad_t and rnd.meta.max_k == 1024
    hq, hkv, d = cache.config.num_attention_heads, cache.num_key_value_heads, cache.head_dim
    q = torch.randn(1, hq, pad_t, d)
    key, value = torch.randn(1, hkv, pad_t, d), torch.randn(1, hkv, pad_t, d)
    out, _ = vt_attention.paged_attention(_Layer(), q, key, value, scaling=d ** -0.5, cache=cache,
                                          write_index=[write_index])
    # Real tokens landed at their rows' positions; padded ones at the trash row's first slot only.
    pos = 0
    for i, (rid, (past, qn)) in enumerate(entries.items()):
        expect_k, expect_v = before_k[i].clone(), before_v[i].clone()
        expect_k[past:past + qn] = key[0, :, pos:pos + qn].transpose(0, 1)
        expect_v[past:past + qn] = value[0, :, pos:pos + qn].transpose(0, 1)
        assert torch.equal(k4[rows[rid], :bs], expect_k) and torch.equal(v4[rows[rid], :bs], expect_v)
        pos += qn
    changed = (k4[trash, :bs] != before_k[2]).any(-1).any(-1)
    assert changed[0] and not changed[1:].any()
    assert torch.equal(v4[trash, 1:bs], before_v[2][1:])
    # The padded tokens' outputs are zeros (they belong to no sequence); the real ones equal an
    # unpadded round's.
    assert torch.equal(out[0, real_t:], torch.zeros_like(out[0, real_t:]))
    for rid, (past, qn) in entries.items():
        cache.extend_read_and_write_indices(rid, past, qn, None, [[]])
    plain = vt_graphs.prepare_round(cache, {"input_ids": torch.zeros(1, real_t, dtype=torch.long),
                                            "cu_seq_lens_q": cu_q[:3]}, False, None)
    assert plain.meta.n == 2 and plain.meta.max_q == 4 and plain.meta.max_k == 5
    out2, _ = vt_attention.paged_attention(_Layer(), q[:, :, :real_t], key[:, :, :real_t], value[:, :, :real_t],
                                           scaling=d ** -0.5, cache=cache, write_index=[write_index[:real_t]])
    assert torch.allclose(out2[0], out[0, :real_t], atol=1e-6)


def test_a_round_naming_the_trash_row_or_too_many_sequences_is_refused():
    cache = _direct_cache()
    buffers = cache.round_buffers
    real = cache.trash_row + 1  # a row a request could hold
    with pytest.raises(vmem.VmemError, match="bad round entry"):
        buffers.fill([(cache.trash_row, 0, 1)], sequences=1, tokens=1, padded=False)
    with pytest.raises(vmem.VmemError, match="sequences"):
        buffers.fill([(real, 0, 1)], sequences=buffers.slots + 1, tokens=buffers.slots + 1, padded=True)
    with pytest.raises(vmem.VmemError, match="query tokens"):
        buffers.fill([(real, 0, 3)], sequences=1, tokens=2, padded=True)
    with pytest.raises(vmem.VmemError, match="max_seqlen_k"):
        buffers.fill([(real, 0, 300)], sequences=1, tokens=300, padded=True, bucket_k=256)
    meta = buffers.fill([(real, 0, 3)], sequences=2, tokens=8, padded=True, bucket_k=1024, seqlen_k="context")
    assert meta.max_k == cache.max_context and meta.max_q == 8
    assert buffers.fills == 1  # refused rounds wrote nothing


def test_no_page_is_mapped_or_unmapped_inside_the_forward(monkeypatch):
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    inside = []
    events = {"steps": 0, "frees": 0, "forwards": 0}
    real_flush, real_free = VmemCBCache.flush, VmemCBCache.free_blocks

    def flush(self):
        assert not inside, "pages mapped inside the forward"
        if self.table.dirty:
            events["steps"] += 1
        real_flush(self)

    def free_blocks(self, *a, **k):
        assert not inside, "pages unmapped inside the forward"
        events["frees"] += 1
        return real_free(self, *a, **k)

    monkeypatch.setattr(VmemCBCache, "flush", flush)
    monkeypatch.setattr(vt.cache_class(), "free_blocks", free_blocks)

    def pre(*_):
        events["forwards"] += 1
        inside.append(1)

    def post(*_):
        inside.pop()  # returns None: the output stays the model's

    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        with forced_padding():
            # Requests join mid-run: rounds map pages for newcomers and growth while others decode.
            run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(PAD),
                               stagger=[0, 0, 2, 3, 5, 6])
    finally:
        for hk in hooks:
            hk.remove()
    assert events["forwards"] > NEW and events["steps"] >= 3 and events["frees"] >= len(prompts), events
    assert all(len(t) == NEW for t in _tokens(run))


def _cb(**kw):
    return transformers.ContinuousBatchingConfig(max_batch_tokens=64, **kw)


GRAPH_CONFIGS = {"graphs": dict(use_cuda_graph=True), "varlen graphs": dict(use_cuda_graph=(True, False)),
                 "async": dict(use_async_batching=True), "graphs + async": dict(use_cuda_graph=True,
                                                                                use_async_batching=True)}


@pytest.mark.parametrize("config", sorted(GRAPH_CONFIGS))
@pytest.mark.parametrize("kernel", ["fa", "flashinfer", "flex"])
def test_graphs_and_async_are_taken_by_fa_and_flashinfer_and_refused_for_flex_saying_why(kernel, config,
                                                                                         monkeypatch):
    # Flex rebuilds its BlockMask on the host inside the forward: a replay would read the captured
    # round's. FA and FlashInfer read the round from buffers written before the forward. A stub
    # module stands in for FlashInfer (no kernel runs here).
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    cfg = h.make_config("llama-gqa")
    build = vt.cache_class()
    options = vt.Options(**dict(OPTS, kernel=kernel))
    cb = _cb(**GRAPH_CONFIGS[config])
    if kernel == "flex":
        with pytest.raises(vmem.InvalidArgument, match="kernel='flex'.*BlockMask.*kernel='flashinfer'"):
            build(cfg, cb, "cpu", dtype=torch.float32, options=options)
        return
    cache = build(cfg, cb, "cpu", dtype=torch.float32, options=options)
    assert cache.kernel == kernel and cache.round_buffers.slots == cb.max_requests_per_batch
    assert cache.round_buffers.capacity >= cache.max_batch_tokens  # a decode round, one sequence a token
    if kernel == "flashinfer":
        # its wrappers (and their workspace) wait for the first round planned, padded or not
        assert cache.read.wrappers is None and cache.read.trash_row == cache.trash_row
        assert cache.read.trash_tokens == cache.block_size


def test_a_padded_decode_round_is_one_sequence_per_token_with_max_q_1():
    """FA2's decode path (GQA groups folded into the query rows) needs ``max_seqlen_q == 1`` and as
    many sequences as query tokens: a padded decode round is passed that way, the real entries
    as unpadded, every padded token a sequence that reads nothing."""
    cache = _direct_cache()
    buffers, mc, trash = cache.round_buffers, cache.max_context, cache.trash_row
    rows = [trash + 1, trash + 2, trash + 3]
    entries = [(rows[0], 9, 1), (rows[1], 0, 1), (rows[2], 30, 1)]
    meta = buffers.fill(entries, sequences=4, tokens=16, padded=True, bucket_k=1024, decode=True)
    assert meta.decode and meta.max_q == 1 and meta.n == 16 and meta.real == 3 and meta.total_q == 16
    n = meta.n
    host = meta.host.tolist()
    assert host[: n + 1] == list(range(17))  # one query a sequence, padded tokens included
    assert host[n + 1: n + 4] == [r * mc for r in rows] and set(host[n + 4: 2 * n + 1]) == {trash * mc}
    assert host[2 * n + 2: 2 * n + 5] == [10, 1, 31] and host[2 * n + 5:] == [0] * 13
    assert meta.cu_q.data_ptr() == buffers.buffer.data_ptr() and meta.cu_q.numel() == 17
    # The same round unpadded, or mixed, keeps the engine's sequences and max_q.
    plain = buffers.fill(entries, sequences=3, tokens=3, padded=False, decode=True)
    assert not plain.decode and plain.n == 3 and plain.max_q == 1
    with pytest.raises(vmem.VmemError, match="one query token"):
        buffers.fill([(rows[0], 0, 2)], sequences=1, tokens=16, padded=True, bucket_k=1024, decode=True)
    with pytest.raises(vmem.VmemError, match="one query token"):
        buffers.fill(entries, sequences=3, tokens=buffers.capacity + 1, padded=True, bucket_k=1024, decode=True)
    # FA's reference over the decode meta: the real tokens as unpadded, padded ones zeros.
    hq, hkv, d = cache.config.num_attention_heads, cache.num_key_value_heads, cache.head_dim
    k = torch.full((cache.rows * mc, hkv, d), float("nan"))  # plain tensors shaped as the flat views
    v = torch.full((cache.rows * mc, hkv, d), float("nan"))
    for r, p, _ in entries:
        k[r * mc: r * mc + p + 1].normal_()
        v[r * mc: r * mc + p + 1].normal_()
    q = torch.randn(16, hq, d)
    padded = vk_fa.fa_varlen_reference(q, k, v, meta, 0.1)
    unpadded = vk_fa.fa_varlen_reference(q[:3], k, v, plain, 0.1)
    assert torch.equal(padded[:3], unpadded) and torch.equal(padded[3:], torch.zeros(13, hq, d))


def test_the_graph_key_carries_a_vmem_rounds_kind_and_the_patch_installs_it():
    class Io:
        def __init__(self, cache):
            self.cache = cache

        def key(self):
            return (64, 512, 1024)

    def vmem_cache_with(**fields):  # a vmem cache (its type is what the hook recognises), these fields only
        cache = object.__new__(VmemCBCache)
        cache.__dict__.update(fields)
        return cache

    hooked = vt_hooks.graph_key(Io.key)
    vmem_cache = vmem_cache_with(round_kind="decode", options=vt.Options(graph_seqlen_k="bucket"))
    # (padded tokens, padded KV read, max_seqlen_k): the KV read (512), which vmem never reads, is
    # dropped; the kind is added
    assert hooked(Io(vmem_cache)) == (64, 1024, "decode")
    vmem_cache.options = vt.Options()  # the default, "context": the kernel gets the row length
    assert hooked(Io(vmem_cache)) == (64, "decode")
    vmem_cache.round_kind = None  # an unpadded round: the engine's key
    assert hooked(Io(vmem_cache)) == (64, 512, 1024)
    assert hooked(Io(object())) == (64, 512, 1024)  # any other cache: the engine's key
    other = type("C", (), {"round_kind": "decode", "options": vt.Options()})()  # vmem's fields, not its type
    assert hooked(Io(other)) == (64, 512, 1024)
    fast = Io(vmem_cache_with(round_kind="decode", options=vt.Options()))
    fast.use_block_table, fast.key = True, lambda: (64,)
    assert vt_hooks.graph_key(lambda io: io.key())(fast) == (64, "decode")  # a fast path's key
    from transformers.generation.continuous_batching import input_outputs as cb_io

    vt.uninstall()
    plain = cb_io.ContinuousBatchingIOs.__dict__["_get_graph_key"]
    vt.install(**OPTS)
    assert cb_io.ContinuousBatchingIOs.__dict__["_get_graph_key"] is not plain
    vt.uninstall()
    assert cb_io.ContinuousBatchingIOs.__dict__["_get_graph_key"] is plain


def test_padded_rounds_set_their_kind_decode_or_varlen():
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    padded, plain = [], []
    kinds = padded
    real = vt_graphs.prepare_round

    def prepare(cache, *a, **k):
        rnd = real(cache, *a, **k)
        kinds.append((cache.round_kind, rnd.meta.decode, rnd.meta.max_q, all(e[2] == 1 for e in rnd.entries)))
        return rnd

    vt_graphs.prepare_round = prepare
    try:
        with forced_padding():
            _serve(model, vt.VMEM_ATTENTION, prompts)
        kinds = plain
        _serve(model, vt.VMEM_ATTENTION, prompts)
    finally:
        vt_graphs.prepare_round = real
    assert padded and plain
    assert {k for k, _, _, _ in padded} == {"decode", "varlen"}
    for kind, decode, max_q, all_one in padded:
        assert (kind == "decode") == decode == all_one and (max_q == 1) == decode
    assert {k for k, _, _, _ in plain} == {None} and not any(d for _, d, _, _ in plain)


@pytest.mark.parametrize("bad", ["Bucket", "", 1, None, True])
def test_a_bad_graph_seqlen_k_is_refused(bad):
    with pytest.raises(vmem.InvalidArgument, match="graph_seqlen_k"):
        vt.Options(graph_seqlen_k=bad)


@pytest.mark.parametrize("bad", [0, -1, "512", True, 1.5, 2**31])
def test_a_bad_graph_max_tokens_is_refused(bad):
    with pytest.raises(vmem.InvalidArgument, match="graph_max_tokens"):
        vt.Options(graph_max_tokens=bad)
    assert vt.Options(graph_max_tokens=64).graph_max_tokens == 64 and vt.Options().graph_max_tokens == 512
    assert vt.Options(graph_max_tokens=None).graph_max_tokens is None  # every padded round graphed


def test_the_bench_graph_contenders_pass_the_engines_graph_switch():
    import types

    from harness import contenders as ct

    args = types.SimpleNamespace(max_requests=8, max_context=1024, page_size="2M")
    budget = {"kv_bytes": 1 << 30, "token_bytes": 4096}
    for name in ("vmem-token-major-graphs-async-compile", ct.engine_best(), "fi-paged-graphs-async-512-compile"):
        kw, opts = ct.contender_config(None, ct.spec(name), args, budget)
        assert kw["use_cuda_graph"] is True and kw["use_async_batching"] is True, name
        assert kw["varlen_compile_config"].fullgraph is False, name
        assert opts.get("kernel", "fa") == "fa"
    kw, _ = ct.contender_config(None, ct.spec("vmem-per-layer"), args, budget)
    assert "use_cuda_graph" not in kw  # the harness's default (off) stays
    # FlashInfer under graphs (optional: FlashInfer), with async batching and the compiled forward; both versions.
    name = "vmem-token-major-fi-graphs-async-compile"
    spec = ct.spec(name)
    kw, opts = ct.contender_config(None, spec, args, budget)
    assert kw["use_cuda_graph"] is True and opts["kernel"] == "flashinfer" and spec["optional"], name
    assert kw["use_async_batching"] is True and name in ct.offered()
    assert name not in ct.defaults({n: ct.spec(n) for n in ct.offered()})  # run only when named
    assert "vmem-token-major-fi" not in ct.defaults({n: ct.spec(n) for n in ct.offered()})
    # FA + graphs + async: a default contender (no optional dependency)
    assert not ct.spec("vmem-token-major-graphs-async-compile").get("optional")
