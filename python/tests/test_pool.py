"""vmem.pool from Python on the host backend (no torch): the ledger's API, a KVCache joining a
pool, shrinking to a lowered limit, sleeping and waking."""

import os

import numpy as np
import pytest

import vmem
from vmem import pool

PAGE = 64 << 10
SHAPE = dict(layers=2, kv_heads=2, head_dim=64, dtype="fp16", max_batch=4, max_context=1024, page_size="64K",
             device="cpu", overlap=False, eager_tokens=0)
FULL = 16 * PAGE  # one request at 1,024 tokens: 4 pages in each of 4 buffers


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "pool")


@pytest.fixture
def p(path):
    return pool.create(path, size="64M", slots=8)


def _cache(path, name, limit=None, **kw):
    return vmem.KVCache(**dict(SHAPE, **kw), pool=pool.Join(name, limit=limit, ledger=path))


# -- the ledger ------------------------------------------------------------------------------------
def test_create_open_status_and_set_limit_return_typed_values(p, path):
    assert (p.total, p.slots, p.default_limit, p.path) == (64 << 20, 8, 64 << 20, path)
    st = p.status()
    assert isinstance(st, pool.PoolStatus) and st.used == 0 and st.free == 64 << 20 and st.tenants == ()
    kv = _cache(path, "llama", limit="1M")
    t = pool.open(path).status().tenant("llama")
    assert isinstance(t, pool.TenantStatus)
    assert (t.pid, t.limit, t.usage, t.over_limit, t.revision) == (os.getpid(), 1 << 20, 0, 0, 1)
    ch = p.set_limit("llama", "50%")
    assert ch == pool.LimitChange(name="llama", old=1 << 20, new=32 << 20, usage=0, revision=2)
    assert p.set_limit("llama", 3 << 20).new == 3 << 20
    kv.close()
    assert p.status().tenants == ()


def test_refusals_are_pool_errors_with_the_clis_messages(p, path):
    with pytest.raises(vmem.PoolError, match=f"no pool ledger at {path}x: create one with `vmem pool create --ledger {path}x`"):
        pool.open(path + "x")
    with pytest.raises(vmem.PoolError, match="already exists"):
        pool.create(path, size="1G")
    with pytest.raises(vmem.PoolError, match=r"unknown tenant \"nobody\" \(live tenants: none\)"):
        p.set_limit("nobody", "1M")
    for bad in ("0", "0%", "101%", "-1G", "lots", 0, -5, True, 1.5, None):
        with pytest.raises(vmem.PoolError):
            p.set_limit("x", bad)
    for kw in (dict(size="0"), dict(size=-1), dict(size=True), dict(size="1G", slots=0), dict(size="1G", slots=2000),
               dict(size="1G", slots="4"), dict(size="1G", default_limit="200%"), dict(size="1G", group="no-such-group-xyz"),
               dict(size="1G", device=-1), dict(reserve="1P", backend="host")):
        with pytest.raises(vmem.PoolError):
            pool.create(path + "-new", **kw)
    assert not os.path.exists(path + "-new")
    with pytest.raises(vmem.PoolError, match="tenant must be a name"):
        pool.Join("")
    with pytest.raises(vmem.PoolError):
        pool.Join("a", limit=False)
    assert issubclass(vmem.PoolError, vmem.VmemError)


def test_a_second_tenant_of_the_same_name_is_refused_and_the_default_ledger_is_vmem_pool(p, path, monkeypatch):
    kv = _cache(path, "a")
    with pytest.raises(vmem.PoolError, match=r"tenant \"a\" is already in the pool"):
        _cache(path, "a")
    monkeypatch.setenv("VMEM_POOL", path)
    assert pool.default_ledger() == path and pool.Join("b").ledger == path
    kv2 = vmem.KVCache(**SHAPE, pool="b")
    assert {t.name for t in pool.open().status().tenants} == {"a", "b"}
    kv.close()
    kv2.close()


