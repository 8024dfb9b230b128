"""``deferred_reclaim=True`` in transformers' continuous batching, on the CPU (host backend): a
finished request's row keeps its pages, the next request given the row writes into them, a step
takes them back when it needs them; the engine's free-block count stays exact (the pages a step
can take back count as free), logits and greedy tokens equal those with the option off, and the
option is refused with a pool. The GPU side (no unmap, so no device synchronization, when a
request ends under async batching) is measured by the serving suite's ``-deferred`` contenders."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI's lint stage has none)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

import vmem
import vmem.transformers as vt

TOL = 1e-4
OPTS, BLOCK = eng.TINY_OPTS, eng.TINY_BLOCK


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_deferred_reclaim_takes_a_bool_only(bad):
    with pytest.raises(vmem.InvalidArgument, match="deferred_reclaim"):
        vt.Options(deferred_reclaim=bad)


def test_deferred_reclaim_is_refused_in_a_pool_saying_why():
    with pytest.raises(vmem.InvalidArgument, match="pool"):
        vt.Options(deferred_reclaim=True, pool="tenant-a")
    assert vt.Options(deferred_reclaim=True).deferred_reclaim is True
    assert vt.Options().deferred_reclaim is False


def _cache(sharing, **kw):
    return eng.tiny_cache(dict(OPTS, deferred_reclaim=True, **kw), sharing)


@pytest.mark.parametrize("sharing", [True, False])
def test_a_freed_rows_pages_stay_count_as_free_and_are_reused_or_taken_back(sharing):
    """5 blocks (4 for requests), 3 rows. a holds 3 blocks and ends: its pages stay mapped and
    count as free. c gets a's row and needs 1 block: nothing is mapped. d needs 3 blocks: the step
    takes 2 of c's row's spare pages back. Free blocks are exact throughout."""
    cache = _cache(sharing, memory=str(5 * BLOCK), max_requests=3)
    assert cache.num_blocks == 4
    assert cache.allocate_blocks(3, "a", 0) == 3 and cache.allocate_blocks(1, "b", 0) == 1
    cache.flush()
    row_a = cache.table.get("a").index
    assert cache.usage()["mapped_bytes"] == 5 * BLOCK and cache.get_num_free_blocks() == 0
    cache.free_blocks("a")
    assert cache.usage()["mapped_bytes"] == 5 * BLOCK, "deferred: a's pages stay mapped"
    assert cache.get_num_free_blocks() == 3, "and count as free"
    assert cache.allocate_blocks(1, "c", 0) == 1
    assert cache.table.get("c").index == row_a, "the row holding the most pages"
    cache.flush()
    assert cache.usage()["mapped_bytes"] == 5 * BLOCK, "c writes a's pages: nothing mapped"
    assert cache.get_num_free_blocks() == 2  # c's row holds 2 blocks past c's length
    assert cache.allocate_blocks(2, "d", 0) == 2 and cache.get_num_free_blocks() == 0
    assert cache.allocate_blocks(1, "e", 0) is None  # no memory: None, not an exception
    cache.flush()  # d's 2 blocks come from c's spare pages
    assert cache.usage()["mapped_bytes"] == 5 * BLOCK
    assert cache.kv.request_pages(row_a) == [1, 1, 1, 1], "c's row keeps c's block"
    for rid in ("b", "c", "d"):
        cache.free_blocks(rid)
    cache.flush()
    assert cache.get_num_free_blocks() == 4


def _serve(deferred, sharing, lengths, new, memory, stagger=None):
    return eng.serve_tiny(dict(OPTS, memory=memory, deferred_reclaim=deferred), lengths, new, stagger, sharing)


@pytest.mark.parametrize("sharing", [True, False])
def test_under_memory_pressure_deferred_rows_are_reused_and_taken_back_and_match(sharing):
    """8 requests through 4 rows and 7 blocks of 256 tokens: rows are reused, the engine preempts
    when all cross into a second block; logits match DynamicCache and the tokens equal the run
    with the option off; afterwards the freed rows' pages are mapped yet every block is free."""
    lengths, new = [200, 220, 210, 200, 90, 10, 230, 60], 80
    model, ours = _serve(True, sharing, lengths, new, str(8 * BLOCK), stagger=[0, 0, 0, 0, 2, 2, 4, 4])
    _, theirs = _serve(False, sharing, lengths, new, str(8 * BLOCK), stagger=[0, 0, 0, 0, 2, 2, 4, 4])
    eng.assert_same_under_preemption(ours, theirs, model, new, TOL)
    cache = ours["cache"]
    assert cache.options.deferred_reclaim and cache.usage()["rows_in_use"] == 0
    assert cache.usage()["mapped_bytes"] > cache.trash_bytes(), "freed rows keep their pages"
    assert cache.get_num_free_blocks() == cache.num_blocks
    assert theirs["cache"].usage()["mapped_bytes"] == theirs["cache"].trash_bytes()


def _conversation(deferred):
    """A system prompt of 3 full token-major blocks (64 tokens each) and 8 tokens more, then 4
    user messages, served one after another (each added once the one before finished), with the
    engine's block sharing on."""
    from harness import check as h

    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    system = h.make_prompts(1, [200], model.config.vocab_size, seed=7)[0]
    prompts = [system + p for p in h.make_prompts(4, [5, 40, 70, 17], model.config.vocab_size, seed=8)]
    with vt.serving(**dict(OPTS, layout="token-major", deferred_reclaim=deferred)):
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 12, stagger=[0, 1, 2, 3],
                           cb_kwargs={"max_batch_tokens": 64, "allow_block_sharing": True})
    return model, run


def test_each_next_request_adopts_the_blocks_its_row_kept_in_place_and_matches(monkeypatch):
    """Deferred reclamation with block sharing: a finished request's row keeps the system prompt's
    cached blocks mapped, each next request is given that row and adopts them where they are (the
    row's pages unchanged by the adoption: no unmap, no map); the tokens equal the run with the
    option off, where each request maps the cached blocks into a row again."""
    from harness import check as h

    adoptions = []
    adopt = vmem.KVCache.adopt_prefix

    def spy(kv, req, tokens):
        before = kv.request_pages(req)
        got = adopt(kv, req, tokens)
        adoptions.append((got, before, kv.request_pages(req)))
        return got

    monkeypatch.setattr(vmem.KVCache, "adopt_prefix", spy)
    model, ours = _conversation(True)
    hits = [a for a in adoptions if a[0]]
    assert [a[0] for a in hits] == [3 * 64] * 3, adoptions
    assert all(before == after and before[0] >= 3 for _, before, after in hits), hits
    adoptions.clear()
    _, theirs = _conversation(False)
    hits = [a for a in adoptions if a[0]]
    assert [a[0] for a in hits] == [3 * 64] * 3, adoptions
    assert all(before == [0] and after == [3] for _, before, after in hits), hits
    cmp = h.compare(ours, model, 12)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    for rid in ours["ids"]:
        assert list(ours["results"][rid].generated_tokens) == list(theirs["results"][rid].generated_tokens)
    cache = ours["cache"]
    assert cache.usage()["prefix_hit_tokens"] == 3 * 3 * 64
    assert cache.get_num_free_blocks() == cache.num_blocks
