"""``kernel="flex"`` (and the block-table contender a bench registers): FlexAttention reading K/V
in place, with a ``BlockMask`` made from index tensors (``BlockMask.from_kv_blocks``), never by
evaluating a mask over the whole space; compiled once with ``dynamic=True`` on CUDA.

* decode rounds (every query is one token): for a row cache (vmem) each query is scattered to
  its row, Q is ``[rows, Hq, 1, D]``, K the ``[rows, Hkv, max_context, D]`` view, and row ``r``
  lists ``ceil(len_r / KV_BLOCK)`` KV blocks (rows without a query: 0); for a block-table cache Q
  is ``[B, Hq, 1, D]`` against the flat KV, each listing its physical blocks;
* other rounds (prefill chunks, mixed): packed Q ``[1, Hq, T, D]`` against the flat
  ``[1, Hkv, N, D]``; each Q block lists only the KV blocks of the requests whose tokens it
  holds, up to their causal limit; ``mask_mod`` keeps same request and ``kv_pos <= q_pos``.

A round with both makes one call of each kind. A block is a multiple of the KV block, so the last
KV block a request lists is mapped; newly mapped blocks are zeroed at the round's step (Flex reads
a whole KV block and masks scores, and a NaN bit pattern would still poison ``p @ V``).

On the CPU (not compiled) :func:`blockwise_reference` computes what Flex computes for the same
BlockMask, one Q block at a time over only the KV blocks it lists: its memory and time follow the
tokens in flight, not ``rows x max_context`` (eager Flex is not used: its internal tracing crashed
in the engine's thread on the second engine run of a process, torch 2.11). Engine-free.
"""

from __future__ import annotations

from typing import Any

import torch

from .rounds import Round

#: FlexAttention's KV block and Q block (tokens).
KV_BLOCK = 128
Q_BLOCK = 128

_compiled_flex: list[Any] = []


def blockwise_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any = None,
                        scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """What Flex computes for ``block_mask``, in plain tensor ops: for each batch entry and Q
    block, the KV blocks it lists are gathered, ``mask_mod`` is evaluated on those positions
    only, and SDPA runs over them. Q blocks listing nothing give zeros. ``query`` ``[B, Hq, T,
    D]``, ``key``/``value`` ``[B or 1, Hkv, N, D]``; returns ``[B, Hq, T, D]``."""
    qbs, kbs = block_mask.BLOCK_SIZE
    nums = block_mask.kv_num_blocks[:, 0].tolist()  # [B][nQB]
    lists = block_mask.kv_indices[:, 0].tolist()  # [B][nQB][W]
    q_len, kv_len = query.shape[2], key.shape[2]
    out = query.new_zeros(query.shape)
    within = torch.arange(kbs)
    for b, per_qb in enumerate(nums):
        kb = b if key.shape[0] > 1 else 0
        for qb, n in enumerate(per_qb):
            q0, q1 = qb * qbs, min(q_len, (qb + 1) * qbs)
            if n == 0 or q0 >= q_len:
                continue
            kv = (torch.tensor(lists[b][qb][:n]).view(-1, 1) * kbs + within).flatten()
            kv = kv[kv < kv_len].to(query.device)
            qi = torch.arange(q0, q1, device=query.device).view(-1, 1)
            mask = block_mask.mask_mod(torch.tensor(b, device=query.device), 0, qi, kv.view(1, -1))
            o = torch.nn.functional.scaled_dot_product_attention(
                query[b:b + 1, :, q0:q1], key[kb:kb + 1, :, kv], value[kb:kb + 1, :, kv],
                attn_mask=mask.view(1, 1, q1 - q0, -1), scale=scale, enable_gqa=enable_gqa)
            out[b, :, q0:q1] = o[0]
    return out


def compiled_flex() -> Any:
    """FlexAttention compiled once (``dynamic=True``); falling back to eager Flex would read every
    position of the flat KV (unmapped memory on the GPU): recompiling past the limit fails loudly."""
    if not _compiled_flex:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
        _compiled_flex.append(torch.compile(flex_attention, dynamic=True))
    return _compiled_flex[0]


class _Part:
    """One Flex call of a round: ``kind`` "rows" (vmem decode: Q scattered to rows), "bcast"
    (block-table decode: Q ``[B, Hq, 1, D]`` against the flat KV) or "packed"; ``tok`` the
    round's query tokens it computes (None: all), ``rows`` the rows of a "rows" part."""

    __slots__ = ("kind", "mask", "rows", "tok")

    def __init__(self, kind: str, mask: Any, tok: torch.Tensor | None, rows: torch.Tensor | None = None):
        self.kind, self.mask, self.tok, self.rows = kind, mask, tok, rows


