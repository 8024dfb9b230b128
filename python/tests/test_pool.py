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


def _tenant_of(kv):
    """The :class:`~vmem.transformers.tenancy.Tenant` a vmem engine cache over ``kv`` owns
    (yield_room reads nothing but ``kv``)."""
    import threading

    from vmem.kernels.rows import RowTable
    from vmem.transformers.tenancy import Tenant

    return Tenant(kv, RowTable(SHAPE["max_batch"], 256), threading.Lock(), blocks=0, block_bytes=PAGE,
                  idle_after=None)


# -- the ledger ------------------------------------------------------------------------------------
def test_vmem_pool_keeps_its_public_names_and_their_home():
    # The parsers of limits, floors and sizes live in a private module; what users import from
    # vmem.pool (its __all__, the constants, the Limit alias) stays there, defined as vmem.pool's.
    names = set(pool.__all__) | {"MAX_BYTES", "MAX_NAME", "Limit"}
    assert sorted(n for n in names if not hasattr(pool, n)) == []
    assert pool.MAX_BYTES == (1 << 64) - 1 and pool.MAX_NAME == 31
    assert {c.__module__ for c in (pool.Join, pool.Pool, pool.PoolStatus, pool.TenantStatus, pool.Reaped,
                                   pool.LimitChange, pool.FloorChange)} == {"vmem.pool"}
    with pytest.raises(pool.PoolError, match="a share is 0% to 100%"):
        pool.Join("a", floor="101%")


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


def test_a_pool_opened_read_only_reads_its_status_and_refuses_every_change(p, path):
    """``pool.open(path, read_only=True)``: a monitor's open, which never writes: its status
    reads the tenants (``read_only`` set, nothing reaped), and every change raises PoolError
    saying the ledger is read-only, the file unchanged. ``read_only`` takes a bool only."""
    kv = _cache(path, "llama", limit="1M")
    ro = pool.open(path, read_only=True)
    st = ro.status()
    assert st.read_only and st.dead == () and st.reaped == ()
    assert [t.name for t in st.tenants] == ["llama"] and not p.status().read_only
    with open(path, "rb") as fh:
        before = fh.read()
    for change in (lambda: ro.set_limit("llama", "2M"), lambda: ro.set_floor("llama", 0), ro.reap):
        with pytest.raises(pool.PoolError, match="read-only"):
            change()
    with open(path, "rb") as fh:
        assert fh.read() == before
    for bad in ("yes", 1, None, np.int64(1)):
        with pytest.raises(pool.PoolError, match="read_only"):
            pool.open(path, read_only=bad)
    kv.close()


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
               dict(size="1G", device=-1), dict(reserve="1P", backend="host"),
               # past 64 bits (an OverflowError naming no argument), a backend that is not one
               dict(size="1G", slots=2**64), dict(size="1G", device=2**64), dict(size="1G", backend="nope")):
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
    # Without deferred reclamation the freed row is unmapped and its blocks stay, mapped by no one.
    kv = _cache(path, "a", prefix_cache="4M", deferred_reclaim=False)
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


def test_sleep_and_wake_racing_steps_and_map_ahead_on_other_threads_never_fault(p, path):
    """A thread steps and maps ahead (background mapping on) while another sleeps and wakes the
    cache: every call either works or is refused with Asleep (or OutOfMemory), nothing faults,
    and at the end the ledger charges exactly the pages the cache holds."""
    import threading

    kv = _cache(path, "racer", overlap=True, eager_tokens=256, zero_page=True)
    errors, stop, calls = [], threading.Event(), {"ok": 0, "asleep": 0}

    def worker():
        rng = np.random.default_rng(0)
        while not stop.is_set():
            r = None
            try:
                r = kv.alloc()
                kv.map_ahead(r, int(rng.integers(1, 1024)))
                kv.step({r: int(rng.integers(1, 1024))})
                calls["ok"] += 1
            except (vmem.Asleep, vmem.OutOfMemory):
                calls["asleep"] += 1
            except vmem.VmemError as e:
                errors.append(e)
            if r is not None:
                kv.free(r)  # works asleep too (a discarded request keeps its id)

    t = threading.Thread(target=worker)
    t.start()
    try:
        import time

        deadline = time.monotonic() + 20
        n = 0
        while (n < 200 or calls["ok"] < 20 or calls["asleep"] < 20) and time.monotonic() < deadline:
            kv.sleep(discard=True)
            assert kv.usage()["physical_bytes"] == 0
            time.sleep(0.0002)  # the worker runs into the sleeping cache
            kv.wake()
            time.sleep(0.0005)
            n += 1
    finally:
        stop.set()
        t.join()
    assert errors == [] and calls["ok"] > 0 and calls["asleep"] > 0, (errors, calls)
    kv.wait_idle()
    assert kv.tenant().usage == kv.usage()["physical_bytes"]
    kv.sleep(discard=True)
    assert p.status().used == 0
    kv.close()


