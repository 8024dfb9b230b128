"""The engine's CUDA graphs over a vmem cache: the round's metadata written before each forward
(into :class:`~vmem.kernels.buffers.RoundBuffers`, which the graphs capture), the round's kind in
the engine's graph key, and what of the engine's graph switches a vmem cache supports. Version-free.

* A decode-only padded round and a mixed round of the same padded size are different graphs:
  :func:`.hooks.graph_key` adds the round's kind (``cache.round_kind``) to the engine's graph key,
  and drops from it the engine's padded KV read, which vmem's forward does not depend on.
* :func:`.hooks.write_round_first` wraps the engine's ``ModelRunner.compute_batch``: the round's metadata is
  written before every forward, graphed or not (one path); a reader with a host-side plan
  (``kernel="flashinfer"``) plans it there too, on the compute stream, outside any capture.
* Padded tokens write at the trash row: the engine's ``write_trash_index``, the cache's
  ``trash_row * max_context``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._vmem import InvalidArgument
from ..kernels.rounds import Round
from .compiled import check_compile, refuse_compile

if TYPE_CHECKING:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.model_runner import ModelRunner

#: The round kinds a padded round's graph key carries (:func:`.hooks.graph_key`).
DECODE, VARLEN = "decode", "varlen"


def graphs_requested(cb: ContinuousBatchingConfig) -> bool:
    """Whether the engine's config turns CUDA graphs on (5.17-5.25: ``cuda_graph_booleans`` once
    resolved; before that ``use_cuda_graph``, a bool or a ``(varlen, decode)`` pair)."""
    if hasattr(cb, "cuda_graph_booleans"):
        try:
            return any(cb.cuda_graph_booleans)
        except (TypeError, AttributeError):
            pass
    value = getattr(cb, "use_cuda_graph", None)
    return any(value) if isinstance(value, tuple | list) else bool(value)


def refuse_graphs(cb: ContinuousBatchingConfig, name: str) -> None:
    """Refuses an engine config with CUDA graphs, a compiled forward or async batching for ``name``
    (a cache whose kernel indices are rebuilt on the host every round, e.g. a bench contender)."""
    if graphs_requested(cb):
        raise InvalidArgument(
            f"{name}: CUDA graphs are not supported (the kernel's indices are rebuilt on the host every round); "
            "leave use_cuda_graph unset or False"
        )
    refuse_compile(cb, name)
    if cb.use_async_batching:
        raise InvalidArgument(f"{name}: async batching is not supported")


#: Kernels whose per-round state is built on the host inside the forward: why a replay goes wrong.
#: (``kernel="flashinfer"`` plans before the forward, into its graph wrappers' fixed buffers.)
_NOT_REPLAYABLE = {
    "flex": "Flex's BlockMask is rebuilt on the host from each round's lengths inside the forward",
}


def check_engine_config(cb: ContinuousBatchingConfig, name: str, kernel: str) -> None:
    """What vmem's cache supports of the engine's graph switches: CUDA graphs and async batching
    with ``kernel="fa"`` (its metadata is in :class:`RoundBuffers`) and ``kernel="flashinfer"``
    (planned before the forward into the fixed buffers of FlashInfer's CUDA-graph wrappers, one
    set per padded size, round kind and IO pair: :mod:`.fi_graphs`); with ``kernel="flex"``
    neither (its BlockMask is rebuilt on the host from the round's lengths inside the forward, so
    a replay would reuse the captured round's mask); a compiled forward as :func:`check_compile`
    says."""
    reason = _NOT_REPLAYABLE.get(kernel)
    if reason is not None and (graphs_requested(cb) or cb.use_async_batching):
        what = "CUDA graphs" if graphs_requested(cb) else "async batching"
        raise InvalidArgument(
            f"{name}: {what} with kernel='{kernel}' is not supported: {reason}, so a replayed graph would "
            "read the captured round's; use kernel='fa', kernel='flashinfer' or kernel='fa+flashinfer' (their "
            "round metadata lives in static device buffers) or leave use_cuda_graph unset"
        )
    check_compile(cb, name, kernel)


def _bucket_k(batch_data: dict[str, Any]) -> int | None:
    """The engine's ``max_seqlen_k`` (5.17) or ``max_length_k`` (5.19+) for full attention."""
    value = batch_data.get("max_length_k", batch_data.get("max_seqlen_k"))
    if isinstance(value, dict):
        value = value.get("full_attention")
    return None if value is None else int(value)


def round_kind(entries: list[tuple[int, int, int]]) -> str:
    """:data:`DECODE` when every request of the round has one query token, else :data:`VARLEN`."""
    return DECODE if all(q == 1 for _, _, q in entries) else VARLEN


def prepare_round(cache: Any, batch_data: dict[str, Any], padded: bool, stream: Any, pair: int = 0) -> Round:
    """Closes the round the engine prepared and writes its metadata into the cache's buffers
    (``cache.round_buffers``), before the forward; sets ``cache.round_kind`` (the graph key's
    part, ``None`` unpadded); lets the reader plan (``cache.read.before_forward``, when it has
    one) for IO pair ``pair``; returns the round with ``meta`` set."""
    rnd: Round = cache.rounds.close()  # closed first: a refused round never leaks into the next
    entries = [(row, past, q) for row, past, q, _ in rnd.entries]
    kind = round_kind(entries)
    cache.round_kind = None
    rnd.meta = cache.round_buffers.fill(
        entries, sequences=int(batch_data["cu_seq_lens_q"].numel()) - 1, tokens=int(batch_data["input_ids"].shape[-1]),
        padded=padded, bucket_k=_bucket_k(batch_data), seqlen_k=cache.options.graph_seqlen_k, stream=stream,
        decode=kind == DECODE,
    )
    rnd.pair = pair
    if padded:
        cache.round_kind = kind
    before = getattr(getattr(cache, "read", None), "before_forward", None)
    if before is not None:
        before(rnd, padded=padded, pair=pair, stream=stream)
    return rnd


@contextlib.contextmanager
def without_varlen_graph(runner: ModelRunner) -> Iterator[None]:
    """The engine's ``runner`` (a ``ModelRunner``) runs varlen forwards without a CUDA graph
    inside the block (none captured, none replayed); its ``use_cuda_graph_varlen`` is put back
    after. The forward's tensors come from the graphs' memory pool (``runner.mem_pool``), as the
    engine's own forward before each capture does: a large prefill's activations then reuse the
    memory the graphs' activations hold between replays, on the stream that replays them, rather
    than add a second reserve of the caching allocator's (on 5.23, where each IO pair has a
    compute stream of its own, one reserve per stream)."""
    saved = runner.use_cuda_graph_varlen
    runner.use_cuda_graph_varlen = False
    pool = getattr(runner, "mem_pool", None)
    try:
        with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
            yield
    finally:
        runner.use_cuda_graph_varlen = saved
