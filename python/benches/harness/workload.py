"""What the load generator (serve_bench.py) sends: when each request arrives, how long its prompt
and answer are, and the prompt itself.

* Arrivals at a rate: exponential gaps (Poisson arrivals) at ``rate`` requests per second, or
  gamma gaps of the same mean with ``burstiness`` (vLLM's benchmark_serving: shape
  ``burstiness``, scale ``1 / (rate * burstiness)``; 1 is Poisson, below 1 burstier); ``inf``:
  every request at once. The first request arrives at 0 s. Seeded: the same gaps every run.
* Arrivals from a trace: the Azure trace's own timestamps over a window of its clock
  (:mod:`harness.tenant_plan`'s windows: ``start_s`` after the trace's first request,
  ``window_s`` long, replayed ``time_scale`` times faster).
* Lengths: the trace's prompt (``ContextTokens``, capped) and answer (``GeneratedTokens``,
  capped, or one fixed length) per row, rows taken in order and cycled when more requests are
  asked than the trace has.
* Prompts: random token ids (the same ids for request ``i`` in every run of one seed), sent as
  the ids themselves or as text of that many tokens: with a tokenizer made by make_model_dir.py
  exactly (``t<id>`` words), with any other tokenizer as close as decoding and re-encoding gets.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness import model_dir, tenant_plan
from harness.trace import load_trace


@dataclass(frozen=True)
class Request:
    """One request of a run: its index, arrival (seconds after the run's start), prompt tokens,
    answer tokens asked (``max_tokens``) and its trace row."""

    index: int
    at_s: float
    prompt_len: int
    output_len: int
    row: int


def parse_rate(text: str) -> float:
    """A request rate: a number of requests per second above 0, or ``inf``; else a ValueError."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"not a request rate: {text!r} (a number above 0, or inf)") from None
    if not rate > 0:  # NaN included
        raise ValueError(f"a request rate is above 0 (or inf), got {text!r}")
    return rate


def rate_arrivals(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """``n`` arrival times (seconds, the first at 0) at ``rate`` requests per second: gamma gaps
    of shape ``burstiness`` and mean ``1 / rate`` (exponential, Poisson arrivals, at 1); all 0 at
    an infinite rate. ``n`` below 1, a rate not above 0 or a burstiness not above 0 is a ValueError."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not rate > 0 or not burstiness > 0 or not math.isfinite(burstiness):
        raise ValueError(f"rate and burstiness must be above 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def trace_lengths(path: str, n: int, max_prompt: int, max_output: int,
                  output_len: int | None = None) -> list[tuple[int, int, int]]:
    """``n`` (prompt tokens, answer tokens, row) from the trace at ``path``, its rows in order,
    cycled past its end: prompts capped at ``max_prompt``, answers at ``max_output`` (at least 1),
    or every answer ``output_len``. A trace that cannot be read is a ValueError or OSError."""
    if max_output < 1 or (output_len is not None and output_len < 1):
        raise ValueError(f"answers need at least 1 token, got max_output={max_output}, output_len={output_len}")
    rows = load_trace(path, None, max_prompt)[:n]
    out = []
    for i in range(n):
        r = rows[i % len(rows)]
        out.append((r.prompt_len, output_len or max(1, min(r.generated, max_output)), r.index))
    return out


def rate_requests(path: str, n: int, rate: float, seed: int, burstiness: float, max_prompt: int,
                  max_output: int, output_len: int | None = None) -> list[Request]:
    """``n`` requests of the trace's lengths (:func:`trace_lengths`) arriving at ``rate``
    (:func:`rate_arrivals`)."""
    times = rate_arrivals(n, rate, seed, burstiness)
    lengths = trace_lengths(path, n, max_prompt, max_output, output_len)
    return [Request(i, t, p, o, row) for i, (t, (p, o, row)) in enumerate(zip(times, lengths))]


def window_requests(path: str, window: tenant_plan.Window, max_output: int,
                    output_len: int | None = None) -> list[Request]:
    """The requests of the trace at ``path`` in ``window`` (its first
    :data:`harness.tenant_plan.TRACE_ROWS` rows), at their own timestamps: one stream, as one
    tenant of :func:`harness.tenant_plan.arrivals` replays it. No request in the window is a
    ValueError."""
    spec = tenant_plan.TenantSpec("stream", "-", 0, "trace")
    (arrivals,) = tenant_plan.arrivals((spec,), window, "bursty", {"trace": path})
    return requests_of(arrivals, path, window.max_prompt, max_output, output_len)


def requests_of(arrivals: Sequence[tenant_plan.Arrival], path: str, max_prompt: int, max_output: int,
                output_len: int | None = None) -> list[Request]:
    """``arrivals`` (of the trace at ``path``) as requests, each answer the row's
    ``GeneratedTokens`` capped at ``max_output``, or ``output_len``."""
    rows = load_trace(path, max(a.row for a in arrivals) + 1, max_prompt)
    return [Request(i, a.at_s, a.prompt_len, output_len or max(1, min(rows[a.row].generated, max_output)), a.row)
            for i, a in enumerate(arrivals)]


def prompt_ids(index: int, length: int, vocab: int, seed: int, low: int = model_dir.FIRST_WORD) -> list[int]:
    """Request ``index``'s prompt: ``length`` random ids in ``[low, vocab)``, the same for one
    ``seed`` and ``index`` in every run."""
    if vocab <= low:
        raise ValueError(f"a vocabulary of {vocab} has no id from {low} on")
    rng = random.Random((seed << 32) ^ index)
    return [rng.randrange(low, vocab) for _ in range(length)]


def tokenizer_vocab(path: str) -> int:
    """The vocabulary size of the model or tokenizer directory at ``path``: its ``config.json``'s
    ``vocab_size``, else the size of its ``tokenizer.json``'s vocabulary. Neither is a ValueError."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        text_cfg = cfg.get("text_config", cfg)
        return int(text_cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(os.path.join(path, "tokenizer.json")) as f:
            tok = json.load(f)
        return len(tok["model"]["vocab"]) + len(tok.get("added_tokens") or [])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: no config.json with vocab_size and no readable tokenizer.json") from None


class Prompts:
    """Makes each request's prompt: ``"ids"`` (a list of token ids, for servers that take one)
    or ``"text"``. Text of a make_model_dir.py tokenizer (``tokenizer`` a directory with its
    marker) is exact; with another tokenizer directory it is the random ids decoded, re-encoded
    and trimmed or grown (up to 8 times) toward the length, and :meth:`make` says the length it
    reached."""

    def __init__(self, kind: str, vocab: int, seed: int = 0, tokenizer: str | None = None) -> None:
        if kind not in ("ids", "text"):
            raise ValueError(f"prompts are 'ids' or 'text', got {kind!r}")
        self.kind, self.vocab, self.seed = kind, vocab, seed
        self.exact = kind == "ids" or (tokenizer is not None and model_dir.read_marker(tokenizer) is not None)
        self._tok: Any = None
        if kind == "text" and not self.exact:
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer directory")
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(tokenizer)

    def make(self, index: int, length: int) -> tuple[str | list[int], int]:
        """Request ``index``'s prompt of ``length`` tokens, and the tokens it is."""
        ids = prompt_ids(index, length, self.vocab, self.seed)
        if self.kind == "ids":
            return ids, length
        if self.exact:
            return model_dir.prompt_text(ids), length
        return self._fit(ids, length, random.Random((self.seed << 32) ^ index ^ 0x5EED))

    def _fit(self, ids: list[int], length: int, rng: random.Random) -> tuple[str, int]:
        special = set(self._tok.all_special_ids)
        ids = [i if i not in special else model_dir.FIRST_WORD for i in ids]
        text = self._tok.decode(ids)
        for _ in range(8):
            got = self._tok.encode(text, add_special_tokens=False)
            if len(got) == length:
                break
            if len(got) > length:
                got = got[:length]
            else:
                got = got + [rng.randrange(model_dir.FIRST_WORD, self.vocab) for _ in range(length - len(got))]
            text = self._tok.decode(got)
        return text, len(self._tok.encode(text, add_special_tokens=False))
