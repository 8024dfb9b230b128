"""The transformers engine's cache as a tenant of a shared pool, on the CPU (host backend, fp32):
a limit lowered while it serves makes it shrink (prefix cache first, then the engine preempts)
and the greedy outputs stay those of an unconstrained run; sleep and wake between batches.

Needs torch and a transformers vmem serves (as test_transformers_cb.py)."""

import threading
import time
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng

eng.skip_unless_served()

from harness import check as h

import vmem
import vmem.transformers as vt
from vmem import pool
from vmem.transformers import tenancy

NEW = 60
LONG = 160  # every running request crosses a block boundary after the limit changes
SYSTEM = 200  # a shared prompt: 3 full token-major blocks of 64 tokens
SUFFIXES = [5, 40, 70, 17, 33, 50]
OPTS = dict(page_size="64K", max_requests=4, max_context=1024, memory="8M", layout="token-major")


@pytest.fixture(autouse=True)
def _fake_memory():
    h.fake_cpu_memory()


@pytest.fixture
def ledger(tmp_path):
    path = str(tmp_path / "pool")
    return pool.create(path, size="64M")


def _prompts(vocab):
    system = h.make_prompts(1, [SYSTEM], vocab, seed=7)[0]
    return [system + p for p in h.make_prompts(len(SUFFIXES), SUFFIXES, vocab, seed=8)]


def _run(model, prompts, new=NEW, primers=0, **opts):
    stagger = None if primers else [0] + [1] * (len(prompts) - 1)  # the first request's prompt is published first
    with vt.serving(**dict(OPTS, **opts)):
        return h.run_engine(model, vt.VMEM_ATTENTION, prompts, new, stagger=stagger, streaming=not primers,
                            primers=primers,
                            cb_kwargs=dict(max_batch_tokens=64, allow_block_sharing=True))


def _tokens(run):
    return {rid: list(run["results"][rid].generated_tokens) for rid in run["ids"]}


def test_a_limit_lowered_mid_run_evicts_the_prefix_cache_then_preempts_and_outputs_stay_greedy(ledger, monkeypatch):
    """An unconstrained run, then the same requests in a pool. The first request runs alone to
    the end (its blocks stay cached, unmapped), then 4 of the others run together; 20 rounds
    later the operator lowers the tenant's limit to 11 blocks, below what it holds: the cache
    first gives back the prefix cache's unmapped blocks, then the engine preempts requests
    (soft reset) until the rest fit; every request's greedy tokens equal the unconstrained
    run's, and the tenant ends within its limit."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _prompts(model.config.vocab_size)
    free = _run(model, prompts, new=LONG, primers=1)
    assert free["cache"].readmissions == 0

    rounds = {"n": 0, "four": None, "changed_at": None, "first_preemption": None, "evicted_at_preemption": None}
    real = tenancy.Tenant.on_round

    def on_round(tenant):
        real(tenant)
        rounds["n"] += 1
        block = tenant.block_bytes
        unmapped = tenant.kv.prefix_stats()["unmapped_bytes"]
        if rounds["four"] is None and len(tenant.table) == 4:
            rounds["four"] = rounds["n"]
        if rounds["changed_at"] is None and rounds["four"] and rounds["n"] == rounds["four"] + 20:
            rounds["unmapped"] = unmapped // block
            rounds["held"] = tenant.kv.tenant().usage // block
            ledger.set_limit("svc", 11 * block)  # 10 blocks for requests (one needs 7 at most), 1 for the trash row
            rounds["changed_at"] = rounds["n"]
        if rounds["first_preemption"] is None and tenant.table.readmissions > 0:
            rounds["first_preemption"] = rounds["n"]
            rounds["evicted_at_preemption"] = tenant.kv.prefix_stats()["evicted_blocks"]

    monkeypatch.setattr(tenancy.Tenant, "on_round", on_round)
    run = _run(model, prompts, new=LONG, primers=1, pool=pool.Join("svc", ledger=ledger.path))
    cache = run["cache"]
    assert run["error"] is None, run["error"]
    assert _tokens(run) == _tokens(free)
    assert rounds["changed_at"] is not None and rounds["held"] > 11 and rounds["unmapped"] > 0, rounds
    assert rounds["first_preemption"] is not None, rounds
    assert rounds["first_preemption"] > rounds["changed_at"], rounds
    # The prefix cache gave its blocks back before any request was preempted.
    assert rounds["evicted_at_preemption"] > 0, rounds
    t = cache.kv.tenant()
    assert t.limit == 11 * cache.geometry.block_bytes and t.usage <= t.limit, t
    assert ledger.status().tenant("svc").peak == rounds["held"] * cache.geometry.block_bytes


def test_a_pool_limit_bounds_the_engines_blocks_and_a_raised_one_grows_at_once(ledger):
    """A tenant limit of 8 blocks: the engine may hold 7 (one is the trash row's; a request
    needs 6 at most) and serves everything, preempting; a raised limit shows in the free blocks
    at once."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _prompts(model.config.vocab_size)[:3]
    block = 64 * 1024  # token-major, 64K pages: one page a block
    run = _run(model, prompts, pool=pool.Join("small", limit=8 * block, ledger=ledger.path))
    cache = run["cache"]
    assert run["error"] is None and len(run["results"]) == 3
    assert cache.tenant.budget_blocks() == 7
    # Idle: the trash row's block and the prefix cache's unmapped blocks, no idle reserve.
    u = cache.kv.usage()
    assert u["pool_free_pages"] == 0, u
    assert cache.kv.tenant().usage == cache.trash_bytes() + cache.kv.prefix_stats()["unmapped_bytes"]
    assert ledger.status().tenant("small").peak <= 8 * block
    ledger.set_limit("small", 20 * block)
    assert cache.tenant.budget_blocks() == 19


