"""The load generator (python/benches/serve_bench.py, harness/loadgen.py, serve_metrics.py,
workload.py): vLLM's metric definitions against a fake OpenAI-compatible server whose timings
are known, arrivals at a rate and from a trace window, failures counted by kind, the time bound,
loopback only, usage errors; the drivers' pure pieces (memory flatness, tenant demand)."""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys

import pytest
from harness import loadgen, serve_metrics, serve_steady, tenant_plan, trace, workload
from harness import serve_multitenant as smt

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCHES = os.path.abspath(os.path.join(TESTS, "..", "benches"))
sys.path.insert(0, TESTS)


def need_server_stack() -> None:
    """The fake server and the client need fastapi, uvicorn and httpx (the serving part of
    scripts/test.sh installs them)."""
    for mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (the serving part of scripts/test.sh runs these)")


def fake(**kw):
    need_server_stack()
    import serve_fake

    return serve_fake.serve_in_thread(**kw)


def ids_prompts(vocab: int = 256) -> workload.Prompts:
    return workload.Prompts("ids", vocab, seed=0)


def run(base_url: str, reqs, **cfg):
    c = loadgen.ClientConfig(base_url, cfg.pop("model", "fake"), **cfg)
    res = loadgen.run_sync(reqs, ids_prompts(), c)
    return res, serve_metrics.summarize(reqs, res, cfg.get("slo"))


# --- the metrics, against known timings ------------------------------------------------------------

