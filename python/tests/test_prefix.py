"""Prefix sharing through vmem.KVCache on the host backend: the same physical pages at the
start of several requests' rows, a bounded cache of finished requests' pages, and its counters."""

import re

import numpy as np
import pytest

import vmem

# 1 layer, 2 heads of 64 fp16: per-layer 256 B a token (256 tokens a 64 KiB page), token-major
# 512 B a token (128 tokens a page).
GEOM = dict(layers=1, kv_heads=2, head_dim=64, dtype="fp16", max_batch=4, max_context=4096,
            page_size="64K", device="cpu", overlap=False, eager_tokens=0)


def cache(layout="token-major", **kw):
    return vmem.KVCache(**dict(GEOM, layout=layout, **kw))


def fill(kv, req, n, seed):
    """Writes distinct values into every K and V position `< n` of row `req`; returns them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(kv.num_layers):
        for t in kv.layer(i):
            a = np.from_dlpack(t)
            a[req, :n] = rng.standard_normal(a[req, :n].shape).astype(np.float16)
            out.append(a[req, :n].copy())
    return out


def prefilled(kv, prompt, seed=0):
    """A new request that finds nothing cached, computes ``prompt`` (distinct K/V values) and
    publishes it: ``(id, what it wrote, blocks published)``."""
    a = kv.alloc()
    assert kv.adopt_prefix(a, prompt) == 0
    kv.step({a: len(prompt)})
    written = fill(kv, a, len(prompt), seed)
    return a, written, kv.publish_prefix(a, prompt)


def rows(kv, req, n):
    return [np.from_dlpack(t)[req, :n].copy() for i in range(kv.num_layers) for t in kv.layer(i)]


@pytest.mark.parametrize("layout", ["per-layer", "token-major"])
def test_an_adopted_prefix_is_the_same_memory_and_costs_no_new_pages(layout):
    kv = cache(layout, prefix_cache="1M")
    bt = kv.prefix_stats()["block_tokens"]
    assert bt == (256 if layout == "per-layer" else 128)
    prompt = list(range(1000, 1000 + 3 * bt + 17))  # 3 full blocks and a partial one
    a, written, published = prefilled(kv, prompt, seed=1)
    assert published == 3
    pages_before = kv.usage()["pool_created_pages"]

    b = kv.alloc()
    assert kv.adopt_prefix(b, np.array(prompt)) == 3 * bt  # a NumPy array works too
    kv.step({a: len(prompt), b: len(prompt)})
    # B reads A's K and V for the adopted tokens without a copy...
    for want, got in zip(written, rows(kv, b, 3 * bt)):
        assert np.array_equal(want[: 3 * bt], got)
    # ...because they are the same pages: a write through A's row shows through B's.
    K = np.from_dlpack(kv.layer(0)[0])
    K[a, 5] = 42.0
    assert (K[b, 5] == 42.0).all()
    # B maps only its own partial block (one page per buffer), not a second copy.
    buffers = kv.config()["buffers"]
    assert kv.usage()["pool_created_pages"] - pages_before == buffers
    s = kv.prefix_stats()
    assert s["hit_tokens"] == 3 * bt and s["blocks"] == 3
    assert s["shared_savings_bytes"] == 3 * buffers * 64 * 1024
    kv.close()


def test_a_published_prefix_outlives_its_request_and_a_later_one_adopts_it():
    # Without deferred reclamation the freed row is unmapped and the blocks stay, mapped by no one.
    kv = cache(prefix_cache="1M", deferred_reclaim=False)
    bt = kv.prefix_stats()["block_tokens"]
    prompt = list(range(5 * bt))
    a, written, _ = prefilled(kv, prompt, seed=2)
    kv.free(a)
    kv.step({})
    s = kv.prefix_stats()
    assert s["blocks"] == 5 and s["unmapped_bytes"] == 5 * 64 * 1024
    c = kv.alloc()
    # The whole prompt is cached, but its last token is always computed: 4 blocks adopted.
    assert kv.adopt_prefix(c, prompt) == 4 * bt
    kv.step({c: len(prompt)})
    for want, got in zip(written, rows(kv, c, 4 * bt)):
        assert np.array_equal(want[: 4 * bt], got)
    assert kv.prefix_stats()["unmapped_bytes"] == 1 * 64 * 1024
    kv.close()


def test_prompts_share_only_the_blocks_they_have_in_common():
    kv = cache(prefix_cache="1M")
    bt = kv.prefix_stats()["block_tokens"]
    first = list(range(4 * bt))
    prefilled(kv, first)
    second = first[: 2 * bt] + [7] + first[2 * bt + 1:]  # differs inside block 2
    b = kv.alloc()
    assert kv.adopt_prefix(b, second) == 2 * bt
    unrelated = [9] + first[1:]
    c = kv.alloc()
    assert kv.adopt_prefix(c, unrelated) == 0
    kv.close()


def test_publish_leaves_out_blocks_the_request_has_not_computed():
    kv = cache(prefix_cache="1M")
    bt = kv.prefix_stats()["block_tokens"]
    prompt = list(range(4 * bt))
    a = kv.alloc()
    kv.step({a: 2 * bt + 3})  # only 2 full blocks computed so far
    assert kv.publish_prefix(a, prompt) == 2
    assert kv.publish_prefix(a, prompt) == 0  # nothing new
    kv.close()


def test_under_deferred_reclamation_a_freed_rows_blocks_are_adopted_in_place():
    """Deferred reclamation (the default): a freed publisher's row keeps its blocks mapped; a
    request that starts another prompt is given another row (the blocks stay cached), and the next
    turn of the conversation, given the publisher's row by ``alloc_for_prefix``, adopts them where
    they are: nothing mapped, the values the publisher wrote."""
    kv = cache(prefix_cache="1M")
    bt = kv.prefix_stats()["block_tokens"]
    turn1 = list(range(3 * bt + 7))
    a, written, published = prefilled(kv, turn1, seed=4)
    assert published == 3
    kv.free(a)
    assert kv.request_pages(a) == [4], "deferred: the row keeps its pages"
    other = kv.alloc()
    assert other != a and kv.prefix_stats()["blocks"] == 3
    turn2 = turn1 + list(range(1000, 1000 + 2 * bt))
    b = kv.alloc_for_prefix(turn2)
    assert b == a
    created = kv.usage()["pool_created_pages"]
    assert kv.adopt_prefix(b, turn2) == 3 * bt
    assert kv.request_pages(b) == [4] and kv.usage()["pool_created_pages"] == created
    kv.step({b: len(turn2)})
    for want, got in zip(written, rows(kv, b, 3 * bt)):
        assert np.array_equal(want[: 3 * bt], got)
    assert kv.prefix_stats()["hit_tokens"] == 3 * bt
    kv.close()


def test_the_cap_bounds_unmapped_cached_pages_and_evicts_the_least_recently_used():
    kv = cache(prefix_cache="128K", deferred_reclaim=False)  # two unmapped pages at most
    bt = kv.prefix_stats()["block_tokens"]
    prompts = [[p] * (2 * bt) for p in (1, 2, 3)]
    for p in prompts:
        r = kv.alloc()
        kv.step({r: len(p)})
        kv.publish_prefix(r, p)
        kv.free(r)
        kv.step({})
        assert kv.prefix_stats()["unmapped_bytes"] <= 128 * 1024
    s = kv.prefix_stats()
    assert s["evicted_blocks"] == 4 and s["blocks"] == 2
    # The newest prompt is still cached (adopt stops a token short of the prompt), the oldest not.
    r = kv.alloc()
    assert kv.adopt_prefix(r, prompts[2] + [0]) == 2 * bt
    r2 = kv.alloc()
    assert kv.adopt_prefix(r2, prompts[0] + [0]) == 0
    kv.close()


def test_cached_pages_go_back_before_a_step_runs_out_of_memory():
    kv = cache(prefix_cache="10M", memory_cap="512K", deferred_reclaim=False)  # 8 pages in all
    bt = kv.prefix_stats()["block_tokens"]
    p = list(range(6 * bt))
    a = kv.alloc()
    kv.step({a: len(p)})
    kv.publish_prefix(a, p)
    kv.free(a)
    kv.step({})
    assert kv.prefix_stats()["unmapped_bytes"] == 6 * 64 * 1024
    b = kv.alloc()
    kv.step({b: 8 * bt})  # needs all 8 pages: the 6 cached ones are evicted, not an OOM
    assert kv.prefix_stats()["blocks"] == 0
    with pytest.raises(vmem.OutOfMemory):
        kv.step({b: 9 * bt})
    kv.close()


@pytest.mark.parametrize("tokens, words", [
    ([-1], "tokens[0] must be >= 0"),
    ([1, 2**32], "tokens[1] = 4294967296 is not a token id"),
    ([1.5], "tokens[0] must be an int"),
    ([True], "tokens[0] must be an int"),
    ("abc", "sequence of token ids"),
    (5, "sequence of token ids"),
    (None, "sequence of token ids"),
    (np.zeros((2, 2), dtype=np.int64), "tokens must be a 1-D sequence"),
])
def test_bad_token_ids_are_invalid_arguments_and_change_nothing(tokens, words):
    kv = cache(prefix_cache="1M")
    r = kv.alloc()
    for call in (kv.adopt_prefix, kv.publish_prefix):
        with pytest.raises(vmem.InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
            call(r, tokens)
    assert kv.prefix_stats()["blocks"] == 0 and not any(kv.request_pages(r))
    kv.close()


def test_sharing_calls_are_refused_where_sharing_is_off_or_the_request_is_not_active():
    off = cache()
    with pytest.raises(vmem.InvalidArgument, match="prefix caching off"):
        off.adopt_prefix(off.alloc(), [1, 2, 3])
    assert off.prefix_stats()["block_tokens"] == 0 and off.config()["prefix_cache"] is None
    off.close()
    kv = cache(prefix_cache=0)  # on, keeping nothing no request maps
    assert kv.config()["prefix_cache"] == 0
    with pytest.raises(vmem.VmemError, match="not active|inactive"):
        kv.adopt_prefix(3, [1, 2, 3])
    with pytest.raises(vmem.InvalidArgument):
        kv.publish_prefix(99, [1, 2, 3])
    for bad in (-1, "x", 1.5):
        with pytest.raises(vmem.InvalidArgument):
            cache(prefix_cache=bad)
    kv.close()


def test_a_device_tensor_of_token_ids_is_refused_before_it_syncs():
    class FakeCudaTensor:
        device = type("D", (), {"type": "cuda"})()

        def tolist(self):
            raise AssertionError("must not be read")

    kv = cache(prefix_cache="1M")
    with pytest.raises(vmem.InvalidArgument, match="on the CPU"):
        kv.adopt_prefix(kv.alloc(), FakeCudaTensor())
    kv.close()


def _published(kv):
    """A cache holding one published prompt of 2 full blocks and a bit: ``(prompt, block_tokens)``."""
    bt = kv.prefix_stats()["block_tokens"]
    prompt = list(range(2 * bt + 5))
    prefilled(kv, prompt)
    return prompt, bt


class _Cuda0d:
    """A 0-d CUDA tensor's look: must be refused, not read (a read would sync)."""
    ndim = 0
    dtype = "torch.int64"
    device = type("D", (), {"type": "cuda"})()

    def __index__(self):
        raise AssertionError("must not be read")


