"""vmem.vattention: vAttention's API, on host memory.

``init_kvcache`` returns torch tensors; where torch is not installed (scripts/test.sh python)
the test puts a stand-in module named ``torch`` whose ``from_dlpack`` is NumPy's, so every function of the
compatibility layer still runs for real. test_gpu.py runs it with torch on the GPU.
"""

import sys
import types

import numpy as np
import pytest

import vmem
import vmem.vattention as va


@pytest.fixture
def torch_or_numpy(monkeypatch):
    try:
        import torch  # noqa: F401

        yield "torch"
    except ImportError:
        fake = types.ModuleType("torch")
        fake.from_dlpack = np.from_dlpack
        monkeypatch.setitem(sys.modules, "torch", fake)
        yield "numpy"
    va.cleanup()


def test_the_vattention_workflow(torch_or_numpy):
    ts = va.init_kvcache(2, 2, 64, 4, 2048, "cpu", "float16", 65536)
    assert len(ts) == 4  # K of each layer, then V of each layer
    assert tuple(ts[0].shape) == (4, 2048, 2, 64)
    va.reserve_physical_pages(64 * 65536)
    r = va.alloc_new_batch_idx(300)
    assert r == 0
    lens = [0, 0, 0, 0]
    lens[r] = 300
    va.step(lens)
    ts[0][r, :300] = 1
    ts[2][r, :300] = 2  # layer 0's V
    assert float(ts[0][r, 299, 1, 63]) == 1 and float(ts[2][r, 0, 0, 0]) == 2
    free_before = va.num_free_kvblocks()
    va.free_batch_idx(r)  # deferred: the pages stay mapped
    assert va.num_free_kvblocks() > free_before
    assert va.alloc_new_batch_idx(200) == r  # best fit: the id holding the pages
    va.free_batch_idx(r)
    others = [va.alloc_new_batch_idx(10) for _ in range(4)]
    assert sorted(others) == [0, 1, 2, 3]
    assert va.alloc_new_batch_idx(10) == -1  # none free
    for i in others:
        va.free_batch_idx(i)
    va.step([0, 0, 0, 0], eager_reclaim=True)
    assert va.num_free_kvblocks() == 64 // 4
    va.set_deferred_reclamation(False)
    r = va.alloc_new_batch_idx(5)
    lens = [0, 0, 0, 0]
    lens[r] = 5
    va.step_async(lens)
    ts[1][r, :5] = 3
    assert float(ts[1][r, 4, 0, 0]) == 3
    va.free_batch_idx(r)  # deferred reclamation off: unmapped now
    va.show_kvcache_config()
    va.show_allocator_state()


def test_oom_says_oom_on_demand_and_is_a_runtime_error(torch_or_numpy):
    va.init_kvcache(2, 2, 64, 4, 2048, "cpu", "float16", 65536)
    va.reserve_physical_pages(8 * 65536)  # 2 pages per buffer
    r = va.alloc_new_batch_idx(2000)
    lens = [0, 0, 0, 0]
    lens[r] = 2000
    with pytest.raises(RuntimeError, match="^OOM on demand") as e:
        va.step_async(lens)
    assert isinstance(e.value, vmem.OutOfMemory)


def test_bad_arguments_raise_instead_of_aborting(torch_or_numpy):
    with pytest.raises(vmem.Closed):
        va.step([0])
    with pytest.raises(vmem.InvalidArgument):
        va.init_kvcache(2, 2, 64, 4, 2048, "tpu:0", "float16", 65536)
    va.init_kvcache(2, 2, 64, 4, 2048, "cpu", "float16", 65536)
    with pytest.raises(vmem.InvalidArgument):
        va.init_kvcache(2, 2, 64, 4, 2048, "cpu", "float16", 65536)  # twice
    with pytest.raises(vmem.InvalidArgument):
        va.alloc_new_batch_idx(-3)
    with pytest.raises(vmem.InvalidArgument):
        va.free_batch_idx(99)
    with pytest.raises(vmem.InvalidArgument):
        va.step([1, 0, 0, 0])  # id 0 not active
    with pytest.raises(vmem.InvalidArgument):
        va.step([0, 0])
    va.cleanup()
    with pytest.raises(vmem.Closed):
        va.num_free_kvblocks()


def test_reserving_the_gpus_free_memory_stops_at_the_virtual_size(torch_or_numpy):
    # vAttention's callers pass the device's free memory; this cache spans 8 MiB
    # (2 layers x K, V x 4 requests x 2048 tokens x 256 bytes).
    va.init_kvcache(2, 2, 64, 4, 2048, "cpu", "float16", 65536)
    va.reserve_physical_pages(1 << 40)
    u = va._get().usage()
    assert (u["physical_bytes"], u["cap_bytes"]) == (8 << 20, 8 << 20)
    # Through vmem.KVCache the same amount is refused: it could never be mapped.
    with pytest.raises(vmem.InvalidArgument, match="virtual size"):
        va._get().reserve_physical(1 << 40)


ARGS = dict(num_layers=2, num_kv_heads=2, head_size=64, max_batch_size=4, max_context_length=2048,
            device="cpu", dtype="float16", page_size=65536)


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_size", "max_batch_size",
                                  "max_context_length"])
@pytest.mark.parametrize("value", [2.0, "2", True, 0, -1])
def test_init_kvcache_refuses_a_shape_that_is_not_a_positive_int_naming_its_argument(
        torch_or_numpy, name, value):
    with pytest.raises(vmem.InvalidArgument, match=name):
        va.init_kvcache(**{**ARGS, name: value})
    with pytest.raises(vmem.Closed):  # nothing was configured
        va.num_free_kvblocks()


@pytest.mark.parametrize("value", [True, 65536.0, "lots", 0])
def test_init_kvcache_refuses_a_page_size_that_is_not_bytes(torch_or_numpy, value):
    with pytest.raises(vmem.InvalidArgument, match="page_size"):
        va.init_kvcache(**{**ARGS, "page_size": value})


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_the_flags_of_the_vattention_api_take_bools_only(torch_or_numpy, value):
    va.init_kvcache(**ARGS)
    with pytest.raises(vmem.InvalidArgument, match="eager_reclaim"):
        va.step([0, 0, 0, 0], eager_reclaim=value)
    with pytest.raises(vmem.InvalidArgument, match="flag"):
        va.set_deferred_reclamation(value)
    with pytest.raises(vmem.InvalidArgument, match="flag"):
        va.set_verbose(value)


@pytest.mark.parametrize("call,name", [
    (lambda: va.alloc_new_batch_idx(True), "seqlen"), (lambda: va.alloc_new_batch_idx(1.0), "seqlen"),
    (lambda: va.free_batch_idx("0"), "batch_idx"), (lambda: va.free_batch_idx(-1), "batch_idx"),
    (lambda: va.reserve_physical_pages(True), "free_memory"),
    (lambda: va.reserve_physical_pages(1.5e9), "free_memory"),
])
def test_the_vattention_calls_name_the_argument_they_refuse(torch_or_numpy, call, name):
    va.init_kvcache(**ARGS)
    with pytest.raises(vmem.InvalidArgument, match=name):
        call()