# -- a cache in the pool ---------------------------------------------------------------------------
def test_pages_are_charged_and_a_page_over_the_limit_is_out_of_memory(p, path):
    kv = _cache(path, "a", limit=2 * FULL)  # 2 requests at full length
    rs = [kv.alloc() for _ in range(3)]
    kv.step({rs[0]: 1024, rs[1]: 1024})
    assert p.status().used == 2 * FULL == kv.tenant().usage
    with pytest.raises(vmem.OutOfMemory):
        kv.step({rs[0]: 1024, rs[1]: 1024, rs[2]: 1})
    assert kv.tenant().usage == 2 * FULL, "a refused step charges nothing"
    p.set_limit("a", 3 * FULL)  # raised: it grows at once
    kv.step({rs[0]: 1024, rs[1]: 1024, rs[2]: 1024})
    kv.close()
    assert p.status().used == 0


def test_shrink_to_limit_gives_back_prefix_blocks_then_idle_pages_and_says_what_is_left(p, path):
    kv = _cache(path, "a", prefix_cache="4M")
    tokens = list(range(1024))
    a = kv.alloc()
    kv.step({a: 1024})
    kv.publish_prefix(a, tokens)
    kv.free(a)  # its blocks stay cached (4 buffers x 4 pages)
    b = kv.alloc()
    kv.step({b: 512})  # 2 pages a buffer, from the pool (idle pages or new ones)
    held = kv.tenant().usage
    assert kv.prefix_stats()["unmapped_bytes"] > 0
    assert kv.shrink_to_limit() == 0, "within its limit: nothing to do"
    assert kv.tenant().usage == held
    p.set_limit("a", held - PAGE)  # one page less
    assert kv.over_limit() == PAGE
    assert kv.shrink_to_limit() == 0
    u = kv.tenant()
    assert u.usage <= u.limit and kv.prefix_stats()["evicted_blocks"] > 0
    assert kv.request_pages(b) == [2] * 4, "the live request keeps its pages"
    p.set_limit("a", 4 * PAGE)  # below what b needs (8 pages): the owner must free it
    assert kv.shrink_to_limit() == 4 * PAGE
    assert kv.request_pages(b) == [2] * 4
    kv.free(b)
    assert kv.shrink_to_limit() == 0 and kv.tenant().usage <= 4 * PAGE
    kv.close()


def test_shrink_without_a_pool_releases_what_no_request_needs():
    kv = vmem.KVCache(**SHAPE)
    r = kv.alloc()
    kv.step({r: 1024})
    kv.free(r)  # deferred: its pages stay mapped
    assert kv.over_limit() == 0 and kv.tenant() is None and kv.shrink_to_limit() == 0
    got = kv.shrink()
    assert got == {"prefix": 0, "idle": 0, "requests": 16 * PAGE, "total": 16 * PAGE}
    assert kv.usage()["physical_bytes"] == 0
    for bad in (-1, True, "x", 1.5):
        with pytest.raises(vmem.InvalidArgument):
            kv.shrink(bad)
    kv.close()


# -- sleep and wake --------------------------------------------------------------------------------
def test_sleep_releases_every_page_to_the_pool_keeps_addresses_and_wake_serves_the_same(p, path):
    kv = _cache(path, "a", prefix_cache="1M")
    k0, _ = kv.layer(0)
    addr = k0.data_ptr
    r = kv.alloc()
    kv.step({r: 300})
    K = np.from_dlpack(k0)
    K[r, :300] = 1.5
    first = float(K[r, :300].sum())
    with pytest.raises(vmem.InvalidArgument, match="1 request"):
        kv.sleep()
    assert kv.tenant().usage > 0 and not kv.asleep
    with pytest.raises(vmem.InvalidArgument):
        kv.sleep(discard="yes")
    released = kv.sleep(discard=True)
    assert released > 0 and kv.asleep
    assert kv.usage()["physical_bytes"] == 0 and kv.usage()["mapped_bytes"] == 0
    assert kv.tenant().usage == 0 and p.status().used == 0
    assert float(K[r, :300].sum()) == 0.0  # the zero page: zeros, never a fault
    for call in (lambda: kv.step({r: 10}), kv.alloc, lambda: kv.reserve_physical("1M"),
                 lambda: kv.adopt_prefix(r, [1, 2])):
        with pytest.raises(vmem.Asleep, match="call wake"):
            call()
    assert kv.sleep() == 0  # asleep already
    kv.wake()
    assert not kv.asleep and kv.layer(0)[0].data_ptr == addr
    kv.step({r: 300})  # the discarded request, at length 0, maps again
    K[r, :300] = 1.5
    assert float(K[r, :300].sum()) == first
    kv.free(r)
    kv.close()