def test_metrics_are_vllms_definitions_on_known_timings() -> None:
    """Three fast requests (prompt 10: first token 0.1 s after the request) and three slow ones
    (prompt 80: 1.0 s), 5 tokens each 0.05 s apart, all at once. Each time is bounded below by
    the server's schedule (it never sends early) and above by it plus a shared machine's delays;
    the metrics are recomputed from each request's own times with vLLM's formulas; goodput at
    TTFT <= 500 ms counts the fast three."""
    ttft, slow, itl, n = 0.1, 1.0, 0.05, 5
    late = 0.35  # what a loaded CI machine may add to a time
    reqs = [workload.Request(i, 0.0, 10 if i < 3 else 80, n, i) for i in range(6)]
    with fake(ttft=ttft, slow_ttft=slow, slow_from=50, itl=itl) as srv:
        res = loadgen.run_sync(reqs, ids_prompts(), loadgen.ClientConfig(srv.base_url, "fake"))
        bodies = list(srv.app.state.bodies)
    assert all(o.ok and o.tokens == n and o.events == n for o in res.outcomes), [o.error for o in res.outcomes]
    for o, r in zip(res.outcomes, reqs):
        want = ttft if r.prompt_len < 50 else slow
        assert want - 0.005 <= o.ttft_s <= want + late, (r, o.ttft_s)
        assert len(o.itl_s) == n - 1 and all(g >= 0 for g in o.itl_s)
        # the last token leaves the server at ttft + (n - 1) * itl at the earliest
        assert want + (n - 1) * itl - 0.005 <= o.latency_s <= want + (n - 1) * itl + late
        assert o.latency_s == pytest.approx(o.ttft_s + sum(o.itl_s), abs=1e-6)  # E2EL: to the last token
        assert o.prompt_tokens == r.prompt_len and o.finish_reason == "length"
    # every body asked for a stream with usage, greedy, the length forced (ignore_eos)
    assert len(bodies) == 6 and all(
        b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
        and b["temperature"] == 0.0 and b["max_tokens"] == n for b in bodies)
    m = serve_metrics.summarize(reqs, res, {"ttft": 500})
    assert m["completed"] == 6 and m["failed"] == 0 and m["wrong_length"] == 0
    assert m["total_output_tokens"] == 30 and m["total_input_tokens"] == 3 * 10 + 3 * 80
    d = res.duration_s
    assert slow + (n - 1) * itl - 0.005 <= d <= slow + (n - 1) * itl + late
    assert d >= max(o.sent_s + o.latency_s for o in res.outcomes) - 1e-6
    assert m["request_throughput"] == pytest.approx(6 / d)
    assert m["output_throughput"] == pytest.approx(30 / d)
    assert m["total_token_throughput"] == pytest.approx((30 + 270) / d)
    # TPOT per request (E2EL - TTFT) / (tokens - 1), then mean/median/p99 over requests
    tpots = sorted((o.latency_s - o.ttft_s) / (n - 1) * 1e3 for o in res.outcomes)
    assert m["mean_tpot_ms"] == pytest.approx(statistics.mean(tpots))
    assert m["median_tpot_ms"] == pytest.approx((tpots[2] + tpots[3]) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(tpots[4] + 0.95 * (tpots[5] - tpots[4]))
    assert itl * 1e3 * 0.5 <= m["median_tpot_ms"] <= (itl + late) * 1e3
    # ITL pooled: all 6 x 4 gaps (a late token shortens the gap after it; their sum stays)
    gaps = sorted(g * 1e3 for o in res.outcomes for g in o.itl_s)
    assert len(gaps) == 24 and m["mean_itl_ms"] == pytest.approx(statistics.mean(gaps))
    assert m["p90_itl_ms"] == pytest.approx(gaps[20] + 0.7 * (gaps[21] - gaps[20]))
    # TTFT: the median between the two groups (linear, as numpy), p99 near the slowest
    ttfts = sorted(o.ttft_s * 1e3 for o in res.outcomes)
    assert m["median_ttft_ms"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)
    assert m["p99_ttft_ms"] == pytest.approx(ttfts[4] + 0.95 * (ttfts[5] - ttfts[4]))
    # goodput at TTFT <= 500 ms: the three fast requests; at TPOT <= 1 ms: none
    assert m["good_requests"] == 3 and m["request_goodput"] == pytest.approx(3 / d)
    assert serve_metrics.summarize(reqs, res, {"tpot": 1})["good_requests"] == 0
    assert serve_metrics.summarize(reqs, res, {"ttft": 5000, "tpot": 1})["good_requests"] == 0  # every SLO met
    assert serve_metrics.summarize(reqs, res, {"ttft": 5000, "tpot": 1000, "e2el": 5000})["good_requests"] == 6


def test_chat_endpoint_and_generation_config_force() -> None:
    reqs = [workload.Request(i, 0.0, 4, 3, i) for i in range(2)]
    with fake(itl=0.001, eos_after=1) as srv:
        res, m = run(srv.base_url, reqs, endpoint="chat", force="generation-config")
        bodies = list(srv.app.state.bodies)
        _, short = run(srv.base_url, reqs, force="none")
    assert m["completed"] == 2 and m["wrong_length"] == 0 and m["total_output_tokens"] == 6
    assert all("messages" in b and b["generation_config"] == '{"eos_token_id": -1}' and "ignore_eos" not in b
               for b in bodies)
    # a server that stops at its EOS: the answers are short, and counted as such
    assert short["completed"] == 2 and short["wrong_length"] == 2 and short["total_output_tokens"] == 2


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_the_linear_percentile_is_numpys_default(n: int) -> None:
    """vLLM reports numpy's default percentile (linear interpolation); so does the load generator."""
    np = pytest.importorskip("numpy")
    from harness import stats

    xs = [float(x) for x in np.random.default_rng(n).normal(size=n)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert stats.percentile(xs, q, "linear") == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)
    with pytest.raises(ValueError, match="method"):
        stats.percentile(xs, 50, "midpoint")


def test_usage_counts_that_are_no_counts_are_not_taken() -> None:
    assert [loadgen.count(v) for v in (3, 0, -1, True, "3", 2.0, None)] == [3, 0, None, None, None, None, None]


def test_tpot_and_goodput_of_one_token_answers() -> None:
    """A request of one output token has no TPOT (left out of its percentiles) and counts as
    TPOT 0 for goodput (vLLM)."""
    o = loadgen.Outcome(0, ok=True, ttft_s=0.1, latency_s=0.1, events=1, output_tokens=1)
    r = workload.Request(0, 0.0, 5, 1, 0)
    m = serve_metrics.summarize([r], loadgen.RunResult([o], 1.0), {"tpot": 1})
    assert serve_metrics.tpot_s(o) is None and math.isnan(m["mean_tpot_ms"]) and m["good_requests"] == 1
    assert math.isnan(m["p99_itl_ms"])


# --- arrivals -----------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_rate_and_are_seeded() -> None:
    rate, n = 5.0, 4000
    t = workload.rate_arrivals(n, rate, seed=7)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    assert workload.rate_arrivals(n, rate, seed=7) == t and workload.rate_arrivals(n, rate, seed=8) != t
    bursty = workload.rate_arrivals(n, rate, seed=7, burstiness=0.5)
    bg = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.mean(bg) == pytest.approx(1 / rate, rel=0.08)
    assert statistics.pstdev(bg) / statistics.mean(bg) == pytest.approx(math.sqrt(2), rel=0.1)  # gamma k=0.5
    assert workload.rate_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in ((0, 1.0), (3, 0.0), (3, -1.0), (3, math.nan)):
        with pytest.raises(ValueError):
            workload.rate_arrivals(*bad)


def test_requests_are_sent_at_their_arrival_times() -> None:
    reqs = workload.rate_requests(trace.default_trace(), 30, 25.0, 3, 1.0, 64, 2)
    with fake(itl=0.001) as srv:
        res, m = run(srv.base_url, reqs)
    assert m["completed"] == 30
    late = [o.sent_s - r.at_s for r, o in zip(reqs, res.outcomes)]
    assert all(-0.001 <= d <= 0.25 for d in late), late  # never early; late by a loaded machine's delays
    assert sorted(late)[len(late) // 2] <= 0.05


def test_trace_lengths_are_the_rows_capped_and_cycled(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,100,7\n"
                    "2023-11-16 18:00:01.0,9000,900\n2023-11-16 18:00:02.0,0,0\n")
    got = workload.trace_lengths(str(path), 5, max_prompt=4000, max_output=256)
    assert got == [(100, 7, 0), (4000, 256, 1), (1, 1, 2), (100, 7, 0), (4000, 256, 1)]
    assert [o for _, o, _ in workload.trace_lengths(str(path), 3, 4000, 256, output_len=9)] == [9, 9, 9]


def test_a_trace_window_is_the_rows_in_it_at_their_own_times() -> None:
    """The window 10..30 s of the conversation trace, replayed twice as fast: exactly the rows
    whose timestamps fall in it, read here from the CSV on their own, each at (t - origin - 10) / 2."""
    path = tenant_plan.trace_path("conv")
    window = tenant_plan.Window(10.0, 20.0, 2.0, 4000)
    got = workload.window_requests(path, window, max_output=300)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:tenant_plan.TRACE_ROWS]
    origin = trace.parse_timestamp(rows[0]["TIMESTAMP"])
    want = [(i, (trace.parse_timestamp(r["TIMESTAMP"]) - origin - 10.0) / 2.0, r) for i, r in enumerate(rows)
            if 10.0 <= trace.parse_timestamp(r["TIMESTAMP"]) - origin < 30.0]
    assert len(got) == len(want) > 10
    for g, (i, at, r) in zip(got, want):
        assert g.row == i and g.at_s == pytest.approx(at, abs=1e-6) and 0 <= g.at_s < 10.0
        assert g.prompt_len == min(int(r["ContextTokens"]), 4000)
        assert g.output_len == min(int(r["GeneratedTokens"]), 300)
    with pytest.raises(ValueError, match="no request"):
        workload.window_requests(path, tenant_plan.Window(100000.0, 5.0, 1.0, 4000), 300)


def test_prompts_are_seeded_and_exact() -> None:
    p = workload.Prompts("ids", 300, seed=1)
    a, n = p.make(5, 40)
    assert n == 40 and len(a) == 40 and all(7 <= i < 300 for i in a)
    assert p.make(5, 40)[0] == a and p.make(6, 40)[0] != a and workload.Prompts("ids", 300, 2).make(5, 40)[0] != a
    with pytest.raises(ValueError):
        workload.Prompts("words", 300)
    with pytest.raises(ValueError):
        workload.prompt_ids(0, 3, 7, 0)


# --- failures and bounds --------------------------------------------------------------------------

def test_failures_are_counted_by_kind_and_the_rest_measured() -> None:
    """Of 12 requests one after the other, the 3rd, 6th, 9th and 12th get a 500, the 4th and 8th
    streams stop without an end, the 10th sends an error event: 7 failures, 5 measured."""
    reqs = [workload.Request(i, i * 0.02, 4, 4, i) for i in range(12)]
    with fake(itl=0.001, fail_every=3, drop_every=4, error_every=10) as srv:
        res, m = run(srv.base_url, reqs, max_concurrency=1)
    failed = {o.index for o in res.outcomes if o.error}
    assert failed == {2, 3, 5, 7, 8, 9, 11}
    assert m["failed"] == 7 and m["completed"] == 5 and m["cancelled"] == m["not_sent"] == 0
    assert m["failure_reasons"] == {"HTTP 500": 4, "the stream ended before the answer did (no finish_reason, no "
                                                  "[DONE])": 2, "error event": 1}
    assert all(res.outcomes[i].status == 500 for i in (2, 5, 8, 11))
    assert m["total_output_tokens"] == 20  # only the completed ones count


def test_unknown_model_refused_connection_and_timeout_are_failures() -> None:
    reqs = [workload.Request(0, 0.0, 4, 3, 0)]
    with fake(ttft=1.0) as srv:
        _, m = run(srv.base_url, reqs, model="nope")
        assert m["failure_reasons"] == {"HTTP 404": 1}
        _, m = run(srv.base_url, reqs, request_timeout_s=0.2)
        assert m["failed"] == 1 and m["failure_reasons"] == {"timeout": 1}
    # nothing listens there any more
    res, m = run(srv.base_url, reqs)
    assert m["failed"] == 1 and "Connect" in res.outcomes[0].error


def test_the_time_bound_cuts_and_counts() -> None:
    """Sending stops at max_time; what is in flight then gets drain seconds, then is cancelled."""
    reqs = [workload.Request(i, i * 0.2, 4, 50, i) for i in range(10)]
    with fake(itl=0.05) as srv:
        res, m = run(srv.base_url, reqs, max_time_s=0.5, drain_s=0.3)
    assert res.cut and m["not_sent"] == 7 and m["cancelled"] == 3 and m["completed"] == 0 and m["failed"] == 0
    assert res.duration_s < 1.5


def test_only_loopback_is_load_tested() -> None:
    for ok in ("http://127.0.0.1:8000/", "http://localhost:1", "https://[::1]:9", "http://127.3.4.5"):
        loadgen.check_loopback(ok)
    for bad in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:80"):
        with pytest.raises(ValueError, match="loopback"):
            loadgen.check_loopback(bad)
        assert loadgen.check_loopback(bad, allow_remote=True) == bad
    for bad in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://127.0.0.1:99999", "http://"):
        with pytest.raises(ValueError):
            loadgen.check_loopback(bad)


# --- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ["--request-rate", "0"], ["--request-rate", "fast"], ["--request-rate", "1,-2"], ["--num-prompts", "0"],
    ["--base-url", "http://10.1.2.3:8000"], ["--base-url", "localhost:8000"], ["--trace-window", "999999,10"],
    ["--trace-window", "10"], ["--trace-window", "1,2", "--request-rate", "1"], ["--goodput", "ttft:-1"],
    ["--goodput", "speed:3"], ["--force-output", "always"], ["--max-time", "0"], ["--max-time", "nan"],
    ["--trace", "/nonexistent.csv"], ["--endpoint", "embeddings"], ["--prompts", "words"], ["--burstiness", "0"],
    ["--max-output", "0"], ["--warmup", "-1"], ["--tokenizer", "/nonexistent"],
    ["--model", "m", "--prompts", "ids"],  # no vocabulary to draw ids from
    ["--num-prompts", "100001"], ["--api-key", "two words"], ["--trace", os.path.join(TESTS, "serve_fake.py")],
    ["--trace", "/dev/null"],
])
def test_bad_flags_are_one_usage_line_before_any_request(flags, tmp_path, capsys) -> None:
    import serve_bench

    with pytest.raises(SystemExit) as e:
        serve_bench.main(["--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    assert ": error: " in err[-1] and flags[0] in err[-1] or "--prompts" in flags, err


def test_an_unreachable_server_is_exit_1(tmp_path, capsys) -> None:
    need_server_stack()
    import serve_bench

    assert serve_bench.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--vocab-size", "99", "--prompts",
                             "ids", "--ready-timeout", "1", "--out", str(tmp_path)]) == 1
    assert "did not answer" in capsys.readouterr().err


