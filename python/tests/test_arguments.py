"""Every constructor argument and option of vmem.KVCache, checked as a user gets them wrong
(issue #30 items 6, 9 and 12, and the adversarial pass in docs/hardening.md): anything but
the type an argument takes is InvalidArgument naming it, and nothing is coerced."""

import subprocess
import sys
import textwrap

import pytest

import vmem

GEOM = dict(layers=2, kv_heads=2, head_dim=64, max_batch=2, max_context=4096, dtype="fp16",
            page_size="64K", device="cpu", overlap=False, eager_tokens=0)


def cache(**kw):
    return vmem.KVCache(**{**GEOM, **kw})


BOOLS = ["overlap", "deferred_reclaim", "background_unmap", "reuse_while_unmapping", "pad_rows", "zero_page"]


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, 1.0, [], b"yes"])
def test_a_boolean_option_given_anything_but_a_bool_is_refused_naming_it(name, value):
    # Item 6: zero_page="no" was True (bool() of a non-empty string).
    with pytest.raises(vmem.InvalidArgument, match=name):
        cache(**{name: value})


def test_numpy_bools_are_bools_and_numpy_ints_are_not():
    """NumPy 2 renamed ``numpy.bool_`` to ``numpy.bool``: both are taken (the check named only the
    first, so NumPy 2's were refused); a NumPy int stays refused as a bool."""
    np = pytest.importorskip("numpy")
    from vmem._args import check_bool

    assert check_bool("flag", np.True_) is True and check_bool("flag", np.False_) is False
    assert check_bool("flag", np.bool_(True)) is True
    for bad in (np.int64(1), np.float32(0.0), np.array(True)):
        with pytest.raises(vmem.InvalidArgument, match="flag"):
            check_bool("flag", bad)
    kv = cache(pad_rows=np.True_)
    assert kv.config()["pad_rows"] is True
    kv.close()


def test_numpy_integers_are_sizes_and_numpy_bools_and_floats_are_not():
    """A size given as a NumPy integer (``np.int64(1 << 20)``, from an array's sum or a config
    read with NumPy) is that many bytes wherever a size goes: ``parse_bytes``, the cache's
    constructor and calls, the pool's settings; a NumPy bool or float is refused as a Python one."""
    np = pytest.importorskip("numpy")
    import vmem.pool

    assert vmem.parse_bytes(np.int64(65536)) == 65536 and type(vmem.parse_bytes(np.uint32(5))) is int
    # Every integer dtype: np.longlong is what np.array(..., dtype="q").sum() gives.
    for t in (np.int8, np.int16, np.int32, np.int64, np.longlong, np.uint8, np.uint64, np.ulonglong, np.intp):
        assert vmem.parse_bytes(t(100)) == 100, t
    assert vmem.parse_bytes(np.array([1 << 20], dtype="q").sum()) == 1 << 20
    for bad in (np.timedelta64(5), np.array([5]), np.array(5), np.array(5, dtype=np.float32)):
        with pytest.raises(vmem.InvalidArgument):
            vmem.parse_bytes(bad)
    for bad in (np.bool_(True), np.float64(65536.0), np.int64(-1)):
        with pytest.raises(vmem.InvalidArgument):
            vmem.parse_bytes(bad)
    kv = vmem.KVCache(layers=1, kv_heads=1, head_dim=64, dtype="fp16", max_batch=2, max_context=1024,
                      page_size=np.int64(65536), memory_cap=np.uint64(1 << 20), prealloc=np.int32(0), backend="host")
    assert kv.config()["page_size"] == 65536 and kv.set_memory_cap(np.int64(512 << 10)) >= 0
    assert kv.usage()["cap_bytes"] == 512 << 10
    with pytest.raises(vmem.InvalidArgument, match="size"):
        kv.reserve_physical(np.float32(65536.0))
    kv.close()
    from vmem._pool_args import _setting, _size

    assert _size("size", np.int64(1 << 30)) == str(1 << 30)
    assert _setting("limit", np.uint64(1 << 20), floor=False) == str(1 << 20)
    for bad in (np.bool_(True), np.float64(1e9)):
        with pytest.raises(vmem.PoolError):
            _size("size", bad)