def test_token_ids_as_integer_scalars_of_numpy_are_accepted():
    # A list of NumPy ints (``list(array)``, ``[np.int64(t) ...]``) was refused ("tokens[0] must
    # be an int, got np.int64(0)") though the array itself is accepted.
    kv = cache(prefix_cache="1M")
    prompt, bt = _published(kv)
    for as_list in ([np.int64(t) for t in prompt], list(np.array(prompt, dtype=np.uint32)),
                    [np.uint64(t) for t in prompt]):
        r = kv.alloc()
        assert kv.adopt_prefix(r, as_list) == 2 * bt
        kv.free(r)
    kv.close()


@pytest.mark.parametrize("tokens, words", [
    (np.zeros((2, 3), dtype=np.int64), "1-D"),            # the message was the whole first row
    (np.zeros((1, 5000), dtype=np.int64), "1-D"),
    (np.array([True, False]), "not booleans"),          # bools are not token ids
    ([np.True_, 1], "tokens[0] must be an int"),
    ([[1, 2] * 5000], "tokens[0] must be an int"),     # one short line, not 10,000 ids
    ({1: 2, 3: 4}, "ordered sequence"),                 # a dict's keys went through as ids
    ({1, 2, 3}, "ordered sequence"),                    # a set's order is not a prompt's
    (bytearray(b"abc"), "sequence of token ids"),       # bytes were refused, bytearray not
    (memoryview(b"ab"), "sequence of token ids"),       # has tolist(): was taken as [97, 98]
    (memoryview(bytearray(b"ab")).cast("B"), "sequence of token ids"),
    ([_Cuda0d()], "on the CPU"),
    ([2**70], "not a token id"),                        # said "at most 2**64 - 1"
])
def test_token_ids_that_are_not_a_1d_sequence_of_ids_are_refused_in_one_line(tokens, words):
    kv = cache(prefix_cache="1M")
    _published(kv)
    r = kv.alloc()
    for call in (kv.adopt_prefix, kv.publish_prefix):
        with pytest.raises(vmem.InvalidArgument, match=re.escape(words)) as e:
            call(r, tokens)
        assert len(str(e.value)) < 200 and "\n" not in str(e.value), str(e.value)
    assert not any(kv.request_pages(r)) and kv.prefix_stats()["hit_tokens"] == 0
    kv.close()