def test_a_cache_that_fails_to_start_leaves_the_pool_and_a_bad_join_changes_nothing(p, path):
    with pytest.raises(vmem.OutOfMemory):
        _cache(path, "big", limit="1M", prealloc="2M")  # prealloc past the limit
    with pytest.raises(vmem.PoolError, match="exceeds the pool's total"):
        _cache(path, "huge", limit="1T")
    with pytest.raises(vmem.PoolError, match="no pool ledger"):
        _cache(path + "-missing", "x")
    with pytest.raises(vmem.InvalidArgument):
        _cache(path, "shape", layers=0)  # a bad shape is refused before joining
    assert p.status().tenants == () and p.status().used == 0
    kv = _cache(path, "big", limit="1M")  # the name is free again
    kv.close()


def test_a_tenant_gives_back_its_unmapped_pages_when_the_pool_runs_low(path):
    """A tenant's prefix cache (blocks no request maps) would hold room another tenant needs:
    once the pool's free room is below 1/LOW_WATER of its total, Tenant.yield_room gives back
    what no request maps (the live request keeps its pages); with room enough it does nothing."""

    pytest.importorskip("torch")
    from vmem.transformers import tenancy

    pool.create(path, size=FULL * 2, slots=4)  # room for two full requests
    # Without deferred reclamation the freed row is unmapped and its blocks stay, mapped by no one.
    kv = _cache(path, "a", prefix_cache="1M", deferred_reclaim=False)
    tenant = _tenant_of(kv)
    a = kv.alloc()
    kv.step({a: 1024})
    kv.publish_prefix(a, list(range(1024)))
    kv.free(a)  # its 16 pages stay cached as prefix blocks
    b = kv.alloc()
    kv.step({b: 256})  # 4 pages, live
    assert kv.prefix_stats()["unmapped_bytes"] > 0
    held = kv.tenant().usage
    assert tenant.yield_room() == 0 and kv.tenant().usage == held, "room enough: nothing given"
    other = _cache(path, "b")
    c = other.alloc()
    other.step({c: 600})  # 12 pages, the rest of the pool: its free room falls below 1/8 of its total
    status = pool.open(path).status()
    assert status.total - status.used < status.total // tenancy.LOW_WATER
    given = tenant.yield_room()
    assert given > 0 and kv.tenant().usage == held - given
    assert kv.request_pages(b) == [1] * 4, "the live request keeps its pages"
    assert tenant.yield_room() == 0, "nothing unmapped is left to give"
    other.close()
    kv.close()


def test_a_tenant_holding_cache_past_a_fair_share_leaves_one_free(path):
    """Three tenants (a fair share: a third of the pool, one full request; prefix blocks of a
    quarter share). A tenant holding prefix cache past its share while less than a share is
    free gives back enough to free a share, but never goes below its own share; a tenant with
    cache within its share gives nothing; with a share free nobody does. (Before, tenants
    yielded only below 1/LOW_WATER free: none of these gives would have happened.)"""
    import itertools

    pytest.importorskip("torch")
    from vmem.transformers import tenancy

    pool.create(path, size=FULL * 3, slots=4)
    # Without deferred reclamation a freed row is unmapped and its blocks stay, mapped by no one.
    a, b, c = (_cache(path, n, prefix_cache="2M", deferred_reclaim=False) for n in "abc")
    assert a.tenant().pool_tenants == 3
    eng = {kv: _tenant_of(kv) for kv in (a, b, c)}
    share, quarter = FULL, FULL // 4
    ids = itertools.count()

    def cache(kv, tokens):  # a finished request's pages, cached as prefix blocks (256 tokens each)
        r = kv.alloc()
        kv.step({r: tokens})
        kv.publish_prefix(r, [next(ids) for _ in range(tokens)])
        kv.free(r)

    def free():
        t = a.tenant()
        return t.pool_total - t.pool_used

    cache(a, 1024)
    cache(a, 512)  # a: one and a half shares of cache
    cache(c, 512)  # c: half a share of cache
    assert (a.tenant().usage, c.tenant().usage, free()) == (6 * quarter, 2 * quarter, share)
    assert all(eng[kv].yield_room() == 0 for kv in (a, b, c)), "a share free: nothing given"

    r = b.alloc()
    b.step({r: 256})  # a quarter share, live: 3/4 share free (above 1/LOW_WATER, below a share)
    assert FULL * 3 // tenancy.LOW_WATER <= free() == 3 * quarter
    assert eng[c].yield_room() == 0 and c.tenant().usage == 2 * quarter, "c is within its share"
    assert eng[b].yield_room() == 0
    assert eng[a].yield_room() == quarter and free() == share, "enough to free a share"
    assert a.tenant().usage == 5 * quarter and eng[a].yield_room() == 0

    b.step({r: 768})  # b maps a half share more: half a share free, a a quarter above its share
    assert FULL * 3 // tenancy.LOW_WATER <= free() == 2 * quarter
    assert eng[a].yield_room() == quarter, "only down to its own share, though a share is not free"
    assert a.tenant().usage == share and free() == 3 * quarter
    assert eng[a].yield_room() == 0 and eng[c].yield_room() == 0
    for kv in (c, b, a):
        kv.close()