@pytest.mark.parametrize("name", BOOLS)
def test_a_boolean_option_takes_true_and_false(name):
    for value in (True, False):
        kv = cache(**{name: value})
        if name in ("zero_page", "overlap", "pad_rows", "background_unmap", "reuse_while_unmapping"):
            assert kv.config()[name] is value
        kv.close()


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None, 0, -1])
def test_tp_must_be_an_int_of_one_or_more(value):
    # Item 12: tp=True was TP-1 (True % 8 == 1 passed the split check).
    with pytest.raises(vmem.InvalidArgument, match="tp"):
        vmem.KVCache("llama-3-8b", tp=value, max_batch=1, max_context=16, device="cpu")


def test_tp_splits_a_models_heads_and_is_refused_with_an_explicit_shape():
    kv = vmem.KVCache("llama-3-8b", tp=2, max_batch=1, max_context=16, device="cpu")
    assert kv.config()["kv_heads"] == 4
    kv.close()
    with pytest.raises(vmem.InvalidArgument, match="tp=2"):
        cache(tp=2)


@pytest.mark.parametrize("name", ["layers", "kv_heads", "head_dim", "max_batch", "max_context"])
@pytest.mark.parametrize("value", [2.0, "2", True, None, 0, -3])
def test_a_shape_argument_must_be_a_positive_int(name, value):
    with pytest.raises(vmem.InvalidArgument, match=name):
        cache(**{name: value})


@pytest.mark.parametrize("value", [1.0, "0", True, -1, [0]])
def test_eager_tokens_must_be_an_int_of_zero_or_more(value):
    with pytest.raises(vmem.InvalidArgument, match="eager_tokens"):
        cache(eager_tokens=value)


@pytest.mark.parametrize("name", ["page_size", "memory_cap", "prealloc", "reclaim_threshold",
                                  "prefix_cache"])
@pytest.mark.parametrize("value", [True, 65536.0, "lots", -1, [1]])
def test_a_size_must_be_bytes_as_an_int_or_a_string(name, value):
    with pytest.raises(vmem.InvalidArgument, match=name):
        cache(**{name: value})


def test_sizes_take_ints_and_strings():
    kv = cache(page_size=65536, memory_cap="1M", prealloc="128K", reclaim_threshold=0,
               prefix_cache="256K")
    c = kv.config()
    assert (c["page_size"], c["memory_cap"], c["prefix_cache"]) == (65536, 1 << 20, 256 << 10)
    kv.close()


@pytest.mark.parametrize("kw", [dict(layout=None), dict(backend=1), dict(model=b"llama-3-8b")])
def test_names_must_be_strings(kw):
    with pytest.raises(vmem.InvalidArgument, match=next(iter(kw))):
        cache(**kw) if "model" not in kw else vmem.KVCache(kw["model"], max_batch=1,
                                                           max_context=16, device="cpu")


@pytest.mark.parametrize("value", ["no", 0, None, 1.0])
def test_set_deferred_reclaim_takes_a_bool_only(value):
    kv = cache()
    with pytest.raises(vmem.InvalidArgument, match="True or False"):
        kv.set_deferred_reclaim(value)
    kv.close()


