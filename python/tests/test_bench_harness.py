"""The pure pieces of the benches' harness (python/benches/harness): the one percentile against
numpy's, the one trace loader on the bundled and shared Azure traces, the one table printer, and
the serving metrics built on them. Runs without torch; the prompt sampler skips without it."""

from __future__ import annotations

import csv
import math
import os
import random

import numpy as np
import pytest
from harness import stats, table, trace

# ``harness`` is python/benches/harness, found through pytest's pythonpath (python/pyproject.toml).

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# ../shared beside the checkout (a worktree under wt/ has it one level further up)
SHARED_CONV = next((p for p in (os.path.join(REPO, *[".."] * up, "shared", "traces", "AzureLLMInferenceTrace_conv.csv")
                                for up in (1, 2)) if os.path.isfile(p)), "")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 101, 257, 1000])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_is_numpys_nearest_rank(n: int, q: float) -> None:
    rng = random.Random(n * 1000 + int(q * 10))
    xs = [rng.expovariate(1.0) for _ in range(n)]
    assert stats.percentile(xs, q) == np.percentile(xs, q, method="nearest")
    assert stats.percentile(xs, q, "rank") == np.percentile(xs, q, method="inverted_cdf")


def test_percentile_takes_a_value_of_the_data_and_refuses_bad_ranks() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 99) == 5.0
    assert stats.percentile(xs, 0) == 1.0
    assert math.isnan(stats.percentile([], 50))
    for q in (-1, 100.5, float("nan")):
        with pytest.raises(ValueError, match="percentile"):
            stats.percentile(xs, q)


def read_rows(path: str, n: int) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:n]
    return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]


@pytest.mark.parametrize("name", ["azure-conv-2023-first2000.csv", "azure-code-2023-first2000.csv"])
def test_trace_loader_reads_the_bundled_traces(name: str) -> None:
    path = os.path.join(REPO, "vmem-cli", "data", "traces", name)
    got = trace.load_trace(path, n=2000, cap=4000)
    want = read_rows(path, 2000)
    assert [(r.context, r.generated) for r in got] == want
    assert [r.prompt_len for r in got] == [max(1, min(c, 4000)) for c, _ in want]
    assert [r.index for r in got] == list(range(2000))
    assert max(r.prompt_len for r in got) == 4000  # the cap bit: the trace has longer prompts
    assert trace.prompt_lengths(path, 5, 64) == [min(c, 64) for c, _ in want[:5]]


def test_trace_loader_default_is_the_bundled_conversation_trace() -> None:
    assert os.path.isfile(trace.default_trace())
    assert trace.load_trace(None, n=3) == trace.load_trace(trace.default_trace(), n=3)
    assert [r.context for r in trace.load_trace(n=3)] == [374, 396, 879]


@pytest.mark.skipif(not os.path.isfile(SHARED_CONV), reason="the shared traces (../shared/traces) are not here")
def test_trace_loader_reads_the_shared_full_trace() -> None:
    got = trace.load_trace(SHARED_CONV, n=5000, cap=8192)
    assert [(r.context, r.generated) for r in got] == read_rows(SHARED_CONV, 5000)


