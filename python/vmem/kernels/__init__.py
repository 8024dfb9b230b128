"""vmem's attention readers: kernels that read every request's K and V in place, in vmem rows
(``[rows, max_context, Hkv, D]`` per layer, each row one request, virtually contiguous), and the
bookkeeping they read. They know no serving engine: they import torch (and FlashInfer or Triton
only when chosen), never transformers; an engine's glue (:mod:`vmem.transformers` for
transformers' continuous batching) builds a round from its own scheduler and hands it to a reader.

A reader is called per layer as ``read(layer, round, query, K, V, scaling, gqa) -> [1, T, Hq, D]``
for ``query`` ``[1, Hq, T, D]`` and the flat ``[rows * max_context, Hkv, D]`` K/V views; a round
(:class:`~vmem.kernels.rounds.Round`) lists ``(row, past, q, _)`` per request in query order.
Every kernel has a CPU reference in plain tensor ops, which the tests compare it with.

========================  =======================================================================
module                    job
========================  =======================================================================
:mod:`.rows`              the table of rows: which request holds which row, blocks held, how far
                          mapped and computed (``RowTable``)
:mod:`.rounds`            one round's requests in query order, opened and closed by explicit
                          calls; the kernel's indices built once per round (``Round``, ``Rounds``)
:mod:`.blocks`            a round's freshly mapped blocks zeroed, every row at once (one kernel
                          over the token-major rows, or one per layer's K and V)
:mod:`.buffers`           a round's metadata in static device buffers written before the forward,
                          what CUDA graphs capture (``RoundBuffers``, ``RoundMeta``)
:mod:`.varlen`            one FlashAttention-2 varlen call over the rows: its host indices, the
                          call and its CPU reference
:mod:`.fa`                the FlashAttention reader (``FaReader``): which call a round gets
:mod:`.fa_split`          FA's padded decode rounds split along the keys (flash-decoding): the
                          slot plan, its buffers and the merge
:mod:`.fa_mixed`          FA's mixed rounds (a prompt chunk beside decodes): the decodes in a
                          call of their own, grouped heads reading each key once
:mod:`.fa_prompts`        the prompts of FA's eager rounds through FlashInfer's paged prefill
                          (``prompt_reader="flashinfer"``; ``PromptReader``)
:mod:`._triton_combine`   the merge as one Triton kernel (CUDA only, imported when used)
:mod:`._triton_decode`    vmem's slot kernel: a split round's slots read a KV head's whole query
                          group at a time (``split_reader="triton"``; CUDA only)
:mod:`.flex`              FlexAttention with a BlockMask built from index tensors (``FlexReader``),
                          its blockwise CPU reference
:mod:`.flashinfer`        FlashInfer over the rows as pages: the plan arrays, their CPU reference,
                          the checks; FlashInfer imported only by ``load_flashinfer``
:mod:`.fi_graphs`         the plan padded to a padded (CUDA-graph) round; FlashInfer's graph-mode
                          wrappers per IO pair, kind and batch (``WrapperSet``)
:mod:`.fi_reader`         the FlashInfer reader: plans before the forward, runs per layer
                          (``FlashInferReader``)
:mod:`.fa_fi`             ``kernel="fa+flashinfer"``: large decode rounds through FlashInfer's
                          reader, every other round through FA's (``FaFlashInferReader``)
========================  =======================================================================

The engine glue, and the whole integration's second table, is :mod:`vmem.transformers`.
"""

from __future__ import annotations

from .blocks import FreshBlocks
from .buffers import RoundBuffers, RoundMeta
from .fa import FaReader
from .fa_fi import FaFlashInferReader
from .fi_reader import FlashInferReader
from .flashinfer import paged_plan, paged_reference
from .flex import KV_BLOCK, Q_BLOCK, FlexReader, blockwise_reference
from .rounds import Round, Rounds
from .rows import RowTable
from .varlen import FaVarlenIndex, fa_varlen_indices, fa_varlen_reference

__all__ = [
    "KV_BLOCK",
    "Q_BLOCK",
    "FaFlashInferReader",
    "FaReader",
    "FaVarlenIndex",
    "FlashInferReader",
    "FlexReader",
    "FreshBlocks",
    "Round",
    "RoundBuffers",
    "RoundMeta",
    "Rounds",
    "RowTable",
    "blockwise_reference",
    "fa_varlen_indices",
    "fa_varlen_reference",
    "paged_plan",
    "paged_reference",
]
