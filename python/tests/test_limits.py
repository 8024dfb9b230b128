"""vmem.KVCache against the machine's limits: errors that name what to lower (#30, item 10)."""

import pytest

import vmem


def test_a_cache_past_the_address_space_names_batch_x_context_x_bytes_and_what_to_lower():
    # 2 layers x (K, V) x 2 heads x 64 x 2 bytes = 1,024 bytes a token; x 2^40 tokens = 1 PiB
    # of virtual memory, past the 47-bit user address space.
    with pytest.raises(vmem.VmemError) as e:
        vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="fp16", max_batch=1,
                     max_context=2**40, page_size="64K", backend="host")
    msg = str(e.value)
    for part in ["max_batch 1 x max_context 1099511627776 x 1024 bytes of K+V per token",
                 "= 1125899906842624 bytes", "of virtual memory", "host backend cannot reserve",
                 "lower max_batch or max_context"]:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_the_same_cache_at_a_context_that_fits_is_made():
    kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="fp16", max_batch=1,
                      max_context=2**20, page_size="64K", backend="host")
    assert kv.config()["max_context"] == 2**20
    kv.close()