def _build_mask(src: FlexReader, rnd: Round, t_total: int, device: torch.device) -> list[_Part]:
    """The round's Flex calls: decodes (one query token) in one call, other requests (prefill
    chunks) packed in another; a round of one kind is one call."""
    entries = rnd.entries
    starts, pos = [], 0
    for _, _, q, _ in entries:
        starts.append(pos)
        pos += q
    dec = [i for i, e in enumerate(entries) if e[2] == 1]
    pre = [i for i, e in enumerate(entries) if e[2] != 1]
    mixed = bool(dec) and bool(pre)
    parts: list[_Part] = []

    def tok_of(idx: list[int]) -> torch.Tensor | None:
        if not mixed:
            return None
        t = [p for i in idx for p in range(starts[i], starts[i] + entries[i][2])]
        return torch.tensor(t, dtype=torch.int64).to(device, non_blocking=True)

    if dec:
        sub = [entries[i] for i in dec]
        if src.flat_kv:
            mask, rows = _rows_decode_mask(src, sub, device)
            parts.append(_Part("rows", mask, tok_of(dec), rows))
        else:
            parts.append(_Part("bcast", _bcast_decode_mask(src, sub, device), tok_of(dec)))
    if pre:
        sub = [entries[i] for i in pre]
        parts.append(_Part("packed", _packed_mask(src, sub, sum(e[2] for e in sub), device), tok_of(pre)))
    return parts


def _rows_decode_mask(src: FlexReader, entries: list[Any], device: torch.device) -> tuple[Any, torch.Tensor]:
    """vmem decode: row r lists ceil(len_r / KV_BLOCK) blocks of its own ``max_context`` row."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, ctx = src.rows, src.max_context
    nkv = ctx // KV_BLOCK
    lengths = torch.zeros(rows, dtype=torch.int32)
    qrows = torch.empty(len(entries), dtype=torch.int64)
    for i, (row, past, _, _) in enumerate(entries):
        lengths[row] = past + 1
        qrows[i] = row
    num = (lengths + (KV_BLOCK - 1)) // KV_BLOCK
    lengths_d = lengths.to(device, non_blocking=True)
    idx = src.decode_indices
    if idx is None or idx.device != device:
        idx = torch.arange(nkv, dtype=torch.int32, device=device).expand(rows, 1, 1, nkv).contiguous()
        src.decode_indices = idx

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lengths_d[b]

    mask = BlockMask.from_kv_blocks(
        num.view(rows, 1, 1).to(device, non_blocking=True), idx, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(1, ctx), compute_q_blocks=False,
    )
    return mask, qrows.to(device, non_blocking=True)


def _block_owners(src: FlexReader, entries: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-table caches: each physical block's owner (index in ``entries``) and first position."""
    n_phys = src.kv_len // src.block_size
    blk_owner = torch.full((n_phys,), -2, dtype=torch.int32)
    blk_base = torch.zeros(n_phys, dtype=torch.int32)
    for i, (_, _, _, kv) in enumerate(entries):
        for j, b in enumerate(kv[1]):
            blk_owner[b] = i
            blk_base[b] = j * src.block_size
    return blk_owner, blk_base


