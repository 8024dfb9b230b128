"""``background_unmap`` in transformers' continuous batching, on the CPU (host backend): a finished
request's pages are unmapped by vmem's unmapping thread, not the engine's; they count as free at
once, the row goes back into use once they are back (rows finished longest ago first), logits and
greedy tokens equal those with the option off, and the option is off in a pool. The GPU side (the
engine's thread no longer waits for the round in flight when a request ends under async batching)
is measured by the serving suite (docs/serving.md)."""

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


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_background_unmap_takes_a_bool_or_none_only(bad):
    with pytest.raises(vmem.InvalidArgument, match="background_unmap"):
        vt.Options(background_unmap=bad)


def test_background_unmap_is_on_outside_a_pool_off_in_one_and_refused_with_one():
    assert vt.Options().unmaps_in_background is True
    assert vt.Options(background_unmap=False).unmaps_in_background is False
    assert vt.Options(pool="tenant-a").unmaps_in_background is False
    # The default follows the pool through replace(): it is not fixed when the options are made.
    assert vt.Options().replace(pool="tenant-a").unmaps_in_background is False
    with pytest.raises(vmem.InvalidArgument, match="pool"):
        vt.Options(background_unmap=True, pool="tenant-a")
    with pytest.raises(vmem.InvalidArgument, match="pool"):
        vt.Options(background_unmap=True).replace(pool="tenant-a")


def _cache(**kw):
    return eng.tiny_cache(dict(OPTS, **kw))


def test_a_finished_requests_pages_count_as_free_at_once_and_its_row_is_used_last():
    cache = _cache(memory=str(5 * BLOCK), max_requests=3)
    assert cache.kv.config()["background_unmap"] is True
    assert cache.num_blocks == 4
    assert cache.allocate_blocks(3, "a", 0) == 3 and cache.allocate_blocks(1, "b", 0) == 1
    cache.flush()
    row_a = cache.table.get("a").index
    assert cache.get_num_free_blocks() == 0
    cache.free_blocks("a")
    assert cache.get_num_free_blocks() == 3, "the pages being unmapped count as free"
    assert cache.allocate_blocks(3, "c", 0) == 3
    assert cache.table.get("c").index != row_a, "a row never used goes before a's"
    cache.flush()  # needs a's pages: waits for them if they are not back yet
    cache.kv.wait_unmapped()
    assert cache.kv.request_pages(row_a) == [0, 0, 0, 0]
    assert cache.get_num_free_blocks() == 0
    for rid in ("b", "c"):
        cache.free_blocks(rid)
    cache.kv.wait_unmapped()
    assert cache.get_num_free_blocks() == 4
    assert cache.usage()["mapped_bytes"] == cache.trash_bytes()


def _serve(background, lengths, new, memory, stagger):
    return eng.serve_tiny(dict(OPTS, memory=memory, background_unmap=background), lengths, new, stagger)


def test_under_memory_pressure_rows_are_reused_and_outputs_match_the_option_off():
    """8 requests through 4 rows and 7 blocks of 256 tokens: rows are reused while their pages may
    still be being unmapped, the engine preempts; logits match DynamicCache and the tokens equal
    the run with the option off; afterwards every block is free and only the trash row mapped."""
    lengths, new = [200, 220, 210, 200, 90, 10, 230, 60], 80
    stagger = [0, 0, 0, 0, 2, 2, 4, 4]
    model, ours = _serve(True, lengths, new, str(8 * BLOCK), stagger)
    _, theirs = _serve(False, lengths, new, str(8 * BLOCK), stagger)
    eng.assert_same_under_preemption(ours, theirs, model, new, TOL)
    cache = ours["cache"]
    assert cache.kv.config()["background_unmap"] and not theirs["cache"].kv.config()["background_unmap"]
    cache.kv.wait_unmapped()
    assert cache.usage()["rows_in_use"] == 0 and cache.get_num_free_blocks() == cache.num_blocks
    assert cache.usage()["mapped_bytes"] == cache.trash_bytes()


def test_a_finished_requests_pages_are_mapped_again_before_its_row_is_unmapped():
    """``reuse_while_unmapping`` (the default): a round that needs a finished request's pages maps
    them at once, a second mapping beside the finished row's, instead of waiting for the
    unmapping thread; with it off the same round waits until they are back."""
    for reuse in (True, False):
        cache = _cache(memory=str(5 * BLOCK), max_requests=3, reuse_while_unmapping=reuse)
        assert cache.kv.config()["reuse_while_unmapping"] is reuse
        assert cache.allocate_blocks(4, "a", 0) == 4
        cache.flush()
        row_a = cache.table.get("a").index
        a_pages = cache.kv.request_pages(row_a)
        assert sum(a_pages) > 0
        cache.free_blocks("a")
        if reuse:  # a's pages are the pool's now, and b's round maps them without a wait
            assert cache.kv.unmapping_bytes() == 0
        assert cache.allocate_blocks(4, "b", 0) == 4
        cache.flush()
        if reuse:
            assert cache.kv.step_waits() == (0, 0)
        cache.kv.wait_unmapped()
        assert cache.kv.request_pages(row_a) == [0, 0, 0, 0]
        assert cache.kv.request_pages(cache.table.get("b").index) == a_pages
        cache.free_blocks("b")
        cache.kv.wait_unmapped()
        assert cache.get_num_free_blocks() == cache.num_blocks
        assert cache.usage()["mapped_bytes"] == cache.trash_bytes()


def test_under_memory_pressure_reuse_while_unmapping_changes_no_token():
    lengths, new = [200, 220, 210, 200, 90, 10, 230, 60], 80
    stagger = [0, 0, 0, 0, 2, 2, 4, 4]
    memory = str(8 * BLOCK)
    model, ours = eng.serve_tiny(dict(OPTS, memory=memory), lengths, new, stagger)
    _, theirs = eng.serve_tiny(dict(OPTS, memory=memory, reuse_while_unmapping=False), lengths, new, stagger)
    assert ours["cache"].kv.config()["reuse_while_unmapping"] is True
    assert theirs["cache"].kv.config()["reuse_while_unmapping"] is False
    eng.assert_same_under_preemption(ours, theirs, model, new, TOL)
    cache = ours["cache"]
    cache.kv.wait_unmapped()
    assert cache.usage()["rows_in_use"] == 0 and cache.get_num_free_blocks() == cache.num_blocks
    assert cache.usage()["mapped_bytes"] == cache.trash_bytes()
