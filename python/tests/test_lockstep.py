"""KVCache.decision_digest: caches fed the same calls agree; a different call shows."""

import vmem


def cache():
    return vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="fp16", max_batch=4,
                        max_context=1024, page_size="64K", device="cpu", overlap=False)


def run(kv, extra=0):
    out = []
    r = kv.alloc()
    for n in range(1, 40):
        kv.step({r: 25 * n + (extra if n == 20 else 0)})
        out.append(kv.decision_digest())
    kv.free(r)
    out.append(kv.decision_digest())
    return out


def test_same_calls_give_equal_digests_and_a_different_call_shows():
    a, b, c = cache(), cache(), cache()
    da, db, dc = run(a), run(b), run(c, extra=300)
    assert da == db
    value, steps, calls = da[-1]
    assert (steps, calls) == (39, 41)
    assert isinstance(value, int) and 0 <= value < 1 << 64
    assert dc[:19] == da[:19] and dc[19] != da[19]
    for kv in (a, b, c):
        kv.close()


def test_a_prefix_adoption_shows_in_the_digest():
    """Two ranks, one adopting a cached 512-token prefix and one none: their digests differ at
    that call and after the next step (before, both were equal: adoptions were not folded in)."""
    prompt = list(range(1024))

    def rank(adopt):
        kv = vmem.KVCache(layers=1, kv_heads=2, head_dim=64, dtype="fp16", max_batch=4, max_context=4096,
                          page_size="64K", device="cpu", overlap=False, eager_tokens=0, layout="token-major",
                          prefix_cache="1M")
        a = kv.alloc()
        kv.step({a: len(prompt)})
        kv.publish_prefix(a, prompt)
        kv.free(a)
        b = kv.alloc()
        before = kv.decision_digest()
        if adopt:
            assert kv.adopt_prefix(b, prompt[:513]) == 512
        after = kv.decision_digest()
        kv.step({b: 600})
        out = (before, after, kv.decision_digest())
        kv.close()
        return out

    adopting, other, same = rank(True), rank(False), rank(True)
    assert adopting[0] == other[0]
    assert adopting[1] != other[1] and adopting[2] != other[2]
    assert adopting == same