def _bcast_decode_mask(src: FlexReader, entries: list[Any], device: torch.device) -> Any:
    """Block-table decode: entry b lists the KV blocks of its physical blocks up to its length."""
    from torch.nn.attention.flex_attention import BlockMask

    n = len(entries)
    lists = [torch.tensor(kv[0][: -(-(past + 1) // KV_BLOCK)], dtype=torch.int32) for _, past, _, kv in entries]
    width = max(1, max(len(x) for x in lists))
    kv_indices = torch.zeros((n, 1, 1, width), dtype=torch.int32)
    kv_num = torch.zeros((n, 1, 1), dtype=torch.int32)
    qpos = torch.zeros(n, dtype=torch.int32)
    for i, x in enumerate(lists):
        kv_indices[i, 0, 0, : len(x)] = x
        kv_num[i, 0, 0] = len(x)
        qpos[i] = entries[i][1]
    blk_owner, blk_base = _block_owners(src, entries)
    blk_owner_d, blk_base_d = blk_owner.to(device, non_blocking=True), blk_base.to(device, non_blocking=True)
    qpos_d = qpos.to(device, non_blocking=True)
    bs = src.block_size

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        g = kv_idx // bs
        return (blk_owner_d[g] == b) & (blk_base_d[g] + kv_idx % bs <= qpos_d[b])

    return BlockMask.from_kv_blocks(
        kv_num.to(device, non_blocking=True), kv_indices.to(device, non_blocking=True), BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(1, src.kv_len), compute_q_blocks=False,
    )


def _packed_mask(src: FlexReader, entries: list[Any], t_total: int, device: torch.device) -> Any:
    """Packed Q ``[1, Hq, T, D]`` against the flat KV: each Q block lists the KV blocks of the
    requests whose tokens it holds, up to their causal limit. The KV's owner and position come
    from its index (vmem: row = kv // max_context; block table: the physical block's owner and
    first position)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_qb = -(-t_total // Q_BLOCK)
    tq = n_qb * Q_BLOCK
    q_owner = torch.full((tq,), -1, dtype=torch.int32)
    q_pos = torch.zeros(tq, dtype=torch.int32)
    lists: list[list[Any]] = [[] for _ in range(n_qb)]
    start = 0
    paged = not src.flat_kv
    for i, (owner, past, q, kv) in enumerate(entries):
        end = start + q
        q_owner[start:end] = i if paged else owner
        q_pos[start:end] = torch.arange(past, past + q, dtype=torch.int32)
        qb = start // Q_BLOCK
        while qb * Q_BLOCK < end:
            last = min(end, (qb + 1) * Q_BLOCK) - 1  # last query token of this request in this Q block
            n_kv = -(-(past + (last - start) + 1) // KV_BLOCK)  # causal limit
            if paged:
                lists[qb].append(torch.tensor(kv[0][:n_kv], dtype=torch.int32))
            else:
                first = owner * (src.max_context // KV_BLOCK)
                lists[qb].append(torch.arange(first, first + n_kv, dtype=torch.int32))
            qb += 1
        start = end
    flat = [torch.cat(lst) if lst else torch.zeros(0, dtype=torch.int32) for lst in lists]
    width = max(1, max(len(f) for f in flat))
    kv_indices = torch.zeros((1, 1, n_qb, width), dtype=torch.int32)
    kv_num = torch.zeros((1, 1, n_qb), dtype=torch.int32)
    for qb, f in enumerate(flat):
        kv_num[0, 0, qb] = len(f)
        kv_indices[0, 0, qb, : len(f)] = f
    q_owner_d = q_owner.to(device, non_blocking=True)
    q_pos_d = q_pos.to(device, non_blocking=True)
    kv_len = src.kv_len
    if paged:
        bs = src.block_size
        blk_owner, blk_base = _block_owners(src, entries)
        blk_owner_d = blk_owner.to(device, non_blocking=True)
        blk_base_d = blk_base.to(device, non_blocking=True)

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            g = kv_idx // bs
            return (blk_owner_d[g] == q_owner_d[q_idx]) & (blk_base_d[g] + kv_idx % bs <= q_pos_d[q_idx])
    else:
        ctx = src.max_context

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx // ctx == q_owner_d[q_idx]) & (kv_idx % ctx <= q_pos_d[q_idx])

    return BlockMask.from_kv_blocks(
        kv_num.to(device, non_blocking=True), kv_indices.to(device, non_blocking=True),
        BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, seq_lengths=(t_total, kv_len), compute_q_blocks=False,
    )


class FlexReader:
    """The Flex reader of a cache: ``flat_kv`` (a vmem row cache: decodes read rows) or a block
    table (``flat_kv`` False: ``blocks_of`` gives a round entry's physical blocks). Builds the
    round's calls at the first layer; every layer reuses them."""

    def __init__(self, cache: Any, compiled: bool) -> None:
        self.cache = cache
        self.flat_kv = bool(cache.flat_kv)
        self.block_size = cache.block_size
        self.kv_len = cache.key_cache[0].shape[0]
        self.rows = getattr(cache, "rows", 0)
        self.max_context = getattr(cache, "max_context", 0)
        self.decode_indices: torch.Tensor | None = None
        self.flex = compiled_flex() if compiled else blockwise_reference

    def __call__(self, layer: int, rnd: Round, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
        """Returns ``[1, T, Hq, D]`` for ``query`` ``[1, Hq, T, D]``."""
        t = query.shape[2]
        if rnd.index is None:  # the first layer of this round's forward: build once, every layer reuses it
            rnd.index = _build_mask(self, rnd, t, query.device)
        parts = rnd.index
        if len(parts) == 1 and parts[0].tok is None:
            return self._run_part(parts[0], layer, query, k_cache, v_cache, scaling, gqa)
        hq, d = query.shape[1], query.shape[3]
        out = query.new_empty((1, t, hq, d))
        for part in parts:
            out[:, part.tok] = self._run_part(part, layer, query[:, :, part.tok], k_cache, v_cache, scaling, gqa)
        return out

    def _run_part(self, part: _Part, layer: int, query: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scaling: float | None, gqa: bool) -> torch.Tensor:
        """One Flex call over this part's queries ``[1, Hq, t, D]``; returns ``[1, t, Hq, D]``."""
        hq, d = query.shape[1], query.shape[3]
        if part.kind == "rows":
            rows = part.rows
            k4, v4 = self.cache.kv_rows(layer)
            q = query.new_zeros((k4.shape[0], hq, 1, d))
            q[rows] = query[0].transpose(0, 1).unsqueeze(2)  # [t, Hq, 1, D]
            out = self.flex(q, k4.transpose(1, 2), v4.transpose(1, 2), block_mask=part.mask, scale=scaling,
                            enable_gqa=gqa)
            return out[rows].squeeze(2).unsqueeze(0)
        kf = k_cache.transpose(0, 1).unsqueeze(0)  # [1, Hkv, N, D]
        vf = v_cache.transpose(0, 1).unsqueeze(0)
        if part.kind == "bcast":
            q = query[0].transpose(0, 1).unsqueeze(2)  # [t, Hq, 1, D]
            out = self.flex(q, kf, vf, block_mask=part.mask, scale=scaling, enable_gqa=gqa)
            return out.squeeze(2).unsqueeze(0)
        out = self.flex(query, kf, vf, block_mask=part.mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2)
