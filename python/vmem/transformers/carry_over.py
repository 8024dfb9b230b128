"""The engine's async batching, its carry-over ids built in time proportional to the requests.

With async batching (5.17 and 5.19-5.25) the engine schedules round N+1 before round N's tokens
are known, and each round it computes which of round N's new tokens feed round N+1's inputs:
``ContinuousBatchingAsyncIOs.infer_carry_over_ids``, an int32 tensor of ``max_batch_tokens``
entries, -1 but where a request of round N has its new token in round N+1. The engine builds it
as a Python list of ``max_batch_tokens`` entries and converts that to a tensor, every round: at
the serving suite's 8,192 tokens about 1.3 ms of host time a round on our CPU machine, for a
decode round of six requests, where the rest of the engine's preparation of that round takes
about 0.5 ms. :func:`infer_carry_over_ids` builds the same tensor from a fill and one indexed
write of the requests' entries.

:func:`.hooks.fast_carry_over` puts it in place for a vmem cache only; every other cache (the engine's
own, a benchmark's contenders) keeps the engine's method as it ships.
"""

from __future__ import annotations

from typing import Any

import torch


def infer_carry_over_ids(self: Any) -> torch.Tensor:
    """``ContinuousBatchingAsyncIOs.infer_carry_over_ids``: for each position of the next
    round's new tokens, the index of the same request's new token in the previous round's
    outputs, else -1; ``max_batch_tokens`` int32 entries."""
    nxt = self.io_pairs[self.current_pair].host_io.req_id_to_new_token_position
    prev = self.io_pairs[1 - self.current_pair].host_io.req_id_to_new_token_position
    out = torch.full((self.max_batch_tokens,), -1, dtype=torch.int32)
    sources: list[int] = []
    positions: list[int] = []
    for i, request_id in enumerate(prev):
        position = nxt.get(request_id)
        if position is not None:
            sources.append(i)
            positions.append(position)
    if positions:
        out[torch.tensor(positions, dtype=torch.long)] = torch.tensor(sources, dtype=torch.int32)
    return out
