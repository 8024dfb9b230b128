"""The profile's TBT tail report (python/benches/harness/tailgaps.py): each gap between tokens set
in the round covering most of it, a gap a prefill round holds found in the decode round after it,
p99 the serving metrics' own, and the counts the report prints."""

from __future__ import annotations

from harness import stats, tailgaps

MS = 1_000_000  # ns


def _rounds(spans):
    """Rounds of ``(kind, start ms, end ms)``, as the round clock files them."""
    return [{"kind": k, "t_open_ns": a * MS, "wall_ns": (b - a) * MS} for k, a, b in spans]


# Decode rounds of 10 ms, a prefill round of 100 ms, and the decode round after it waiting 110 ms
# for it (async batching), then two more decode rounds.
ROUNDS = _rounds([("decode", 0, 10), ("decode", 10, 20), ("prefill", 20, 120), ("decode", 120, 230),
                  ("decode", 230, 240), ("decode", 240, 250)])


def test_a_gap_a_prefill_round_holds_is_found_in_the_round_after_it():
    times = [[t / 1e3 for t in (10, 20, 230, 240, 250)]] * 3  # three requests, a token per decode round
    text = tailgaps.report(times, ROUNDS)
    p99 = stats.serving_metrics(0.0, [0.0] * 3, times)["tbt_p99_ms"]
    assert f"p99 {p99:.2f} ms" in text and "p99 210.00 ms (3 gaps as long or longer)" in text
    assert "the 3 gaps at or past p99: 3 in decode rounds right after a prefill round" in text
    assert ("gaps in a prefill round or the round after one: 3 (median 210.0 ms), over 1 prefill rounds: "
            "3.0 a prefill round, at most 3") in text
    assert "the 3 longest gaps in decode rounds: 10.00-10.00 ms" in text
    assert tailgaps.round_kinds(ROUNDS) == ["decode", "decode", "prefill", "after prefill", "decode", "decode"]


def test_a_gap_no_round_covers_half_of_falls_in_none():
    opens = [r["t_open_ns"] for r in ROUNDS]
    ends = [r["t_open_ns"] + r["wall_ns"] for r in ROUNDS]
    assert tailgaps.fall_in((0.005, 0.026), opens, ends) is None  # 5, 10 and 6 of 21 ms: none has half
    assert tailgaps.fall_in((0.005, 0.125), opens, ends) == 2  # 100 of 120 ms in the prefill round
    assert tailgaps.fall_in((0.002, 0.017), opens, ends) == 0  # 8 of 15 ms
    assert tailgaps.fall_in((0.230, 0.250), opens, ends) == 5  # 10 ms in each: the later round
    assert tailgaps.fall_in((0.015, 0.015), opens, ends) is None  # no length
    assert tailgaps.fall_in((0.005, 0.245), opens, ends) is None  # 110 of 240 ms in the longest
    assert tailgaps.fall_in((0.300, 0.400), opens, ends) is None  # after every round


def test_gaps_past_the_rounds_and_an_empty_run_are_reported_not_raised():
    text = tailgaps.report([[0.300, 0.310, 0.330]], ROUNDS)
    assert "the 1 gaps at or past p99: 1 in no one round (several, or none)" in text
    assert "gaps in a prefill round" not in text
    assert tailgaps.report([], ROUNDS).startswith("TBT tail: no gaps")
    assert tailgaps.report([[0.1, 0.2]], []).startswith("TBT tail: no gaps")


def test_p99_is_the_serving_metrics_own():
    """Gaps of distinct lengths (1 to 57 ms), where the percentile's methods disagree: the report's
    p99 is the one the suite prints (``serving_metrics``)."""
    times, t = [], 0.0
    for r in range(3):
        ts = [t]
        for i in range(19):
            t += (1 + 3 * i + r) / 1e3
            ts.append(t)
        times.append(ts)
    gaps = sorted(b - a for ts in times for a, b in zip(ts, ts[1:]))
    assert len(set(gaps)) == len(gaps) == 57
    assert len({round(stats.percentile(gaps, 99, m), 9) for m in ("nearest", "rank", "linear")}) == 3
    p99 = stats.serving_metrics(0.0, [0.0] * 3, times)["tbt_p99_ms"]
    assert f"p99 {p99:.2f} ms" in tailgaps.report(times, ROUNDS)