def write_csv(tmp_path, text: str) -> str:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, match", [
    ("TIMESTAMP,Context,GeneratedTokens\nx,1,2\n", "missing columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nx,12,2\nx,ten,2\n", "row 3"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nx,-4,2\n", "negative"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nx,5,2\n", "1 requests, 2 asked"),
    ("", "missing columns"),
])
def test_trace_loader_refuses_malformed_files(tmp_path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trace.load_trace(write_csv(tmp_path, text), n=2)


def test_trace_loader_refuses_zero_requests_and_caps_zero_contexts_at_one(tmp_path) -> None:
    path = write_csv(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nx,0,3\n")
    assert trace.load_trace(path, n=1)[0].prompt_len == 1
    for n, cap in ((0, 10), (1, 0)):
        with pytest.raises(ValueError, match="at least 1"):
            trace.load_trace(path, n=n, cap=cap)
    with pytest.raises(FileNotFoundError):
        trace.load_trace(str(tmp_path / "absent.csv"), n=1)


def test_random_prompts_have_the_lengths_and_are_seeded() -> None:
    pytest.importorskip("torch", reason="the prompt sampler draws with torch's generator")
    a = trace.random_prompts([3, 1, 5], vocab=50, seed=7)
    assert [len(p) for p in a] == [3, 1, 5]
    assert all(3 <= t < 50 for p in a for t in p)
    assert a == trace.random_prompts([3, 1, 5], vocab=50, seed=7)
    assert a != trace.random_prompts([3, 1, 5], vocab=50, seed=8)


def test_table_aligns_columns_and_formats_cells() -> None:
    rows = [{"name": "paged-sdpa-256", "tok_s": 911.4, "ratio": 1.0, "n": 3, "gone": None},
            {"name": "vmem", "tok_s": 8254.04, "ratio": 9.0567, "n": 12}]
    text = table.format_table(rows, ["name", "tok_s", "ratio", "n", "gone"], title="runs")
    assert text.split("\n") == [
        "runs",
        "          name |  tok_s | ratio |  n | gone",
        "-------------------------------------------",
        "paged-sdpa-256 |  911.4 | 1.000 |  3 |    -",
        "          vmem | 8254.0 | 9.057 | 12 |    -",
    ]
    with pytest.raises(ValueError, match="column"):
        table.format_table(rows, [])
    assert table.format_table([], ["a", "bb"]).split("\n") == ["a | bb", "------"]


def test_serving_metrics_from_token_times() -> None:
    created = [0.0, 1.0, 2.0]
    times = [[0.5, 1.0, 1.5], [1.25, 2.0], []]
    m = stats.serving_metrics(0.0, created, times, expected_tokens=3)
    assert m["requests"] == 3 and m["generated_tokens"] == 5
    assert m["makespan_s"] == 2.0 and m["tok_per_s"] == 2.5
    ttft, tbt = [0.5, 0.25], [0.5, 0.5, 0.75]
    assert m["ttft_p50_s"] == np.percentile(ttft, 50, method="nearest")
    assert m["tbt_mean_ms"] == pytest.approx(1e3 * sum(tbt) / len(tbt))
    assert m["ttft_p99_s"] == 0.5 and m["ttft_mean_s"] == pytest.approx(0.375)
    assert m["tbt_p50_ms"] == 500.0 and m["tbt_p99_ms"] == 750.0
    assert m["requests_wrong_token_count"] == 2
    assert m["tbt_gaps"] == 3 and m["tbt_slow_gaps"] == 1 and m["tbt_stalled_gaps"] == 0  # 0.75 > 1.25 x 0.5
    stalled = stats.serving_metrics(0.0, [0.0], [[0.0, 1.0, 2.0, 3.0, 10.0]])
    assert (stalled["tbt_slow_gaps"], stalled["tbt_stalled_gaps"]) == (1, 1)  # 7 s past 4 x 1 s
    with pytest.raises(ValueError, match="differ in length"):
        stats.serving_metrics(0.0, [0.0], [])
    empty = stats.serving_metrics(0.0, [0.0], [[]])
    assert math.isnan(empty["tok_per_s"]) and math.isnan(empty["tbt_p99_ms"])


def parser():
    import argparse

    return argparse.ArgumentParser(prog="bench")


def usage_error(capsys, check, *args) -> str:
    """The one line ``check`` prints on a usage error (argparse exits 2)."""
    with pytest.raises(SystemExit) as e:
        check(parser(), *args)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_flag_checks_name_the_flag_in_one_usage_line(capsys) -> None:
    from types import SimpleNamespace

    from harness import cli

    args = SimpleNamespace(requests=0, warmup=-1, max_batch_tokens=None, rounds=2)
    line = usage_error(capsys, cli.check_counts, args, ["--max-batch-tokens", "--rounds", "--requests"])
    assert line == "bench: error: --requests must be at least 1, got 0"
    line = usage_error(capsys, cli.check_counts, SimpleNamespace(warmup=-1), [], ["--warmup"])
    assert line == "bench: error: --warmup must be at least 0, got -1"
    cli.check_counts(parser(), SimpleNamespace(warmup=0, rounds=1), ["--rounds"], ["--warmup"])
    for v in (0.0, -0.5, 1.5, float("nan")):
        line = usage_error(capsys, cli.check_fraction, "--memory-percent", v)
        assert "--memory-percent must be a fraction in (0, 1]" in line
        if not v > 0:
            assert "--timeout must be more than 0 seconds" in usage_error(capsys, cli.check_seconds, "--timeout", v)
    cli.check_fraction(parser(), "--memory-percent", 1.0)
    cli.check_seconds(parser(), "--timeout", 0.5)
    assert cli.names(parser(), "--modes", " decode, prefill,", ["decode", "prefill"]) == ["decode", "prefill"]
    assert cli.names(parser(), "--archs", ",", ["a"], allow_none=True) == []
    assert usage_error(capsys, cli.names, "--modes", "decode,foo", ["decode"]) == \
        "bench: error: --modes: unknown 'foo' (known: ['decode'])"
    assert usage_error(capsys, cli.names, "--contenders", ",", ["a"]) == "bench: error: --contenders names none (known: ['a'])"
    assert cli.int_list("256, 16") == [256, 16]
    for bad in ("", "x", "16,0", "1.5"):
        assert "--batches: " in usage_error(capsys, cli.check_int_list, "--batches", bad)


@pytest.mark.parametrize("script, flags", [
    ("kernel_study", ["--batches", "1,x"]), ("kernel_study", ["--contexts", "0"]),
    ("kernel_study", ["--modes", "decode,foo"]), ("kernel_study", ["--contenders", "nope"]),
    ("kernel_study", ["--reps", "0"]), ("kernel_study", ["--mem-frac", "0"]), ("kernel_study", ["--tol", "nan"]),
    ("serving_check", ["--archs", "foo"]), ("serving_check", ["--requests", "0"]),
    ("serving_check", ["--new-tokens", "-1"]), ("serving_check", ["--tol", "0"]),
])
def test_study_and_check_refuse_bad_flags_with_one_usage_line(script, flags, tmp_path, capsys) -> None:
    """kernel_study.py raised ValueError tracebacks on a bad list or ran a mode named 'foo' as a
    prefill; serving_check.py ran an unknown arch into a traceback, or no requests at all."""
    pytest.importorskip("transformers", reason="the scripts import torch and transformers")
    mod = __import__(script)
    with pytest.raises(SystemExit) as e:
        mod.main(["--tiny", "--out", str(tmp_path), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2, last
    assert ": error: " in last and flags[0] in last, last


def test_the_round_report_gives_each_kinds_tail():
    """100 decode rounds of 1..100 ms and one prefill round: the decode line's median, p90 and
    p99 are the rounds' (the tail time-between-tokens p99 sees), the parts are medians."""
    stepprofile = pytest.importorskip("harness.stepprofile", reason="the profiler needs torch")
    rounds = [{"kind": "decode", "wall_ns": ms * 1_000_000, "hooks": {"prepare": 1_000_000}, "sequences": 4,
               "tokens": 4, "padded_tokens": 8, "calls": {"capture": 1} if ms in (7, 100) else {}}
              for ms in range(1, 101)]
    rounds.append({"kind": "prefill", "wall_ns": 7_000_000, "hooks": {}, "sequences": 1, "tokens": 300,
                   "padded_tokens": 512})
    lines = stepprofile.round_report(rounds, kernel_ms=2528.5).splitlines()  # of 5,057 ms
    assert "kernels 50.0% of it" in lines[0] and "p90 ms  p99 ms" in lines[1]
    decode = lines[2].split()
    assert decode[:5] == ["decode", "100", "50.50", "90.00", "99.00"] and decode[5] == "1.00"  # nearest rank
    assert decode[-1] == "2"  # graphs captured
    assert lines[3].startswith("  slowest 1: wall 100.00 ms; prepare 1.00, compute 0.00, update 0.00, other 99.00")
    assert lines[3].endswith("; 1 captured a CUDA graph")
    assert lines[4].split()[:5] == ["prefill", "1", "7.00", "7.00", "7.00"] and len(lines) == 5  # no tail of 1