def test_pool_keep_holds_made_pages_between_requests_and_the_pool_takes_them_back_when_idle(ledger):
    """``pool_keep`` = 3 blocks: once the requests are done the tenant keeps 3 made, unmapped
    pages (charged to it) beside its trash row (no prefix cache here); idle for
    ``pool_idle_s``, it gives them back; the tokens are an unpooled run's."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _prompts(model.config.vocab_size)[:3]
    block = 64 * 1024  # token-major, 64K pages: one page a block
    join = pool.Join("keeper", ledger=ledger.path)
    run = _run(model, prompts, pool=join, pool_keep=3 * block, pool_idle_s=3600, prefix_cache=0)
    cache = run["cache"]
    assert run["error"] is None and len(run["results"]) == 3
    u = cache.kv.usage()
    assert u["pool_free_pages"] == 3, u
    assert cache.kv.tenant().usage == cache.trash_bytes() + 3 * block
    made = u["pool_created_pages"]
    # Given back when idle for pool_idle_s (the loop turns of an hour, on a clock of the test's own): only the
    # trash row stays.
    t0 = time.monotonic()
    assert cache.tenant.release_when_idle(now=lambda: t0) == 0  # idle, not yet for an hour
    assert cache.tenant.release_when_idle(now=lambda: t0 + 3600) == 3 * block
    assert cache.kv.tenant().usage == cache.trash_bytes() and cache.kv.usage()["pool_created_pages"] == made - 3
    free = _run(model, prompts, prefix_cache=0)
    assert _tokens(run) == _tokens(free)


@pytest.mark.parametrize("bad", [-1, "lots", True, 1.5, "-2M", 10**30, None, "inf"])
def test_pool_keep_refuses_what_is_no_size(bad):
    with pytest.raises(vmem.InvalidArgument, match="pool_keep"):
        vt.Options(pool_keep=bad)


PAGE = 64 << 10
#: One layer, one KV head of 64: a 64K page holds 512 tokens of K (or V); 1,024 tokens, 4 pages.
KV_SHAPE = dict(layers=1, kv_heads=1, head_dim=64, dtype="fp16", max_batch=2, max_context=1024, page_size="64K",
                device="cpu", overlap=False, eager_tokens=0)


def _tenant(path, name, limit=None):
    """A pool tenant (an engine cache's :class:`~vmem.transformers.tenancy.Tenant`) whose one
    request grew to 1,024 tokens (its round's step not taken yet), and that request's vmem row."""
    from vmem.kernels.rows import RowTable

    kv = vmem.KVCache(**KV_SHAPE, pool=pool.Join(name, limit=limit, ledger=path))
    table = RowTable(KV_SHAPE["max_batch"], 512)
    row = kv.alloc()
    table.grow(table.admit("r", row), 2)  # 1,024 tokens
    return tenancy.Tenant(kv, table, threading.Lock(), blocks=8, block_bytes=4 * PAGE, idle_after=None), row


def test_a_round_whose_room_a_neighbour_took_waits_for_it_instead_of_failing(tmp_path):
    """A pool of 6 pages; a neighbour maps 4 after this tenant's engine checked its room: the
    round's step (4 pages) is refused, and it waits until the neighbour gives them back (a thread,
    0.3 s later), then maps them. The race made multitenant_bench's starved-tenant test fail 1
    run in 3 (`out of memory: 1 more pages needed, 0 can be had`)."""
    path = str(tmp_path / "pool")
    pool.create(path, size=6 * PAGE)
    ours, _ = _tenant(path, "ours")
    theirs, row = _tenant(path, "theirs")
    theirs.step()

    def give_back():
        time.sleep(0.3)
        theirs.kv.free(row)
        theirs.kv.shrink()

    t0 = time.monotonic()
    helper = threading.Thread(target=give_back)
    helper.start()
    ours.step()
    helper.join()
    assert time.monotonic() - t0 >= 0.3
    assert ours.kv.tenant().usage == 4 * PAGE


def test_a_round_refused_by_its_own_limit_or_past_the_wait_stops_with_out_of_memory(tmp_path, monkeypatch):
    path = str(tmp_path / "pool")
    pool.create(path, size=6 * PAGE)
    alone, _ = _tenant(path, "alone", limit=2 * PAGE)  # its own limit: nothing to wait for
    pauses = []
    with pytest.raises(vmem.OutOfMemory):
        alone.step(pause=pauses.append)
    assert pauses == [] and alone.kv.tenant().usage == 0
    alone.kv.close()
    ours, _ = _tenant(path, "ours")
    theirs, _ = _tenant(path, "theirs")
    theirs.step()  # and never gives it back
    monkeypatch.setattr(tenancy, "STEP_WAIT_S", 0.1)
    t0 = time.monotonic()
    with pytest.raises(vmem.OutOfMemory):
        ours.step()
    # It holds at most the 2 free pages it made trying (kept for its next step), nothing past the pool.
    assert 0.1 <= time.monotonic() - t0 < 5 and ours.kv.tenant().usage <= 2 * PAGE


def test_sleep_releases_every_page_to_the_pool_and_the_next_batch_wakes_it(ledger):
    """After a batch: sleep leaves 0 bytes charged and 0 created, with every tensor at its
    address; a second batch on the same engine wakes it and gives the same tokens as the first
    (the same prompts). Sleep is refused while a request holds a row."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _prompts(model.config.vocab_size)[:3]
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with vt.serving(**dict(OPTS, pool=pool.Join("sleeper", ledger=ledger.path))):
        model.set_attn_implementation(vt.VMEM_ATTENTION)  # (registered with transformers once installed)
        mgr = model.init_continuous_batching(generation_config=gen)
        mgr.start()
        try:
            first = _collect(mgr, prompts, "a")
            cache = mgr.batch_processor.cache
            ptrs = [t.data_ptr() for t in cache.key_cache + cache.value_cache]
            assert ledger.status().tenant("sleeper").usage > 0
            released = vt.sleep(mgr)
            assert released > 0 and cache.kv.asleep
            assert ledger.status().tenant("sleeper").usage == 0
            u = cache.kv.usage()
            assert u["physical_bytes"] == 0 and u["mapped_bytes"] == 0, u
            assert vt.sleep(mgr) == 0  # asleep already
            second = _collect(mgr, prompts, "b")
            assert not cache.kv.asleep
            assert [t.data_ptr() for t in cache.key_cache + cache.value_cache] == ptrs
            assert second == first
            cache.table.admit("held", cache.kv.alloc())  # a request holding a row
            with pytest.raises(vmem.InvalidArgument, match="1 request"):
                vt.sleep(cache)
            assert not cache.kv.asleep
            cache.free_blocks("held")
            vt.sleep(cache)
            vt.wake(mgr)
            assert not cache.kv.asleep and cache.kv.usage()["mapped_bytes"] == cache.trash_bytes()
        finally:
            mgr.stop(block=True)
    with pytest.raises(vmem.VmemError, match="neither a vmem engine cache"):
        vt.sleep(object())


def test_sleep_right_after_start_waits_for_the_engine_to_build_its_cache(monkeypatch):
    """``vt.sleep(manager)`` right after ``manager.start()`` said to start the manager: the
    engine's thread builds the cache after start() returns. It now waits for it (the build
    slowed to 0.5 s here); a manager never started, one on the engine's own cache and a build
    slower than BUILD_WAIT_S each get their own error."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    cls = vt.cache_class()
    built = cls.__init__
    delay = [0.5]

    def slow_init(self, *a, **k):
        time.sleep(delay[0])
        built(self, *a, **k)

    monkeypatch.setattr(cls, "__init__", slow_init)
    with vt.serving(**OPTS):
        model.set_attn_implementation(vt.VMEM_ATTENTION)
        mgr = model.init_continuous_batching(generation_config=gen)
    with pytest.raises(vmem.VmemError, match=r"start it \(manager.start\(\)\) first"):
        vt.sleep(mgr)
    mgr.start()
    try:
        released = vt.sleep(mgr)  # at once: the cache is not built yet
        cache = mgr.batch_processor.cache
        assert isinstance(cache, vt.VmemCBCache) and cache.kv.asleep and released > 0
        assert cache.kv.usage()["physical_bytes"] == 0
        vt.wake(mgr)
        assert not cache.kv.asleep and cache.kv.usage()["mapped_bytes"] == cache.trash_bytes()
    finally:
        mgr.stop(block=True)
    delay[0] = 3.0
    monkeypatch.setattr(vt, "BUILD_WAIT_S", 0.3)
    with vt.serving(**OPTS):
        slow = model.init_continuous_batching(generation_config=gen)
    slow.start()
    try:
        with pytest.raises(vmem.VmemError, match=r"has not built its cache yet \(0.3 s after the call\)"):
            vt.wake(slow)
    finally:
        slow.stop(block=True)
    monkeypatch.setattr(vt, "BUILD_WAIT_S", 60.0)
    model.set_attn_implementation(eng.ENGINE_SDPA)
    theirs = model.init_continuous_batching(generation_config=gen)
    theirs.start()
    try:
        with pytest.raises(vmem.VmemError, match="PagedAttentionCache, not a vmem cache"):
            vt.sleep(theirs)
    finally:
        theirs.stop(block=True)


def _collect(mgr, prompts, prefix):
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        mgr.add_request(p, request_id=rid)
    out = {}
    for _ in ids:
        r = mgr.get_result(timeout=120)
        assert r is not None, "the engine returned no result"
        out[r.request_id[len(prefix):]] = list(r.generated_tokens)
    return out


@pytest.mark.parametrize("bad", [3, True, "", object()])
def test_a_bad_pool_option_is_refused_when_the_options_are_made(bad):
    with pytest.raises(vmem.PoolError):
        vt.Options(pool=bad)
    assert vt.Options(pool="name").pool == pool.Join("name")


def _watch_idle(ledger, name, seconds):
    """An ``inspect`` for run_engine: right after the last result, while the engine loops idle,
    samples the tenant's ledger usage every 20 ms for ``seconds``: ``[(s since, usage)]``."""

    def watch(cache):
        start = time.monotonic()
        samples = []
        while (dt := time.monotonic() - start) < seconds:
            samples.append((dt, ledger.status().tenant(name).usage))
            time.sleep(0.02)
        return {"samples": samples, "trash": cache.trash_bytes(),
                "unmapped": cache.kv.prefix_stats()["unmapped_bytes"]}

    return watch


@pytest.mark.parametrize("idle_s", [0.6, None], ids=["after-0.6s", "disabled"])
def test_an_idle_tenant_gives_back_its_prefix_cache_after_pool_idle_s(ledger, idle_s):
    """Requests sharing a prefix are served (their finished blocks stay in the prefix cache); then
    the engine loops idle. With ``pool_idle_s=0.6`` the tenant's ledger usage falls to its trash
    row's bytes within 0.6 s + 1 s of the last result, and not before 0.6 s less a loop turn;
    with ``None`` it keeps its prefix cache the whole time."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = _prompts(model.config.vocab_size)[:3]
    name = f"idle-{idle_s}"
    watch_s = (idle_s or 0.6) + 1.0
    with vt.serving(**dict(OPTS, pool=pool.Join(name, ledger=ledger.path), pool_idle_s=idle_s)):
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, 8,
                           cb_kwargs=dict(max_batch_tokens=64, allow_block_sharing=True),
                           inspect=_watch_idle(ledger, name, watch_s))
    assert run["error"] is None and len(run["results"]) == 3
    info = run["cache_info"]
    samples, trash = info["samples"], info["trash"]
    held = samples[0][1]
    assert held > trash, f"the prefix cache kept blocks after the last request: {samples[:3]}"
    if idle_s is None:
        assert all(u == held for _, u in samples), samples
        assert info["unmapped"] > 0
        return
    dropped = [t for t, u in samples if u == trash]
    assert dropped, f"never down to the trash row's {trash} bytes in {watch_s} s: {samples[-3:]}"
    assert all(u == held for t, u in samples if t < idle_s - 0.15), samples
    assert dropped[0] <= idle_s + 1.0, samples
    assert info["unmapped"] == 0


def test_idle_release_waits_while_a_request_is_queued_or_waiting():
    """A request that arrived (in the engine's input queue, or waiting in its scheduler) is not
    idleness: the loop turn that is about to schedule it used to give back the prefix cache it
    was arriving to reuse, since the table held no request yet."""
    import queue
    import types

    class Kv:
        asleep, shrinks, _pooled = False, 0, True

        def tenant(self):
            return object()

        def shrink(self):
            Kv.shrinks += 1
            return {"total": 1}

    kv = Kv()
    kv._rs = types.SimpleNamespace(tenant=lambda: dict(pool_total=100, pool_used=0, usage=0, pool_tenants=1),
                                   pool_reap=lambda: 0)
    from vmem.kernels.rows import RowTable
    from vmem.transformers import hooks
    from vmem.transformers.passmemo import MappedBlocks

    cache = object.__new__(vt.VmemCBCache)  # a vmem cache (its type is what the hook recognises): tenant, memo
    cache.__dict__.update(tenant=tenancy.Tenant(kv, RowTable(1, 1), threading.Lock(), blocks=0, block_bytes=1,
                                                idle_after=0.0), mapped=MappedBlocks(lambda: 0))
    proc = types.SimpleNamespace(cache=cache, input_queue=queue.Queue(),
                                 scheduler=types.SimpleNamespace(waiting_requests={}))
    turn = hooks.round_or_wait(lambda self: False)
    proc.input_queue.put("req-1")
    turn(proc)
    assert Kv.shrinks == 0, "released with a request in the input queue"
    proc.input_queue.get()
    proc.scheduler.waiting_requests["req-1"] = object()
    turn(proc)
    assert Kv.shrinks == 0, "released with a request waiting to be scheduled"
    proc.scheduler.waiting_requests.clear()
    turn(proc)
    assert Kv.shrinks == 1, "idle with nothing pending: pool_idle_s=0 gives back at once"


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "2", "2s", True, False, [1],
                                 pytest.param(10**400, id="10**400")])
def test_a_bad_pool_idle_s_is_refused_when_the_options_are_made(bad):
    """10**400 is an int no float holds: it was an OverflowError, not InvalidArgument."""
    with pytest.raises(vmem.InvalidArgument, match="pool_idle_s"):
        vt.Options(pool_idle_s=bad)
    assert vt.Options().pool_idle_s == 2.0
    assert vt.Options(pool_idle_s=None).pool_idle_s is None
    assert vt.Options(pool_idle_s=0).pool_idle_s == 0.0
    assert str(vt.Options(pool_idle_s=-0.0).pool_idle_s) == "0.0", "-0.0 is 0, and shown as 0"