def test_publishing_other_tokens_than_the_adopted_prefix_is_refused_and_poisons_nothing():
    # A request that adopted prompt P's blocks and then published tokens Q (a mistake: Q is not
    # what its row holds) cached its own blocks under Q's hashes; once a request computed Q's
    # first blocks, a later Q request adopted the poisoned blocks, with P's context, silently.
    kv = cache(prefix_cache="1M")
    bt = kv.prefix_stats()["block_tokens"]
    p = list(range(4 * bt))
    q = [t + 7 for t in p]
    a, _, _ = prefilled(kv, p[: 2 * bt + 1])  # caches P's 2 first blocks
    kv.free(a)
    d = kv.alloc()
    assert kv.adopt_prefix(d, p) == 2 * bt
    kv.step({d: len(p)})
    with pytest.raises(vmem.InvalidArgument, match="not the tokens"):
        kv.publish_prefix(d, q)
    assert kv.prefix_stats()["blocks"] == 2  # nothing cached under Q's hashes
    assert kv.publish_prefix(d, p) == 2  # its own tokens: blocks 2 and 3
    kv.free(d)
    # The same for a request that published once, then publishes other tokens.
    e, _, published = prefilled(kv, q[: 2 * bt + 1], seed=3)
    assert published == 2
    kv.step({e: 4 * bt})
    with pytest.raises(vmem.InvalidArgument, match="not the tokens"):
        kv.publish_prefix(e, p)
    assert kv.publish_prefix(e, q) == 2 and kv.prefix_stats()["blocks"] == 8
    # Fewer tokens than it holds, agreeing with them: nothing new, no error.
    assert kv.publish_prefix(e, q[:bt]) == 0
    kv.close()


