"""Every CUDA graph a contender other than vmem's replays, captured before the clock starts, as a
server would capture them at its start: the harness's pre-capture for the engine's own cache and
the fi-paged peer (vmem's caches capture theirs in the engine's own ``manager.warmup()``, which
vmem.transformers hooks). Imports neither vmem nor the harness's attentions: the engine's own
contender runs it in a process where vmem was never imported (:mod:`harness.clean`), so both of
the engine's rows get the same pre-capture.

After ``manager.warmup()``, fake rounds through the engine's own warmup helpers
(``create_warmup_future_states``, ``maybe_pad_inputs``, ``prepare_batch_tensors``,
``compute_batch``), on each of async batching's IO pairs: every padded varlen size up to
``varlen_tokens`` (the fi-paged peer's ``graph_max_tokens``) and a decode round of every padded
size up to ``max_requests_per_batch``, each at every ``max_seqlen_k`` bucket the engine keys a
graph by (0, then the powers of two above 1,024 up to the model's context). A round whose fake
requests the KV budget cannot hold is skipped, as is one that fails (its graph is then captured
when such a round comes up)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from harness.log import log

#: The smallest ``max_seqlen_k`` bucket the engine pads a graph round to (5.17-5.24).
MIN_BUCKET = 1024


def padded_sizes(runner: Any, most: int) -> list[tuple[int, int]]:
    """``(n, padded)`` for each size the engine's ``runner`` pads a round of 1 to ``most`` query
    tokens to: the fewest tokens ``n`` that pad to it."""
    out: list[tuple[int, int]] = []
    n = 1
    while 1 <= n <= most:
        padded = int(runner.maybe_pad_inputs(num_q_tokens=n, max_kv_read=n, use_decode_fast_path=False)[0])
        if out and padded <= out[-1][1]:  # capped (max_batch_tokens): no larger size
            break
        out.append((n, padded))
        n = padded + 1
    return out


def buckets(max_context: int) -> list[int]:
    """The ``max_seqlen_k`` buckets of a graph key: 0, then every power of two above
    :data:`MIN_BUCKET` up to ``max_context``."""
    out, b = [0], MIN_BUCKET
    while b < max_context:
        b *= 2
        out.append(b)
    return out


@torch.no_grad()  # as the engine's warmup
def capture(runner: Any, model: Any, max_context: int, varlen_tokens: int = 0) -> int:
    """Runs the fake rounds (see the module doc) through ``runner`` (the engine's ``ModelRunner``)
    on ``model``; returns the rounds run. Nothing when the engine does not pad (no graphs)."""
    if not getattr(runner, "pad_inputs", False):
        return 0
    mr = importlib.import_module("transformers.generation.continuous_batching.model_runner")
    io = runner.inputs_and_outputs
    keys = buckets(max_context)
    varlen = [p for _, p in padded_sizes(runner, varlen_tokens) if p >= 2][::-1]  # largest first
    decode = [n for n, _ in padded_sizes(runner, int(runner.cb_config.max_requests_per_batch or 0))]
    rounds = 0
    for pair in range(2 if isinstance(io, mr.ContinuousBatchingAsyncIOs) else 1):
        if pair:
            io.swap_io_pairs()
        try:
            rounds += sum(_fake_round(runner, model, mr, 1, q, b // 2) for q in varlen for b in keys)
            rounds += sum(_fake_round(runner, model, mr, n, 1, b // 2) for n in decode for b in keys)
        finally:
            if pair:
                io.swap_io_pairs()
    return rounds


def _fake_round(runner: Any, model: Any, mr: Any, requests: int, q: int, past: int) -> int:
    """One round of ``requests`` fake requests of ``q`` query tokens (1: decoding) after ``past``
    tokens each; 1 if it ran."""
    cache, io = runner.cache, runner.inputs_and_outputs
    status = mr.RequestStatus.DECODING if q == 1 else mr.RequestStatus.PREFILLING
    states = mr.create_warmup_future_states(requests, status, q, past, cache)
    try:
        if len(states) < requests:  # the KV budget holds fewer: this round cannot come up
            return 0
        padded_q, padded_kv = runner.maybe_pad_inputs(num_q_tokens=requests * q, max_kv_read=requests * (past + q),
                                                      use_decode_fast_path=False)
        io.prepare_batch_tensors(states, runner.logit_processor, False, padded_q, padded_kv, use_padding=True)
        runner.compute_batch(model, io.get_model_kwargs(use_padding=True))
        return 1
    except Exception as e:  # as the engine's own warmup: a round not captured now is captured when it comes
        if isinstance(getattr(cache, "fi_round", None), list):  # the fi-paged peer: no stale entries
            cache.fi_round.clear()
        log(f"warmup round of {requests} requests ({q} query tokens after {past}) failed: {e}")
        return 0
    finally:
        for fs in states:
            cache.free_blocks(fs.state.request_id)
