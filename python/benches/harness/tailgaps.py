"""Where time-between-tokens p99 comes from (``serving_suite.py --profile``): every gap between two
consecutive tokens of one request, pooled over requests as the suite's TBT p99 is
(:func:`harness.stats.serving_metrics`), set against the engine rounds the round clock timed
(:mod:`harness.hostclock`, whose filed rounds all carry ``t_open_ns`` and ``wall_ns``; both
clocks read ``perf_counter``).

**How a gap is placed.** A gap *falls in* the round whose wall time covers most of it, when that
covers at least half the gap; else in no one round (it spans several short rounds, or lies
outside every round). Rounds are told apart as ``prefill`` (the round has a prompt), ``after
prefill`` (a decode round right after one: under async batching it waits for the prefill round's
GPU work, so the wait for a prefill round shows there) and ``decode``.

**What the report says.** The gaps at or past p99 by the round they fall in; every gap in a
prefill round or the round after one (a gap *held* by that prefill round), per prefill round;
and the longest gaps of the other decode rounds. Where the held gaps outnumber p99's rank, p99
is a gap a prefill round held; where they do not, p99 is among the decode rounds' own gaps, and
the more gaps each prefill round holds (the more requests run beside it), the nearer p99 sits to
them. (The suite's own count of *stalled* gaps, :data:`harness.stats.STALLED`, is by length
alone: gaps past 4x the run's TBT p50.)"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from harness.stats import percentile

#: The kinds of round a gap can fall in, in the report's order.
KINDS = ("prefill", "after prefill", "decode")
#: How the report names the gaps of each kind (and those no one round covers half of).
LABELS = {"prefill": "in prefill rounds", "after prefill": "in decode rounds right after a prefill round",
          "decode": "in other decode rounds", "no one round": "in no one round (several, or none)"}


def pooled_gaps(token_times: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """``(start, end)`` in seconds of every gap between consecutive tokens of a request, pooled."""
    return [(ts[i], ts[i + 1]) for ts in token_times for i in range(len(ts) - 1)]


def round_kinds(rounds: Sequence[dict[str, Any]]) -> list[str]:
    """Each round's kind for the report (:data:`KINDS`), from its own ``kind`` and the round's
    before it."""
    out = []
    for i, r in enumerate(rounds):
        if r["kind"] == "prefill":
            out.append("prefill")
        else:
            out.append("after prefill" if i and rounds[i - 1]["kind"] == "prefill" else "decode")
    return out


def fall_in(gap: tuple[float, float], opens: Sequence[int], ends: Sequence[int]) -> int | None:
    """The index of the round (``opens``/``ends`` in ``perf_counter_ns``, in order, not
    overlapping) covering most of ``gap`` (seconds), if that covers at least half of it; of two
    covering as much, the later. ``None`` for a gap of no length."""
    a, b = gap[0] * 1e9, gap[1] * 1e9
    best, most = None, 0.0
    i = bisect.bisect_left(opens, b) - 1
    while i >= 0 and ends[i] > a:
        cover = min(b, ends[i]) - max(a, opens[i])
        if cover > most:
            best, most = i, cover
        i -= 1
    return best if best is not None and 2 * most >= b - a else None


def report(token_times: Sequence[Sequence[float]], rounds: Sequence[dict[str, Any]], q: float = 99) -> str:
    """The tail's gaps by the round they fall in (see the module doc), as profile.txt lines."""
    gaps = pooled_gaps(token_times)
    if not gaps or not rounds:
        return "TBT tail: no gaps or no rounds to set them against"
    lengths = [b - a for a, b in gaps]
    p = percentile(lengths, q)
    rank = sum(x >= p for x in lengths)  # p99 is the rank-th longest gap
    order = sorted(range(len(rounds)), key=lambda j: rounds[j]["t_open_ns"])
    opens = [rounds[j]["t_open_ns"] for j in order]
    ends = [rounds[j]["t_open_ns"] + rounds[j]["wall_ns"] for j in order]
    kinds = round_kinds([rounds[j] for j in order])
    where = [fall_in(g, opens, ends) for g in gaps]
    kind_of = ["no one round" if w is None else kinds[w] for w in where]
    tail = Counter(k for k, x in zip(kind_of, lengths) if x >= p)
    held = [x for k, x in zip(kind_of, lengths) if k in ("prefill", "after prefill")]
    # each held gap filed under its prefill round (the one before, for the round after one)
    per_prefill = Counter(w if k == "prefill" else w - 1 for w, k in zip(where, kind_of)
                          if w is not None and k in ("prefill", "after prefill"))
    prefills = sum(k == "prefill" for k in kinds)
    named = ", ".join(f"{tail[k]} {LABELS[k]}" for k in (*KINDS, "no one round") if tail[k])
    lines = [f"TBT tail: {len(gaps)} gaps between tokens, p{q:g} {p * 1e3:.2f} ms ({rank} gaps as long or longer); "
             f"each gap set in the round covering at least half of it",
             f"  the {rank} gaps at or past p{q:g}: {named}"]
    if held:
        lines.append(f"  gaps in a prefill round or the round after one: {len(held)} (median "
                     f"{statistics.median(held) * 1e3:.1f} ms), over {prefills} prefill rounds: "
                     f"{len(held) / max(prefills, 1):.1f} a prefill round, at most {max(per_prefill.values())}")
    decode_tail = sorted((x for k, x in zip(kind_of, lengths) if k == "decode"), reverse=True)[:rank]
    if decode_tail:
        lines.append(f"  the {len(decode_tail)} longest gaps in decode rounds: {decode_tail[-1] * 1e3:.2f}-"
                     f"{decode_tail[0] * 1e3:.2f} ms")
    return "\n".join(lines)