def test_a_survivor_reaps_a_killed_tenant_without_anyone_reading_the_status(path):
    """A tenant process killed with SIGKILL leaves its usage in the ledger until someone reaps
    it; nobody's charge is refused (the engine asks only for the room its budget shows) and no
    operator may be watching. A surviving tenant's loop turn (Tenant.yield_room) reaps it,
    at most every REAP_EVERY_S: the room is back, read through the survivor's own slot."""
    import signal
    import subprocess
    import sys

    pytest.importorskip("torch")
    from vmem.transformers import tenancy

    pool.create(path, size=FULL * 3, slots=4)
    script = (f"import sys, vmem; from vmem import pool\n"
              f"kv = vmem.KVCache(**{SHAPE!r}, pool=pool.Join('doomed', ledger={path!r}))\n"
              f"r = kv.alloc(); kv.step({{r: 1024}}); print('held', flush=True); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        kv = _cache(path, "survivor")
        tenant = _tenant_of(kv)
        assert kv.tenant().pool_used == FULL and kv.tenant().pool_tenants == 2
        clock = [100.0]
        tenant.yield_room(now=lambda: clock[0])  # a loop turn reaps (nobody dead yet): not again before REAP_EVERY_S
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        tenant.yield_room(now=lambda: clock[0] + tenancy.REAP_EVERY_S / 2)
        assert kv.tenant().pool_used == FULL and kv.tenant().pool_tenants == 2, "dead, not reaped yet"
        tenant.yield_room(now=lambda: clock[0] + tenancy.REAP_EVERY_S)
        t = kv.tenant()
        assert (t.pool_used, t.pool_tenants) == (0, 1), "reaped by the survivor's loop turn"
        assert [x.name for x in pool.open(path).status().tenants] == ["survivor"]
        kv.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_ledger_corrupted_under_running_tenants_is_logged_by_their_reap_not_raised(path, caplog):
    """The periodic reap checks the ledger; one that fails the check (a header word overwritten
    under the running tenants) is logged once and nothing is reaped, and serving goes on: the
    tenant's loop turn returns, its pages stay mapped, its next step maps more."""
    import logging

    pytest.importorskip("torch")
    from vmem.transformers import tenancy

    pool.create(path, size=FULL * 3, slots=4)
    kv = _cache(path, "a")
    r = kv.alloc()
    kv.step({r: 512})
    with open(path, "r+b") as f:  # the header's seal (word 7): what the check verifies first
        f.seek(7 * 8)
        f.write((12345).to_bytes(8, "little"))
    tenant = _tenant_of(kv)
    clock = iter(range(0, 100))
    with caplog.at_level(logging.WARNING, logger=tenancy.__name__):
        for _ in range(3):
            assert tenant.yield_room(now=lambda: float(next(clock))) == 0
    warned = [rec for rec in caplog.records if "not reaped" in rec.getMessage()]
    assert len(warned) == 1 and "changed" in warned[0].getMessage(), caplog.text
    kv.step({r: 1024})
    assert kv.request_pages(r) == [4] * 4  # 1,024 tokens: 4 pages in each of the 4 buffers
    with pytest.raises(vmem.PoolError, match="changed"):
        pool.open(path).status()  # the operator's view says what is wrong
    kv.close()


@pytest.mark.parametrize("kw", [dict(tenant="x" * 32), dict(tenant="a b"), dict(tenant="é"),
                                dict(tenant="a", limit="0"), dict(tenant="a", limit="1.5G"),
                                dict(tenant="a", limit="250%"), dict(tenant="a", limit="0%"),
                                dict(tenant="a", limit="abc"), dict(tenant="a", limit="\u00b2%"),
                                dict(tenant="a", limit="\u0663%"), dict(tenant="a", limit=1 << 64)])
def test_a_join_is_refused_when_made_not_when_the_cache_joins(kw):
    """A name the ledger refuses or a limit of nothing is a PoolError where the Join is made (it
    used to pass there and fail only when a cache joined)."""
    with pytest.raises(vmem.PoolError, match="invalid pool setting"):
        pool.Join(**kw)
    assert pool.Join("a" * 31, limit="25%").tenant == "a" * 31


@pytest.fixture
def full_fs(tmp_path):
    """A 4 KiB tmpfs: a filesystem that fills up (a full /dev/shm is the same)."""
    import subprocess

    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_a_pool_created_on_a_full_filesystem_is_a_pool_error_and_leaves_nothing(full_fs):
    """Before, the ledger was written through a mapping of a sparse file and the interpreter died
    of SIGBUS; run in a child so that a crash is this test's failure, not pytest's."""
    import subprocess
    import sys

    code = ("import vmem; from vmem import pool\n"
            "try:\n"
            f"    pool.create({str(full_fs / 'p')!r}, size='1G')\n"
            "except vmem.PoolError as e:\n"
            "    print('PoolError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "PoolError:" in r.stdout and "No space left on device" in r.stdout, r.stdout
    assert os.listdir(full_fs) == []
    # One that fits (one slot) is made and opens.
    assert pool.create(str(full_fs / "small"), size="1G", slots=1).slots == 1
    assert os.listdir(full_fs) == ["small"]


def test_names_and_values_of_any_length_are_cut_in_messages(p, path):
    """A megabyte name, limit or size: refused, and the message quotes only its start (before,
    the whole megabyte came back in the PoolError)."""
    huge = "x" * 1_000_000
    calls = [lambda: pool.Join(huge), lambda: pool.Join("a", limit=huge), lambda: pool.Join("a", floor=huge),
             lambda: p.set_limit(huge, "1M"), lambda: p.set_floor(huge, "1M"), lambda: p.set_limit("a", huge),
             lambda: p.set_floor("a", huge), lambda: pool.create(path + "-new", size=huge),
             lambda: pool.create(path + "-new", size="1G", default_limit=huge),
             lambda: pool.create(path + "-new", size="1G", group=huge),
             lambda: pool.create(path + "-new", size="1G", backend=huge),
             lambda: vmem.KVCache(**SHAPE, pool=huge)]
    for call in calls:
        with pytest.raises(vmem.PoolError) as e:
            call()
        assert len(str(e.value)) < 300, str(e.value)[:300]
        assert "xxx" in str(e.value)
    assert not os.path.exists(path + "-new")


def test_a_pool_or_a_limit_smaller_than_a_page_is_refused_as_zero_is(p, path):
    """vmem's smallest page is 64 KiB: a pool, a default limit or a limit that cannot hold one is
    refused where it is given (before, size=1 and limit=1 were taken, and messages then said "1 can
    be had")."""
    assert pool.MIN_BYTES == 64 << 10
    for kw in (dict(size=1), dict(size="4K"), dict(size=65535), dict(size="1G", default_limit=1),
               dict(size="1G", default_limit="1K")):
        with pytest.raises(vmem.PoolError, match="64K"):
            pool.create(path + "-tiny", **kw)
    assert not os.path.exists(path + "-tiny")
    for limit in (1, "1", "65535", 4096):
        with pytest.raises(vmem.PoolError, match="64K"):
            pool.Join("a", limit=limit)
    kv = _cache(path, "llama", limit="1M")
    for limit in (1, "65535", 65535):
        with pytest.raises(vmem.PoolError, match="64K"):
            p.set_limit("llama", limit)
    assert p.set_limit("llama", "64K").new == 64 << 10
    kv.close()
    assert pool.create(path + "-one", size="64K").total == 64 << 10


def test_a_reservation_past_the_tenants_limit_is_refused_and_keeps_nothing(p, path):
    """reserve_physical past the limit: OutOfMemory, and the pages made before the refusal go back
    (before, they stayed, charged to the pool)."""
    kv = _cache(path, "r", limit="1M")
    assert kv.reserve_physical("512K") == 8
    before = (kv.usage()["physical_bytes"], p.status().tenant("r").usage)
    with pytest.raises(vmem.OutOfMemory):
        kv.reserve_physical("2M")
    assert (kv.usage()["physical_bytes"], p.status().tenant("r").usage) == before == (512 << 10, 512 << 10)
    assert kv.reserve_physical("1M") == 8
    kv.close()


def test_ledger_paths_as_strings_path_likes_and_bytes_and_a_nul_refused_where_given(path):
    """bytes paths were refused as "not a string"; a NUL byte passed Join() and failed only when a
    cache joined, with the NUL printed raw in the message."""
    import pathlib

    assert pool.create(os.fsencode(path), size="1G").path == path
    assert pool.open(pathlib.Path(path)).path == path
    for bad in (path + "\x00x", b"\x00"):
        for call in (lambda: pool.Join("a", ledger=bad), lambda: pool.open(bad), lambda: pool.create(bad, size="1G")):
            with pytest.raises(vmem.PoolError, match="NUL byte"):
                call()
