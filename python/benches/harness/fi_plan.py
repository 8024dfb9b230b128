"""The ``fi-paged`` contender's round plan: the engine's block table turned into FlashInfer's paged
arguments (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``last_page_len``), and a pure-torch
reference of FlashInfer's paged attention over those arguments (what CPU tests run in place of
the kernels, and what pins down their meaning).

One round is the engine's scheduled requests, each ``(past, query, pages)``: ``query`` new
tokens after ``past`` cached ones, its K/V in ``pages`` (the kernel's page ids, in order). The
round's query tokens are the engine's packed ``[T]``, request after request; with CUDA graphs
the engine pads ``T`` (padding tokens after the real ones) and the number of sequences.

* **decode** (every request one new token): one FlashInfer request per query token, padding
  tokens included (each reads one token of the trash page): batch size ``T``.
* **prefill / mixed**: FlashInfer's batch is the engine's ``num_seqs`` (padded with empty
  requests, ``qo_len`` 0, one trash token) plus one request that holds the padding tokens (as
  many trash tokens as padding tokens, so it is causal-valid; its output is never read). Batch
  size ``num_seqs + 1``, fixed per graph key, as FlashInfer's graph mode demands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

Request = tuple[int, int, Sequence[int]]


class PlanError(ValueError):
    """A round the plan cannot express (the contender's bug or a misuse, never the user's data)."""


@dataclasses.dataclass(frozen=True)
class PagedRound:
    """FlashInfer's paged arguments for one round (int32, on the host). ``decode``: the decode
    wrapper's form (``qo_indptr`` is then ``arange(batch + 1)``)."""

    decode: bool
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def batch(self) -> int:
        """FlashInfer's batch size."""
        return int(self.kv_indptr.numel()) - 1


def plan_round(requests: Sequence[Request], page_size: int, trash_page: int, num_q_tokens: int,
               num_seqs: int | None = None) -> PagedRound:
    """The round's FlashInfer arguments (see the module doc); ``num_seqs``: the engine's padded
    sequence count (default: the requests). :class:`PlanError` on a request whose pages do not
    hold ``past + query`` tokens, or padding the round cannot hold."""
    if page_size <= 0:
        raise PlanError(f"page_size must be positive, got {page_size}")
    total = 0
    for past, query, pages in requests:
        kv = past + query
        if query <= 0 or past < 0 or len(pages) < math.ceil(kv / page_size):
            raise PlanError(f"request (past={past}, query={query}) with {len(pages)} pages of {page_size} tokens")
        total += query
    pad = num_q_tokens - total
    seqs = len(requests) if num_seqs is None else num_seqs
    if pad < 0 or seqs < len(requests):
        raise PlanError(f"{len(requests)} requests of {total} tokens in a round of {num_q_tokens} tokens, "
                        f"{seqs} sequences")
    decode = bool(requests) and all(q == 1 for _, q, _ in requests)
    qo, kv_lens, pages_of = [0], [], []
    for past, query, pages in requests:
        kv = past + query
        qo.append(qo[-1] + query)
        kv_lens.append(kv)
        pages_of.append(list(pages[:math.ceil(kv / page_size)]))
    # decode: one request per padding token, each reading one trash token; else empty sequences
    # and one request holding the padding tokens
    extra = [(1, 1)] * pad if decode else [(0, 1)] * (seqs - len(requests)) + [(pad, max(pad, 1))]
    for q, kv in extra:
        qo.append(qo[-1] + q)
        kv_lens.append(kv)
        pages_of.append([trash_page] * math.ceil(kv / page_size))
    indptr = [0]
    for p in pages_of:
        indptr.append(indptr[-1] + len(p))
    last = [kv - (len(p) - 1) * page_size for kv, p in zip(kv_lens, pages_of)]
    i32 = torch.int32
    return PagedRound(decode=decode, qo_indptr=torch.tensor(qo, dtype=i32), kv_indptr=torch.tensor(indptr, dtype=i32),
                      kv_indices=torch.tensor([x for p in pages_of for x in p], dtype=i32),
                      last_page_len=torch.tensor(last, dtype=i32))


def reference_paged_attention(rnd: PagedRound, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """What FlashInfer's paged wrappers compute (causal, bottom-right aligned, NHD pages
    ``[P, page_size, Hkv, D]``, GQA by head groups) for ``q`` ``[T, Hq, D]``: ``[T, Hq, D]``;
    rows no request covers (there are none in a plan of :func:`plan_round`) stay zero."""
    out = torch.zeros_like(q)
    page = k_pages.shape[1]
    group = q.shape[1] // k_pages.shape[2]
    qo, ind, last = rnd.qo_indptr.tolist(), rnd.kv_indptr.tolist(), rnd.last_page_len.tolist()
    idx = rnd.kv_indices.to(torch.long)
    for b in range(rnd.batch):
        n_q = qo[b + 1] - qo[b]
        if n_q == 0:
            continue
        pages = idx[ind[b]:ind[b + 1]]
        n_kv = (len(pages) - 1) * page + last[b]
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n_kv].repeat_interleave(group, dim=1)
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n_kv].repeat_interleave(group, dim=1)
        qb = q[qo[b]:qo[b + 1]]
        s = torch.einsum("qhd,khd->hqk", qb.float(), k.float()) * scale
        allowed = torch.arange(n_kv)[None, :] <= (n_kv - n_q + torch.arange(n_q))[:, None]
        s = s.masked_fill(~allowed[None], float("-inf"))
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out