@pytest.mark.parametrize("value", ["ab", b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x01\x02")])
def test_step_of_a_string_is_refused_as_a_whole(value):
    # A memoryview has tolist(), and was taken as the lengths [1, 2].
    kv = cache()
    with pytest.raises(vmem.InvalidArgument, match="lengths must be"):
        kv.step(value)
    kv.close()


@pytest.mark.parametrize("value", ["0", 1.0, True, None])
def test_a_layer_index_that_is_not_an_int_is_refused_as_such(value):
    kv = cache()
    with pytest.raises(vmem.InvalidArgument, match="layer must be an int"):
        kv.layer(value)
    kv.close()


@pytest.mark.parametrize(
    "call",
    [lambda kv, r: kv.adopt_prefix(r, list(range(64))),
     lambda kv, r: kv.publish_prefix(r, list(range(64))),
     lambda kv, r: kv.step({r: 5}),
     lambda kv, r: kv.map_ahead(r, 5)],
    ids=["adopt_prefix", "publish_prefix", "step", "map_ahead"],
)
def test_a_call_on_a_freed_request_names_the_python_method_to_call(call):
    # Item 9: the message said "allocate it with alloc_reqid first", a Rust method.
    kv = cache(prefix_cache="1M")
    r = kv.alloc()
    kv.step({r: 100})
    kv.free(r)
    with pytest.raises(vmem.InvalidArgument, match=r"alloc\(\) first") as e:
        call(kv, r)
    assert "alloc_reqid" not in str(e.value)
    kv.close()


def test_freeing_an_id_never_handed_out_names_the_python_methods():
    kv = cache()
    with pytest.raises(vmem.InvalidArgument, match=r"free\(\) takes an id alloc\(\) returned") as e:
        kv.free(1)
    assert "_reqid" not in str(e.value)
    kv.close()


def run(code, *, limit_bytes=None, timeout=120):
    """Runs ``code`` in a fresh interpreter (under an address-space limit), returning it."""
    pre = ""
    if limit_bytes:
        pre = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes}))\n"
    return subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_threads_racing_close_get_closed_never_a_crash():
    # Eight threads allocate, step, map ahead, publish, take views and read counters while the
    # main thread closes the cache; every call after close must raise vmem.Closed. In a child
    # process: a crash is a signal there, not here.
    r = run("""
        import threading, time, vmem
        bad = []
        for it in range(60):
            kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, max_batch=4, max_context=4096,
                              dtype="fp16", page_size="64K", device="cpu", prefix_cache="1M")
            def work(kind):
                while True:
                    try:
                        if kind == 0:
                            r = kv.alloc(); kv.step({r: 100}); kv.free(r)
                        elif kind == 1:
                            kv.layer(1); kv.usage(); kv.config(); kv.prefix_stats(); repr(kv)
                        else:
                            r = kv.alloc(); kv.map_ahead(r, 300); kv.step({r: 64})
                            kv.publish_prefix(r, list(range(64))); kv.free(r)
                    except vmem.Closed:
                        return
                    except vmem.InvalidArgument as e:  # ids all in use, or one freed by close
                        if "in use" not in str(e) and "not active" not in str(e):
                            bad.append(repr(e)); return
                    except BaseException as e:
                        bad.append(repr(e)); return
            ts = [threading.Thread(target=work, args=(i % 3,)) for i in range(8)]
            for t in ts: t.start()
            time.sleep(0.001 * (it % 4))
            kv.close()
            for t in ts: t.join(30)
            assert not any(t.is_alive() for t in ts), "a thread is stuck after close"
        print("bad", bad)
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "bad []", r.stdout


def test_under_an_address_space_limit_a_cache_too_large_to_reserve_is_a_clean_error():
    # ulimit -v / prlimit --as: 1 GiB of address space, a cache of 8 GiB of virtual memory.
    r = run("""
        import vmem
        try:
            vmem.KVCache(layers=32, kv_heads=8, head_dim=128, max_batch=8, max_context=8192,
                         dtype="fp16", page_size="64K", device="cpu")
        except vmem.VmemError as e:
            print(type(e).__name__, e)
        else:
            print("accepted")
        kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, max_batch=2, max_context=4096,
                          dtype="fp16", page_size="64K", device="cpu")
        r = kv.alloc(); kv.step({r: 100}); kv.close()
        print("a small cache works")
    """, limit_bytes=1 << 30)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    first, second = r.stdout.strip().splitlines()
    assert first.startswith(("VmemError", "OutOfMemory", "InvalidArgument")), first
    assert "Cannot allocate memory" in first or "memory" in first.lower(), first
    assert second == "a small cache works"


def test_vmem_torch_takes_a_kvcache_only():
    vt = pytest.importorskip("vmem.torch", reason="vmem.torch needs torch")
    for call in (lambda: vt.layer("kv", 0), lambda: vt.layers(None), lambda: vt.tensors(3)):
        with pytest.raises(vmem.InvalidArgument, match="vmem.KVCache"):
            call()


SHAPES_PAST_THE_BOUNDS = [
    # The two: the token-major views (16 GB of them) aborted at once; per-layer buffers
    # (2 x 10**7 of them, each with its bookkeeping) after 14 s.
    (dict(layers=10**8, layout="token-major"), "layers"),
    (dict(layers=10**7, layout="per-layer"), "layers"),
    # Within the layer bound, but 2 x 1,024 buffers x 65,536 ids of bookkeeping (3 GiB).
    (dict(layers=1024, max_batch=65536, layout="per-layer"), "max_batch"),
]


@pytest.mark.parametrize("backend", ["sim", "host"])
@pytest.mark.parametrize("kw, field", SHAPES_PAST_THE_BOUNDS)
def test_a_shape_past_what_is_allocated_up_front_is_refused_naming_the_field(backend, kw, field):
    """Run in a child: before, the process aborted ("memory allocation of 16000000000 bytes
    failed"), which a test in this process could not report."""
    code = textwrap.dedent(f"""
        import time, vmem
        t = time.monotonic()
        try:
            vmem.KVCache(**{dict(dict(kv_heads=2, head_dim=64, dtype="fp16", max_batch=4, max_context=1024,
                                     page_size="64K", backend=backend), **kw)!r})
            print("MADE")
        except vmem.InvalidArgument as e:
            print("REFUSED", round(time.monotonic() - t, 3), e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("REFUSED"), r.stdout
    _, seconds, message = r.stdout.split(" ", 2)
    assert float(seconds) < 2, r.stdout
    assert field in message and len(message) < 400, message


@pytest.mark.parametrize("backend", ["sim", "host"])
@pytest.mark.parametrize("kw, ops", [
    # 64 requests of 10**8 tokens: 64 x 400 Mi pages asked of one step.
    (dict(layers=1, max_context=10**8, max_batch=64), "ids = [kv.alloc() for _ in range(64)]\nkv.step({r: 10**8 for r in ids})"),
    # A token of 4 TiB: the one eager token of the next id is 64 Mi pages a buffer.
    (dict(head_dim=2**40, max_context=1, max_batch=4), "kv.step({kv.alloc(): 1})"),
])
def test_a_step_past_any_device_is_out_of_memory_at_once_not_a_hang(backend, kw, ops):
    """The default cap (the whole virtual size) let the simulation create pages for as long as a
    step or the eager allocation asked: past 60 s and gigabytes, then killed. A pool now holds at
    most 2**24 pages (1 TiB of 64 KiB pages), so these fail at once with OutOfMemory (or are
    refused up front on host memory, which cannot reserve such shapes or commit such pages)."""
    code = textwrap.dedent("""
        import sys, time, vmem
        t = time.monotonic()
        try:
            kv = vmem.KVCache(**eval(sys.argv[1]))
            exec(sys.argv[2])
            print("MAPPED")
        except (vmem.OutOfMemory, vmem.VmemError) as e:
            print(type(e).__name__, round(time.monotonic() - t, 3))
    """)
    args = dict(dict(kv_heads=2, head_dim=64, dtype="fp16", page_size="64K", backend=backend, overlap=False,
                     zero_page=False, layers=2), **kw)
    r = subprocess.run(["prlimit", "--as=6000000000", "--", sys.executable, "-c", code, repr(args), ops],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    name, seconds = r.stdout.split()
    assert name in ("OutOfMemory", "VmemError") and float(seconds) < 5, r.stdout
