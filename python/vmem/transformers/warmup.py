"""Every CUDA graph a vmem cache replays, captured before serving: vmem's part of the engine's
warmup.

The engine's ``ModelRunner.warmup`` (``manager.warmup()``; ``generate_batch`` calls it by
default) captures its varlen graph at the largest size and the graphs of its decode fast path.
vmem's decode rounds do not take that path: they run the varlen forward, keyed by
:func:`.hooks.graph_key` with the round's kind. Without this module
their graphs were captured while serving, the first time each key came up: a round that
captures takes 20-40 ms where a replay takes about 3 (H200, Llama-3-8B shapes x 8 layers; four
of the five slowest decode rounds of a memory-bound run, docs/serving.md).

:func:`capture_graphs` runs one fake round per graph: a decode round (every request one query
token) of every padded size the engine can give one (``q_padding_interval_size`` steps up to
``max_requests_per_batch``) at every ``max_seqlen_k`` bucket a vmem graph key carries
(``graph_seqlen_k="bucket"``: powers of two from 1024 to the row length; ``"context"``: none,
one graph a size), and before those the largest varlen round (which sizes the graph pool), or
with ``graph_max_tokens`` every varlen size up to it (larger varlen rounds run without a
graph, in the same pool: the largest of those runs first of all, and sizes it), on each of async
batching's two IO pairs. vmem's rows never move, so each graph stays
valid for the cache's life. A round whose fake requests do not fit the KV budget is skipped (a
real round of that size cannot be scheduled either, unless its requests share prefix pages).
The fake requests go through the engine's own warmup helpers, as its own warmup's do, and are
freed before it returns.

:func:`.hooks.capture_vmem_graphs` runs this in place of the engine's warmup for vmem caches; other caches
keep the engine's warmup as it is. The function works on any cache, so a benchmark can give
another contender the same decode rounds.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from .cache import VmemCBCache

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: The smallest ``max_seqlen_k`` bucket the engine pads a graph round to (5.17-5.25).
MIN_BUCKET = 1024


def padded_sizes(runner: ModelRunner, most: int) -> list[tuple[int, int]]:
    """``(n, padded)`` for each size the engine's ``runner`` pads a round of 1 to ``most``
    query tokens to: the fewest tokens ``n`` that pad to it."""
    out: list[tuple[int, int]] = []
    n = 1
    while 1 <= n <= most:
        padded, _ = runner.maybe_pad_inputs(num_q_tokens=n, max_kv_read=n, use_decode_fast_path=False)
        padded = int(padded)
        if out and padded <= out[-1][1]:  # capped (max_batch_tokens): no larger size
            break
        out.append((n, padded))
        n = padded + 1
    return out


def decode_sizes(runner: ModelRunner) -> list[tuple[int, int]]:
    """``(requests, padded tokens)`` for each padded size of a decode round the engine's
    ``runner`` can run: the fewest requests that pad to it (fewest fake requests to map)."""
    return padded_sizes(runner, int(runner.cb_config.max_requests_per_batch or 0))


def buckets(cache: Any, max_context: int | None = None) -> list[int]:
    """The ``max_seqlen_k`` buckets a graph key carries for ``cache``: ``[0]`` (one graph a
    size: ``graph_seqlen_k="context"``, or rows shorter than the smallest bucket), else ``0``
    then every power of two above :data:`MIN_BUCKET` up to the row length (``max_context``, by
    default a vmem cache's own; ``0`` marks the smallest bucket, reached with no past tokens)."""
    options = getattr(cache, "options", None)
    context = int(max_context if max_context is not None else getattr(cache, "max_context", 0) or 0)
    if getattr(options, "graph_seqlen_k", "bucket") == "context" or context <= MIN_BUCKET:
        return [0]
    out, b = [0], MIN_BUCKET
    while b < context:
        b *= 2
        out.append(b)
    return out


def _pairs(io: Any, async_ios: Any) -> Iterator[None]:
    """Yields once per IO pair (two under async batching, swapping between), else once."""
    yield
    if isinstance(io, async_ios):
        io.swap_io_pairs()
        try:
            yield
        finally:
            io.swap_io_pairs()


def _largest_eager_round(runner: ModelRunner, cache: VmemCBCache, model: torch.nn.Module, mr: Any) -> int:
    """One fake prefill round of the most query tokens a round can carry (``max_batch_tokens``, or
    what the KV budget holds), run without a graph, when that is above ``graph_max_tokens``; 1 if
    it ran. Such rounds run in the graphs' memory pool
    (:func:`~vmem.transformers.graphs.without_varlen_graph`); the caching allocator splits a free
    block for a smaller request but never joins two for a larger one, so prefill rounds of
    growing sizes each reserved more (the pool held 1,504 MB, 64 MB of it in use, after a
    memory-bound run on 5.23; the engine's own warmup runs its largest round first for the same
    reason). Run first, the largest one sizes the pool, and every later round and graph fits in
    what it freed. ``cache``: the runner's, a vmem cache."""
    limit = cache.options.graph_max_tokens
    bs, mc = int(cache.block_size), int(cache.max_context)
    tokens = min(int(cache.max_batch_tokens), int(cache.num_blocks) * bs)
    if limit is None or tokens <= limit:
        return 0
    most = max(1, min(int(cache.rows) - 1, int(runner.cb_config.max_requests_per_batch or cache.rows)))
    requests = min(-(-tokens // mc), most)  # requests of at most a row each; the trash row holds none
    q = min(tokens // requests, int(cache.num_blocks) // requests * bs, mc)
    if q < 1 or requests * q <= limit:
        return 0
    return _fake_round(runner, model, mr, requests, q=q, past=0)


@torch.no_grad()  # as the engine's warmup (called outside it, too: a benchmark's other contenders)
def capture_graphs(runner: ModelRunner, model: torch.nn.Module, max_context: int | None = None, *,
                   varlen_tokens: int = 0, every_varlen: bool = False, eager_first: bool = False) -> int:
    """Runs fake rounds through ``runner`` (the engine's ``ModelRunner``) on ``model`` so that
    each CUDA graph they key is captured now; returns the rounds run. On each IO pair: with
    ``varlen_tokens``, first the largest varlen round of at most that many query tokens (one
    request), whose graph sizes the graph pool the smaller ones then fit in (what the engine's
    own warmup does first), and with ``every_varlen`` every smaller padded size too, at every
    bucket; then a decode round of every padded size (:func:`decode_sizes`) at every bucket
    (:func:`buckets`; ``max_context`` for a cache that does not know its row length). With
    ``eager_first`` (a vmem cache), before all of them the largest round that runs without a
    graph (:func:`_largest_eager_round`). Nothing when the engine does not pad (no graphs). A
    round that fails is logged and skipped, its fake requests freed."""
    if not getattr(runner, "pad_inputs", False):
        return 0
    mr = importlib.import_module("transformers.generation.continuous_batching.model_runner")
    cache, io = runner.cache, runner.inputs_and_outputs
    varlen = [p for _, p in padded_sizes(runner, varlen_tokens) if p >= 2][::-1]  # largest first
    if not every_varlen:
        varlen = varlen[:1]
    kv_buckets, decode = buckets(cache, max_context), [n for n, _ in decode_sizes(runner)]
    rounds = 0
    for _ in _pairs(io, mr.ContinuousBatchingAsyncIOs):
        if eager_first and isinstance(cache, VmemCBCache):
            rounds += _largest_eager_round(runner, cache, model, mr)
        for q in varlen:
            for bucket in kv_buckets if every_varlen else [0]:
                rounds += _fake_round(runner, model, mr, 1, q=q, past=bucket // 2)
        for requests in decode:
            for bucket in kv_buckets:
                rounds += _fake_round(runner, model, mr, requests, q=1, past=bucket // 2)
    return rounds


def _fake_round(runner: ModelRunner, model: torch.nn.Module, mr: Any, requests: int, q: int, past: int) -> int:
    """One round of ``requests`` fake requests of ``q`` query tokens (1: decoding) after ``past``
    tokens each; 1 if it ran."""
    cache, io = runner.cache, runner.inputs_and_outputs
    if past + q > int(getattr(cache, "max_context", 0) or past + q):  # longer than a vmem row: cannot come up
        return 0
    status = mr.RequestStatus.DECODING if q == 1 else mr.RequestStatus.PREFILLING
    states = mr.create_warmup_future_states(requests, status, q, past, cache)
    try:
        if len(states) < requests:  # the KV budget holds fewer: this round cannot come up
            return 0
        padded_q, padded_kv = runner.maybe_pad_inputs(num_q_tokens=requests * q, max_kv_read=requests * (past + q),
                                                      use_decode_fast_path=False)
        io.prepare_batch_tensors(states, runner.logit_processor, False, padded_q, padded_kv, use_padding=True)
        runner.compute_batch(model, cast(dict, io.get_model_kwargs(use_padding=True)))  # (a dict, typed apart)
        return 1
    except Exception as e:  # as the engine's own warmup: a round not captured now is captured when it comes
        pending = getattr(cache, "rounds", None)
        if pending is not None:  # a vmem cache: the failed round's requests must not reach the next
            pending.discard()
        logger.warning("vmem: warmup round of %d requests (%d query tokens after %d) failed: %s",
                       requests, q, past, e)
        return 0
    finally:
        for fs in states:
            cache.free_blocks(fs.state.request_id)
