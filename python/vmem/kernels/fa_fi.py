"""``kernel="fa+flashinfer"``: FlashAttention (:class:`~vmem.kernels.fa.FaReader`) for every
round but a large decode round, which FlashInfer's decode kernel reads
(:class:`~vmem.kernels.fi_reader.FlashInferReader`). Engine-free.

Why two kernels: in a decode round with many long rows FlashAttention-2's grouped-query decode
runs 64-row tiles over a group's few query heads, where FlashInfer's tensor-core decode reads the
keys near the copy bandwidth (docs/serving.md: 1.17x the peer's throughput when every request
fits, against FA's 1.02x, on Llama-3-8B's shapes); with few rows FlashAttention was the faster of
the two, prompts and mixed rounds are FlashAttention's (its mixed-round split, :mod:`.fa_mixed`),
and FlashInfer's prefill wrappers under CUDA graphs hold a workspace sized for the padded round
(about 2.9 GB for 8,192 tokens of 32 heads). Here FlashInfer plans only decode rounds, so its
workspace is sized for the largest decode round instead (about 0.35 GB for 256).

Which kernel reads a round is decided before its forward from its size alone: a decode round
(every request one query token) of at least ``decode_min`` sequences and at most the
FlashInfer reader's ``max_tokens`` (a padded round's padded count, which the engine's graph key
fixes, so a replayed graph always reads through the kernel it was captured with) goes to
FlashInfer, every other round to FlashAttention.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError
from .fa import FaReader
from .fi_reader import FlashInferReader, PlannedRound
from .rounds import Round

#: The fewest sequences of a decode round FlashInfer reads: an estimate between the two
#: measured cases, not a measured crossover. Rounds of 12-20 decodes (padded to 64 under the
#: engine's graphs) were faster with FA end to end, rounds of 120-128 (padded to 128) with
#: FlashInfer; 96 sends the first to FA and the second to FlashInfer, padded or not.
DECODE_MIN = 96
#: A padded decode round's sequences are its requests rounded up to the engine's query padding
#: (``q_padding_interval_size``, 64 by default in transformers' continuous batching): the
#: largest decode round FlashInfer's workspace is sized for is the most requests a round holds,
#: rounded up to this. A larger padding makes a round larger than that, which FA reads instead.
DECODE_PAD = 64


class FaFlashInferReader:
    """The ``kernel="fa+flashinfer"`` reader: ``fa`` (a :class:`FaReader`) and ``fi`` (a
    :class:`FlashInferReader` whose ``max_tokens``, the largest round it reads, sizes its
    workspace); decode rounds of ``decode_min`` (:data:`DECODE_MIN` when ``None``) to
    ``fi.max_tokens`` sequences go to ``fi``, the rest to ``fa``."""

    def __init__(self, fa: FaReader, fi: FlashInferReader, decode_min: int | None = None) -> None:
        decode_min = DECODE_MIN if decode_min is None else decode_min
        if isinstance(decode_min, bool) or not isinstance(decode_min, int) or decode_min < 1:
            raise VmemError(f"decode_min must be a whole number of sequences from 1, got {decode_min!r}")
        self.fa, self.fi, self.decode_min = fa, fi, decode_min

    def reads_with_flashinfer(self, rnd: Round, padded: bool) -> bool:
        """Whether FlashInfer reads ``rnd``: a decode round of at least ``decode_min`` sequences
        (padded: the round's padded sequences; unpadded: its requests, each one query token), and
        at most the ``max_tokens`` FlashInfer's workspace was sized for (a larger one, FA)."""
        if padded:
            meta = rnd.meta
            n = meta.n if meta is not None and meta.decode else 0
        else:
            n = len(rnd.entries) if all(q == 1 for _, _, q, _ in rnd.entries) else 0
        return self.decode_min <= n <= self.fi.max_tokens

    def before_forward(self, rnd: Round, *, padded: bool, pair: int, stream: Any) -> None:
        """Hands the round to the reader that reads it, which plans it (outside any capture)."""
        reader = self.fi if self.reads_with_flashinfer(rnd, padded) else self.fa
        reader.before_forward(rnd, padded=padded, pair=pair, stream=stream)

    def __call__(self, layer: int, rnd: Round, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
        """Returns ``[1, T, Hq, D]`` for ``query`` ``[1, Hq, T, D]``: FlashInfer's for a round it
        planned, else FlashAttention's (a round run outside the engine hook included)."""
        reader = self.fi if isinstance(rnd.index, PlannedRound) else self.fa
        return reader(layer, rnd, query, k_cache, v_cache, scaling, gqa)