def test_a_length_below_the_shared_pages_a_request_maps_is_refused_once_it_started():
    # A step gave an adopted request a shorter length (a restart in place, a rollback into the
    # prompt) and kept its shared pages mapped: the engine then recomputed positions from there
    # and wrote them into pages the publisher, other requests and the cache read.
    kv = cache(prefix_cache="1M")
    p = list(range(3 * 128 + 5))
    a, written, _ = prefilled(kv, p, seed=4)
    c = kv.alloc()
    assert kv.adopt_prefix(c, p) == 3 * 128
    kv.step({a: len(p)})  # c not started yet: 0 is fine
    with pytest.raises(vmem.InvalidArgument, match="shared prefix"):
        kv.step({a: len(p), c: 10})  # would write position 10 on: a shared page
    kv.step({a: len(p), c: len(p)})
    for bad in (10, 0):
        with pytest.raises(vmem.InvalidArgument, match="shared prefix"):
            kv.step({a: len(p), c: bad})
    with pytest.raises(vmem.InvalidArgument, match="shared prefix"):
        kv.step({a: 100, c: len(p)})  # the publisher is held to its published blocks too
    kv.step({a: len(p), c: 3 * 128})  # down to the shared pages themselves: nothing shared is written
    for want, got in zip(written, rows(kv, a, len(p))):
        assert np.array_equal(want, got)
    with pytest.raises(vmem.InvalidArgument, match=f"prefix sharing, request {c}: it has tokens already"):
        kv.adopt_prefix(c, p)  # adopting again, after steps
    kv.free(c)  # to start over, free it
    c = kv.alloc()
    assert kv.adopt_prefix(c, p) == 3 * 128
    kv.close()


def test_adopting_a_prefix_whose_blocks_the_rows_own_unmap_evicts_is_no_panic():
    """A call log (found by a random-call tester, shrunk): under deferred reclamation with a small
    prefix cache, ``adopt_prefix`` counted the cached run of the prompt's blocks, then unmapping
    the row's leftover pages (which go back to the cache past its cap) evicted one of them, and
    the lookup that followed panicked (a ``PanicException``, not a ``VmemError``). Every call now
    succeeds or raises a ``VmemError``, the last ``adopt_prefix`` (the one that panicked) returns,
    and what it adopted is mapped."""
    import json
    from pathlib import Path

    log = json.loads((Path(__file__).parent / "data" / "adopt_after_eviction.json").read_text())
    kv = vmem.KVCache(**log[0][1])
    adopted = None
    for name, args in log[1:]:
        args = [{int(k): v for k, v in a.items()} if isinstance(a, dict) else a for a in args]
        try:
            out = getattr(kv, name)(*args)
        except vmem.VmemError:
            continue
        if name == "adopt_prefix":
            adopted = (args[0], out)
    assert log[-1][0] == "adopt_prefix" and adopted is not None and adopted[0] == log[-1][1][0]
    req, tokens = adopted
    assert tokens >= 0 and kv.request_pages(req)[0] * kv.config()["tokens_per_page"] >= tokens
