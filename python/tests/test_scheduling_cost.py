"""The host cost of scheduling with vmem's cache: the rows' growth kept as rows change (not
summed over every row each time it is asked), and the free blocks read from vmem once per
scheduling pass until the cache changes what vmem maps (vmem/transformers/passmemo.py).

The engine's scheduler asks for the free blocks before every candidate of every round, each
waiting request included: in the serving suite's Llama-3-8B run at a tenth of the working set
(``serving_suite.py --schedule``) 218,628 reads of vmem's mapped pages in 1,311 rounds, 0.7 ms
of the host's time a round. Needs torch (vmem.kernels imports it); the last test a transformers
vmem serves too (skipped otherwise, saying why)."""

import random
import threading

import pytest

pytest.importorskip("torch", reason="torch is not installed (vmem.kernels needs it)")

from vmem.kernels.rows import RowTable  # noqa: E402
from vmem.transformers.passmemo import MappedBlocks  # noqa: E402


def _brute_growth(table: RowTable) -> int | None:
    rows = [table.get(r) for r in table.request_ids()]
    if any(r.final_blocks is None for r in rows):
        return None
    return sum(max(0, r.final_blocks - r.blocks) for r in rows)


def test_the_rows_growth_follows_every_change_as_a_sum_over_the_rows_would():
    rng = random.Random(7)
    table = RowTable(rows=64, block_size=16)
    held: dict[str, int] = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.25 and len(held) < 60:
            rid = f"r{step}"
            index = next(i for i in range(64) if i not in held.values())
            table.admit(rid, index)
            held[rid] = index
        elif op < 0.45 and held:
            table.set_final(rng.choice(list(held)), rng.randint(0, 40))
        elif op < 0.75 and held:
            table.grow(table.get(rng.choice(list(held))), rng.randint(1, 5))
        elif op < 0.85 and held:
            table.adopt(table.get(rng.choice(list(held))), 16 * rng.randint(1, 3))
        elif op < 0.95 and held:
            rid = rng.choice(list(held))
            assert table.release(rid) == held.pop(rid)
        else:
            list(table.mapped())
        assert table.growth() == _brute_growth(table), step
    table.set_final("nobody", 3)  # a request holding no row: nothing
    assert table.growth() == _brute_growth(table)


def test_a_rows_end_once_set_stays():
    table = RowTable(rows=4, block_size=16)
    table.admit("a", 0)
    assert table.growth() is None
    table.set_final("a", 5)
    table.set_final("a", 50)
    assert table.get("a").final_blocks == 5 and table.growth() == 5
    table.grow(table.get("a"), 7)  # past its end (the engine asks a block ahead): no negative growth
    assert table.growth() == 0
    table.release("a")
    assert table.growth() == 0 and len(table) == 0


def test_the_mapped_blocks_are_read_once_a_pass_until_changed_and_every_time_outside():
    value = [10]
    memo = MappedBlocks(lambda: value[0])
    assert [memo.get(), memo.get()] == [10, 10] and memo.reads == 2  # outside a pass: every call reads
    with memo.scheduling():
        assert memo.get() == 10
        value[0] = 11
        assert memo.get() == 10 and memo.reads == 3  # kept: nothing told it
        memo.changed()
        assert memo.get() == 11 and memo.reads == 4
        with memo.scheduling():  # nested: the outer pass rules
            assert memo.get() == 11 and memo.reads == 4
        assert memo.get() == 11 and memo.reads == 4
        seen = []
        t = threading.Thread(target=lambda: seen.append(memo.get()))
        value[0] = 12
        t.start()
        t.join()
        assert seen == [12] and memo.reads == 5  # another thread reads vmem, and keeps nothing
        assert memo.get() == 11
    assert memo.get() == 12 and memo.reads == 6  # the pass is over


def test_a_change_told_while_a_read_is_under_way_keeps_that_read_from_being_kept():
    """Another thread's change (a wake, a sleep) can land while the pass's thread reads vmem: that
    read may predate the change, so it is returned but not kept."""
    value = [5]
    memo = MappedBlocks(lambda: None)

    def read() -> int:
        seen = value[0]
        value[0] = 6
        memo.changed()  # told while this read is under way
        return seen

    memo._read = read
    with memo.scheduling():
        assert memo.get() == 5
        memo._read = lambda: value[0]
        assert memo.get() == 6 and memo.reads == 2


def test_a_request_holding_a_row_is_not_given_a_second():
    from vmem import VmemError

    table = RowTable(rows=4, block_size=16)
    table.grow(table.admit("a", 0), 3)
    table.set_final("a", 5)
    with pytest.raises(VmemError, match="already holds row 0"):
        table.admit("a", 1)
    assert table.get("a").index == 0 and table.growth() == 2 and table.used_blocks == 3


def test_a_pass_that_raises_keeps_nothing():
    value = [1]
    memo = MappedBlocks(lambda: value[0])
    with pytest.raises(RuntimeError), memo.scheduling():
        memo.get()
        raise RuntimeError("the engine's prepare failed")
    value[0] = 2
    assert memo.get() == 2


def test_within_a_pass_the_cache_reads_vmem_again_after_every_change():
    """The cache alone, inside a pass: allocating blocks (no mapping yet) keeps the read; a step,
    a freed row and an adopted prefix each make the next free-block count read vmem again, and
    every count equals the one a fresh read gives."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import tf_engine as eng

    eng.skip_unless_served()
    from harness import check as h

    h.fake_cpu_memory()
    cache = eng.tiny_cache({"page_size": "64K", "memory": str(8 * eng.TINY_BLOCK), "max_requests": 4,
                            "max_context": 2048, "prefix_cache": "1M"})
    if not cache.sharing:
        pytest.skip("the free count reads vmem only with sharing on (this version's cache has it off)")

    def fresh() -> int:
        budget = cache.tenant.budget_blocks()
        mapped = cache._whole_blocks(cache.kv.distinct_mapped_bytes(needed_only=cache.options.deferred_reclaim))
        return budget - (mapped - 1) - cache.table.pending_blocks

    with cache.mapped.scheduling():
        reads = cache.mapped.reads
        free = cache.get_num_free_blocks()
        assert cache.get_num_free_blocks() == free == fresh() and cache.mapped.reads == reads + 1
        assert cache.allocate_blocks(2, "a", 0) == 2
        assert cache.get_num_free_blocks() == free - 2 == fresh() and cache.mapped.reads == reads + 1
        cache.flush()  # the step maps a's two blocks
        assert cache.get_num_free_blocks() == fresh() == free - 2 and cache.mapped.reads == reads + 2
        cache.table.get("a").computed = 2 * cache.block_size
        prompt = list(range(3, 3 + 2 * cache.block_size + 5))
        cache.kv.publish_prefix(cache.table.get("a").index, prompt)
        assert cache.search_prefix_match("b", prompt) == 2 * cache.block_size  # b maps a's two blocks
        assert cache.get_num_free_blocks() == fresh()
        cache.free_blocks("a")
        cache.free_blocks("b")
        assert cache.get_num_free_blocks() == fresh()
        # Sleep and wake from another thread (vmem.transformers.sleep/wake) change what vmem maps
        # (the trash row's page goes, then comes back): the pass's next count reads vmem again.
        for change in (cache.tenant.sleep, cache.tenant.wake):
            before = cache.get_num_free_blocks()
            t = threading.Thread(target=change)
            t.start()
            t.join()
            assert cache.get_num_free_blocks() == fresh() != before, change.__name__
