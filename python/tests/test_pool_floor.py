"""Guaranteed floors from Python (host backend, no torch): Pool.set_floor and Join(floor=), the
room an idle tenant's floor keeps from a busy one's cache, what the engine's budget reads of it,
and bad floors refused with nothing changed."""

import pytest

import vmem
from vmem import pool

from test_pool import FULL, PAGE, SHAPE, path  # noqa: F401  (the shapes, and the ledger path fixture)


def _cache(path, name, **join):
    return vmem.KVCache(**SHAPE, pool=pool.Join(name, ledger=path, **join))


def test_an_idle_tenants_floor_keeps_room_from_a_busy_ones_cache(path):
    p = pool.create(path, size=2 * FULL, slots=4)
    idle = _cache(path, "idle", floor=FULL)  # holds nothing: the pool keeps a full request's room
    busy = _cache(path, "busy")
    assert idle.tenant().floor == FULL and busy.tenant().floor == 0
    assert busy.tenant().pool_room == FULL and idle.tenant().pool_room == 2 * FULL
    a = busy.alloc()
    busy.step({a: 1024})  # one full request fits beside the floor
    b = busy.alloc()
    with pytest.raises(vmem.OutOfMemory):
        busy.step({b: 64})  # a page more would eat into the idle tenant's floor
    st = p.status()
    assert st.tenant("idle").floor == FULL and st.used == FULL
    c = idle.alloc()
    idle.step({c: 1024})  # the idle tenant gets its floor at once
    assert p.status().used == 2 * FULL
    ch = p.set_floor("idle", 0)
    assert (ch.old, ch.new, ch.floors) == (FULL, 0, 0)
    idle.free(c)
    idle.shrink()
    busy.step({b: 64})  # no floor: the busy tenant takes the room given back
    busy.close()
    idle.close()


def test_the_engines_budget_leaves_the_other_tenants_floors(path):
    """Tenant.budget_blocks counts the room another tenant's floor keeps as taken."""
    import threading

    pytest.importorskip("torch")
    from vmem.kernels.rows import RowTable
    from vmem.transformers.tenancy import Tenant

    p = pool.create(path, size=32 * PAGE, slots=4)
    kv = _cache(path, "engine")
    tenant = Tenant(kv, RowTable(2, 256), threading.Lock(), blocks=1000, block_bytes=PAGE, idle_after=None)
    assert tenant.budget_blocks() == 31
    other = _cache(path, "other", floor=8 * PAGE)
    assert tenant.budget_blocks() == 23
    p.set_floor("other", "50%")
    assert tenant.budget_blocks() == 15
    other.close()
    kv.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, None, [], "-1G", "101%", "abc", "1.5%",
                                 "\u00b2%", "\u0663%", 1 << 64])  # superscript two, Arabic-Indic three, past u64
def test_a_bad_floor_is_refused_where_it_is_given(path, bad):
    p = pool.create(path, size="64M", slots=4)
    with pytest.raises(vmem.PoolError, match="invalid pool setting"):
        pool.Join("a", floor=bad) if bad is not None else p.set_floor("a", bad)
    kv = _cache(path, "a")
    before = open(path, "rb").read()
    with pytest.raises(vmem.PoolError, match="invalid pool setting"):
        p.set_floor("a", bad)
    assert open(path, "rb").read() == before
    kv.close()


def test_floors_over_the_limit_or_past_the_total_are_refused_and_change_nothing(path):
    p = pool.create(path, size="64M", slots=4)
    a = _cache(path, "a", limit="32M", floor="16M")
    before = open(path, "rb").read()
    with pytest.raises(vmem.PoolError, match="above its limit"):
        p.set_floor("a", "48M")
    with pytest.raises(vmem.PoolError, match="below its floor"):
        p.set_limit("a", "8M")
    with pytest.raises(vmem.PoolError, match="floors sum to 80M"):
        _cache(path, "b", floor="64M")
    with pytest.raises(vmem.PoolError, match="unknown tenant"):
        p.set_floor("b", "1M")
    assert open(path, "rb").read() == before
    assert [t.name for t in p.status().tenants] == ["a"]
    b = _cache(path, "b", floor="75%")
    assert p.status().tenant("b").floor == 48 << 20
    b.close()
    a.close()


@pytest.mark.parametrize("limit,floor", [("1M", "2M"), (1 << 20, "1025K"), ("10%", "20%"), ("1M", 1 << 21)])
def test_a_join_with_its_floor_above_its_limit_is_refused_when_made(limit, floor):
    """Both in bytes or both shares: the Join itself knows the floor is above the limit (it was
    refused only when a cache joined with it)."""
    with pytest.raises(vmem.PoolError, match="above its limit"):
        pool.Join("a", limit=limit, floor=floor)
    assert pool.Join("a", limit="2M", floor="2M").floor == "2M"  # floor == limit is allowed
    assert pool.Join("a", limit="10%", floor="64M").floor == "64M"  # a share against a size: the pool decides
