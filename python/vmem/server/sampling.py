"""Per-request sampling inside the continuous-batching engine: temperature, top-p and a seed per
request, and exact greedy decoding beside them in the same round.

The engine (``per_request_processors``) already carries one value per request and processor
into its rounds. The server gives it three processors and leaves the engine's own argmax as the
last step (``do_sample=False``):

* the engine's per-request temperature and top-p warpers (transformers' classes);
* :class:`SeededGumbel`: for a sampling request, Gumbel noise drawn from a counter-based hash
  of (the request's seed, the position of the token sampled, the vocabulary index) added to its
  scores; the argmax of scores plus Gumbel noise is a sample of their softmax (the Gumbel-max
  trick). A request's tokens then depend on its seed and its own tokens only: the same seed
  gives the same text whatever runs beside it, preempted or not. A greedy request
  (``temperature`` 0) gets no noise, temperature 1 and top-p 1: its scores are untouched and
  the engine's argmax is ``generate()``'s.

Every processor is tensor-only (no host sync, no data-dependent shape): it runs inside a
captured CUDA graph as the rest of the round. Its cost is a few passes over the round's
``[requests, vocab]`` scores, a sort for top-p among them; ``--sampling greedy`` leaves all of
it out (docs/server.md).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of the noise for the token at ``position`` of a request seeded ``seed``:
    never 0 (0 marks a greedy request), as a signed int32 (the engine's argument rows are int32)."""
    key = _splitmix64(_splitmix64(seed & _M64) ^ (position & _M64)) & _M32
    key = key or 1
    return key - (1 << 32) if key >= 1 << 31 else key


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[len(keys), vocab]`` float32 Gumbel(0, 1) noise, a pure function of each row's key and
    the vocabulary index (a 32-bit hash: two xorshift-multiply rounds over ``key * a + index *
    b``). Every product stays below 2**63 (keys and states are 32-bit, multipliers 31-bit), so
    int64 arithmetic never overflows on any device."""
    k = keys.to(torch.int64).bitwise_and(_M32).unsqueeze(1)
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64).unsqueeze(0)
    x = (k * 0x27D4EB2D + idx * 0x165667B1).bitwise_and_(_M32)
    x = x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_M32)
    x = x.bitwise_xor_(x >> 15).mul_(0x5BD1E995).bitwise_and_(_M32)
    x = x.bitwise_xor_(x >> 16)
    u = (x >> 8).to(torch.float32).add_(0.5).mul_(2.0**-24)  # 24 bits: (0, 1), never 0 or 1
    return u.log_().neg_().log_().neg_()


class SeededGumbel(ContinuousBatchingLogitsProcessor):
    """Adds each sampling request's seeded Gumbel noise to its scores (the engine's argmax then
    samples); a request without ``seed`` (greedy) is left untouched."""

    supported_kwargs: Dict[str, type] = {"seed": int}
    ignored_kwargs: tuple = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            state = request.state
            seed = state.logit_processor_kwargs.get("seed")
            # The engine has advanced position_offset past this round's tokens: the position of
            # the token sampled now, the same after a preemption re-computes the request.
            keys.append(0 if seed is None else row_key(seed, state.position_offset))
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)]
        noise = gumbel_noise(keys, scores.size(-1))
        return scores + torch.where((keys != 0).unsqueeze(1), noise, torch.zeros((), device=scores.device))


class SamplingProcessors(ContinuousBatchingLogitsProcessorList):
    """The engine's logits processors for per-request sampling: temperature, top-p, then the
    seeded Gumbel noise (each with one argument row in the engine's round tensors)."""

    def __init__(self) -> None:
        processors = [ContinuousBatchingTemperatureLogitsWarper(TemperatureLogitsWarper(1.0)),
                      ContinuousBatchingTopPLogitsWarper(TopPLogitsWarper(1.0)),
                      SeededGumbel()]
        super().__init__(LogitsProcessorList(processors), per_request_processors=False)
        self.tensors_required = len(processors)  # one int32 row each (the engine counts only its own)


def request_kwargs(temperature: float, top_p: float, seed: Optional[int]) -> Dict[str, Any]:
    """What ``add_request`` takes for a request: nothing for greedy (temperature 0), else its
    temperature, top-p and seed (which :class:`SeededGumbel` turns into noise)."""
    if temperature == 0.0:
        return {}
    assert seed is not None, "a sampling request has a seed (the server draws one when none is given)"
    return {"temperature": float(temperature), "top_p": float(top_p), "seed": int(seed)}
