"""``host_cost.py``'s ``NAME@before`` contenders: vmem's engine hooks as they were before issue #32's
host-cost cuts, patched in for one run so that before and after run interleaved in one process
(docs/serving.md, "Host cost per round"). Each function here is the replaced code, unchanged:

* ``flush``: zeroed each grown row's new tokens with two ``zero_`` per layer (``2 x layers``
  kernels per row that grew), now one ``index_fill_`` per layer's K and V for all rows;
* ``distinct_mapped_bytes``: two dict-building calls (``usage()``, ``prefix_stats()``), now one
  call returning an int (``KVCache.distinct_mapped_bytes``);
* ``Tenant.budget_blocks`` / ``Tenant.yield_room``: read the tenant slot (a dict) even outside a pool;
* ``paged_attention``: sliced the write index twice per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vmem.transformers import tenancy


def flush(self: Any) -> None:
    with self.lock:
        self.tenant.on_round()
        if not self.table.dirty:
            return
        self.tenant.step()
    for index, old, new in self.table.mapped():
        for k, v in zip(self._k4, self._v4):
            k[index, old:new].zero_()
            v[index, old:new].zero_()
    self.steps += 1
    self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.distinct_mapped_bytes())


def distinct_mapped_bytes(self: Any) -> int:
    mapped = int(self.kv.usage()["mapped_bytes"])
    return mapped - int(self.kv.prefix_stats()["shared_savings_bytes"]) if self.sharing else mapped


def budget_blocks(tenant: Any) -> int:
    t = tenant.kv._rs.tenant()
    if t is None:
        return int(tenant.blocks)
    block = int(tenant.block_bytes)
    room = min(int(t["limit"]), int(t["pool_total"]) - int(t["pool_used"]) + int(t["usage"]))
    return min(int(tenant.blocks), room // block - 1)


def yield_room(tenant: Any, now: Any = None) -> int:
    kv = tenant.kv
    if kv.asleep:
        return 0
    t = kv._rs.tenant()
    if t is None:
        return 0
    total = int(t["pool_total"])
    if total - int(t["pool_used"]) >= total // tenancy.LOW_WATER:
        return 0
    u = kv.usage()
    if int(u["physical_bytes"]) <= int(u["active_mapped_bytes"]):
        return 0
    return int(kv.shrink()["total"])


def paged_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any = None,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    cache: Any = kwargs.get("cache")
    read = cache.read
    layer = module.layer_idx
    write_index = kwargs["write_index"][0]
    k_cache, v_cache = cache.kv_layer(layer)
    t = query.shape[2]
    k_cache.index_copy_(0, write_index[:t], key.transpose(1, 2).squeeze(0))
    v_cache.index_copy_(0, write_index[:t], value.transpose(1, 2).squeeze(0))
    rnd = cache.rounds.close()
    return read(layer, rnd, query, k_cache, v_cache, scaling, query.shape[1] != key.shape[1]), None


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """The code above in place of the package's, until the block ends."""
    from transformers import AttentionInterface

    import vmem.transformers as vt
    from vmem.transformers import VMEM_ATTENTION

    cls = vt.cache_class()
    saved: list[tuple[Any, str, Any, bool]] = []

    def put(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, owner.__dict__.get(name), name in owner.__dict__))
        setattr(owner, name, value)

    put(cls, "flush", flush)
    put(cls, "distinct_mapped_bytes", distinct_mapped_bytes)
    put(tenancy.Tenant, "budget_blocks", budget_blocks)
    put(tenancy.Tenant, "yield_room", yield_room)
    keys = (VMEM_ATTENTION, f"paged|{VMEM_ATTENTION}")
    attention = {k: AttentionInterface._global_mapping[k] for k in keys}
    for k in keys:
        AttentionInterface.register(k, paged_attention)
    try:
        yield
    finally:
        for k, fn in attention.items():
            AttentionInterface.register(k, fn)
        for owner, name, value, own in reversed(saved):
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
