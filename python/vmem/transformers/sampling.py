"""Greedy decoding's next tokens, an argmax over the vocabulary, in two reductions.

The engine takes a round's greedy tokens with one ``torch.argmax`` over ``[tokens, vocab]``
float32 scores inside its compiled forward. On the H200 Inductor's kernel for it
(``triton_red_fused__to_copy_argmax...``) took 388-441 µs a round whatever the round's size: 3.9 %
of the GPU's time serving Llama-3-8B's shapes at full depth at a tenth of the working set, 6.3 % on
Llama-3.2-1B's (docs/serving.md, the profiles). A time that does not grow with the rows is a
kernel walking each row's 128,256 words in one program; Inductor does not split an index
reduction along the reduced dimension as it splits a sum or a max.

:func:`greedy_tokens` gives the same tokens in two reductions: the largest score and its place
in each run of :data:`RUN` words (``[tokens, runs]`` programs, each a short walk), then the run
holding the largest. Both keep the first of equal maxima, as ``torch.argmax`` does, so the
token is the first index of the row's maximum; a NaN counts as the largest, as there. A row
whose vocabulary is not whole runs is padded with ``-inf`` (never chosen over a real score;
an all ``-inf`` row gives 0, as ``torch.argmax``). Version-free and engine-free: the hook that
puts it in the engine's ``_sample``, under its compiled forward only, is
:func:`.hooks.two_step_greedy` (run eagerly, ATen's argmax spreads a row over the GPU itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Words of one run of the first reduction: short enough that a row's runs keep the GPU busy
#: (128,256 words make 63 runs a row), long enough that the second reduction is small.
RUN = 2048


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum: ``scores`` ``[tokens, vocab]`` (any float dtype);
    returns int64 ``[tokens]``, equal to ``scores.argmax(-1)``."""
    rows, words = scores.shape
    runs = -(-words // RUN)
    if runs * RUN != words:
        scores = F.pad(scores, (0, runs * RUN - words), value=float("-inf"))
    best, at = scores.reshape(rows, runs, RUN).max(dim=-1)  # [tokens, runs]
    run = best.argmax(dim=-1, keepdim=True)  # [tokens, 1]: the first run holding the row's maximum
    return (run * RUN + at.gather(1, run)).squeeze(1)