def test_serve_bench_end_to_end_on_the_fake(tmp_path, capsys) -> None:
    """Two rates and the outputs: the JSON's metrics, every request's record, the table, the SVG."""
    import json
    import xml.etree.ElementTree as ET

    with fake(ttft=0.01, itl=0.002) as srv:
        import serve_bench

        rc = serve_bench.main(["--base-url", srv.base_url, "--prompts", "ids", "--vocab-size", "500",
                               "--num-prompts", "8", "--request-rate", "40,inf", "--max-prompt", "64",
                               "--max-output", "6", "--goodput", "ttft:1000", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fake at http://127.0.0.1" in out and " 40 |" in out and " inf |" in out
    def strict(c: str) -> None:
        raise ValueError(f"not strict JSON: {c}")

    doc = json.loads((tmp_path / "serve_bench.json").read_text(), parse_constant=strict)
    assert [r["rate"] for r in doc["runs"]] == ["40", "inf"]
    for r in doc["runs"]:
        assert r["metrics"]["completed"] == 8 and r["metrics"]["good_requests"] == 8
        assert [q["tokens"] for q in r["per_request"]] == [q["output_len"] for q in r["per_request"]]
    assert ET.parse(tmp_path / "serve_bench.svg").getroot().tag.endswith("svg")


# --- the drivers' pure pieces ---------------------------------------------------------------------

def test_flatness_tells_a_leak_from_a_level() -> None:
    mib = 2**20
    level = [{"t": t, "gpu_used": (1000 + (t % 7) * 30) * mib, "rss": 500 * mib} for t in range(0, 600, 5)]
    leak = [{"t": t, "gpu_used": 1000 * mib, "rss": (500 + t * 0.5) * mib} for t in range(0, 600, 5)]
    tol = {"gpu_used": 256 * mib, "rss": 128 * mib}
    f = serve_steady.flatness(level, 0.0, 600.0, 60.0, tol)
    assert f["gpu_used"]["flat"] and f["rss"]["flat"] and f["gpu_used"]["max_minus_min_mib"] == pytest.approx(180)
    f = serve_steady.flatness(leak, 0.0, 600.0, 60.0, tol)
    assert f["gpu_used"]["flat"] and not f["rss"]["flat"]
    assert f["rss"]["slope_mib_per_min"] == pytest.approx(30.0) and f["rss"]["drift_mib"] == pytest.approx(267.5)
    assert serve_steady.flatness(leak[:2], 0.0, 600.0, 0.0, tol)["rss"]["flat"] is None


def test_a_tenants_demand_is_its_requests_in_flight_at_full_length() -> None:
    reqs = [{"sent_s": 0.0, "e2el_s": 2.0, "prompt_len": 10, "output_len": 10},
            {"sent_s": 1.0, "e2el_s": 2.0, "prompt_len": 30, "output_len": 0},
            {"sent_s": 5.0, "e2el_s": 1.0, "prompt_len": 5, "output_len": 5},
            {"sent_s": None, "e2el_s": None, "prompt_len": 99, "output_len": 99}]
    peak, steps = smt.demand(reqs, token_bytes=2)
    assert peak == (20 + 30) * 2
    assert smt.over_share_s(steps, share=45) == pytest.approx(2.0)  # 1..2 s at 100 bytes, 2..3 s at 60
    assert smt.over_share_s(steps, share=30) == pytest.approx(3.0)  # 0..3 s
    assert smt.scrape('# HELP x\nvmem:a{m="x"} 3\nvmem:h_bucket{le="1"} 2\nother 4\nvmem:b 1e3\n') == \
        {'vmem:a{m="x"}': 3.0, "vmem:b": 1000.0}
