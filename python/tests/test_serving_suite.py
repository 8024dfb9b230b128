"""The serving suite (python/benches/serving_suite.py, issue #32 items 5 and 6): the roofline's
formula on numbers checked by hand, the budgets, the ratios, the merge, the registry lookup
and a ``--tiny`` run on the CPU end to end."""

from __future__ import annotations

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
from harness import roofline as rf

# A shape small enough to add up by hand: qkv 4 x (2 + 2) x 2 = 32, o 2 x 2 x 4 = 16,
# MLP 3 x 4 x 8 = 96 -> 144 per layer; head 4 x 10 = 40.
SHAPE = rf.ModelShape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10, itemsize=2)


def test_shape_sums_its_matmuls_and_kv_by_hand() -> None:
    assert SHAPE.layer_matmul_params == 144
    assert SHAPE.head_params == 40
    assert SHAPE.decode_weight_bytes == (2 * 144 + 40) * 2 == 656
    assert SHAPE.token_kv_bytes == 2 * 2 * 1 * 2 * 2 == 16


def test_shape_of_llama3_8b_config() -> None:
    pytest.importorskip("transformers")
    from harness.models import llama3_8b_config

    s = rf.ModelShape.from_config(llama3_8b_config(8), itemsize=2)
    # q 4096x4096, k and v 4096x1024 each, o 4096x4096, MLP 3 x 4096x14336: Llama-3-8B's 218M a layer
    assert s.layer_matmul_params == 218_103_808
    assert s.token_kv_bytes == 32_768  # 2 x 8 layers x 8 heads x 128 x 2 bytes: the engine's token_bytes
    assert s.head_params == 4096 * 128256


def test_prefill_flops_by_hand() -> None:
    # n = 3: matmuls 2 x 3 x 2 x 144 = 1728, logits 2 x 40 = 80, attention 2 x 2 x 2 x 2 x 3 x 4 = 192
    assert rf.prefill_flops(SHAPE, [3]) == 2000
    # n = 1: 576 + 80 + 2 x 2 x 2 x 2 x 1 x 2 = 32
    assert rf.prefill_flops(SHAPE, [1, 3]) == 688 + 2000


def test_decode_reads_and_steps_by_hand() -> None:
    w = rf.Workload(prompt_lens=(3, 5), new_tokens=4, budget_tokens=100, max_batch_tokens=100)
    assert rf.decode_tokens(w) == 6
    assert rf.kv_token_reads(w) == (4 + 5 + 6) + (6 + 7 + 8) == 36
    assert rf.decode_steps(w) == 3  # the longest request's 3 decode tokens
    # max_batch_tokens binds: 6 decode tokens, 1 a step
    assert rf.decode_steps(rf.Workload((3, 5), 4, 100, 1)) == 6
    # the budget binds: 36 token-steps of KV, 5 tokens held a step -> 8 steps
    assert rf.decode_steps(rf.Workload((3, 5), 4, 5, 100)) == 8
    assert rf.decode_steps(rf.Workload((3, 5), 1, 5, 100)) == 0  # the prefill makes the only token
    assert rf.kv_token_reads(rf.Workload((3, 5), 1, 5, 100)) == 0


def test_lower_bound_by_hand() -> None:
    w = rf.Workload(prompt_lens=(3, 5), new_tokens=4, budget_tokens=100, max_batch_tokens=100)
    b = rf.lower_bound(SHAPE, w, rf.Peaks(matmul_flops=1000.0, copy_bytes=100.0))
    # prefill: 2000 + (2880 + 80 + 480) = 5440 FLOPs at 1000/s; decode: 3 x 656 + 36 x 16 = 2544 B at 100/s
    assert b["prefill_flops"] == 5440
    assert b["weight_bytes"] == 1968 and b["kv_read_bytes"] == 576
    assert b["prefill_s"] == pytest.approx(5.44)
    assert b["decode_s"] == pytest.approx(25.44)
    assert b["bound_s"] == pytest.approx(30.88)
    # a smaller budget only adds steps (weight reads), never KV bytes
    tight = rf.lower_bound(SHAPE, rf.Workload((3, 5), 4, 5, 100), rf.Peaks(1000.0, 100.0))
    assert tight["kv_read_bytes"] == 576 and tight["weight_bytes"] == 8 * 656


@pytest.mark.parametrize("kw", [{"layers": 0}, {"vocab": -1}, {"heads": True}, {"hidden": 4.0}])
def test_shape_refuses_what_is_no_count(kw) -> None:
    args = {**vars(SHAPE), **kw}
    with pytest.raises(ValueError, match=f"ModelShape.{next(iter(kw))}"):
        rf.ModelShape(**args)


@pytest.mark.parametrize("args, match", [
    (((), 4, 10, 10), "prompts of at least 1"), (((3, 0), 4, 10, 10), "prompts of at least 1"),
    (((3,), 0, 10, 10), "new_tokens"), (((3,), 4, 0, 10), "budget_tokens"), (((3,), 4, 10, "8"), "max_batch_tokens"),
])
def test_workload_refuses_what_cannot_be_served(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        rf.Workload(*args)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1e12"])
def test_peaks_refuse_what_is_no_rate(bad) -> None:
    with pytest.raises(ValueError, match="Peaks.matmul_flops"):
        rf.Peaks(matmul_flops=bad, copy_bytes=1.0)


def test_measure_peaks_on_the_cpu_gives_rates() -> None:
    torch = pytest.importorskip("torch")
    p = rf.measure_peaks("cpu", torch.float32, n=64, copy_mib=1, reps=2)
    assert math.isfinite(p.matmul_flops) and p.matmul_flops > 0
    assert math.isfinite(p.copy_bytes) and p.copy_bytes > 0


def test_budgets_fit_everyone_or_a_tenth() -> None:
    pytest.importorskip("transformers", reason="harness.suite imports the contenders (torch, transformers)")
    from harness import suite

    # requests of 100 + 10 and 600 + 10 tokens, granule 256: 256 + 768 rounded, + one granule
    assert suite.budget_tokens("fits", [100, 600], 10, 256, 0.1) == 256 + 768 + 256
    # a tenth of 720 tokens is 72, below the largest request rounded up plus a granule
    assert suite.budget_tokens("tenth", [100, 600], 10, 256, 0.1) == 768 + 256
    lens = [1000] * 100  # 101,000 tokens of working set: a tenth is 10,100
    assert suite.budget_tokens("tenth", lens, 10, 256, 0.1) == 10_100
    with pytest.raises(ValueError, match="unknown budget"):
        suite.budget_tokens("half", lens, 10, 256, 0.1)
    with pytest.raises(ValueError, match="fraction"):
        suite.budget_tokens("tenth", lens, 10, 256, 0.0)
    # vmem's per-layer 2 MB page holds 1,024 tokens of Llama-3-8B's one layer (8 x 128 x 2 bytes)
    assert suite.granule_tokens(rf.ModelShape(8, 4096, 14336, 32, 8, 128, 128256, 2), 2 << 20) == 1024
    assert suite.granule_tokens(SHAPE, 64) == 256  # the engine's block when vmem's page is smaller


def test_ratios_take_the_engine_best_native_and_fi_paged_per_workload(monkeypatch) -> None:
    pytest.importorskip("transformers")
    from harness import suite

    ct = suite.ct
    reg = {"paged-sdpa-256": {"attn": "paged|sdpa"}, "paged-sdpa-16": {"attn": "paged|sdpa"},
           "paged-flex-256": {"attn": ct.BLOCKFLEX_ATTENTION}, "fi-paged": {"attn": ct.FI_PAGED_ATTENTION},
           "vmem-token-major": {"attn": ct.VMEM_ATTENTION}}
    monkeypatch.setattr(suite, "registry", lambda: reg)

    def row(name: str, tok: float | None, budget: str = "fits") -> dict:
        return {"contender": name, "trace": "conv", "model": "m", "budget": budget, "round": 0, "tok_s": tok}

    rows = [row("paged-sdpa-256", 100.0), row("paged-sdpa-16", 50.0), row("paged-flex-256", 400.0),
            row("fi-paged", 500.0), row("vmem-token-major", 1000.0),
            row("paged-sdpa-256", 10.0, "tenth"), row("vmem-token-major", 60.0, "tenth"),
            row("fi-paged", None, "tenth")]
    suite.add_ratios(rows)
    # the engine's best is paged-sdpa-256 (100): blockflex and fi-paged are the harness's, not the engine's
    assert rows[4]["vs_engine_best"] == 10.0 and rows[4]["vs_fi_paged"] == 2.0
    assert rows[1]["vs_engine_best"] == 0.5 and rows[2]["vs_engine_best"] == 4.0
    # per budget: 60 / 10; fi-paged failed there (no tok/s), so no ratio
    assert rows[6]["vs_engine_best"] == 6.0 and rows[6]["vs_fi_paged"] is None
    assert rows[7]["vs_engine_best"] is None


def fake_rows(contenders: list[str], budget: str) -> list[dict]:
    return [{"contender": c, "trace": "conv", "model": "m", "budget": budget, "round": 0, "tok_s": 10.0 * (i + 1),
             "roofline": 0.1 * (i + 1)} for i, c in enumerate(contenders)]


def test_merge_combines_parts_and_a_later_run_replaces_an_earlier(tmp_path) -> None:
    from harness import suite_report

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    suite_report.save(str(a), [{"device": "A"}], fake_rows(["x", "y"], "fits"), [{"model": "m", "contender": "x"}])
    rows_b = fake_rows(["y"], "fits") + fake_rows(["x"], "tenth")
    rows_b[0]["tok_s"] = 99.0
    suite_report.save(str(b), [{"device": "B"}], rows_b, [])
    parts, rows, checks = suite_report.merge([str(a), str(b)])
    assert [p["device"] for p in parts] == ["A", "B"]
    got = {(r["contender"], r["budget"]): (r["tok_s"], r["part"]) for r in rows}
    assert got == {("x", "fits"): (10.0, 0), ("y", "fits"): (99.0, 1), ("x", "tenth"): (10.0, 1)}
    assert checks == [{"model": "m", "contender": "x"}]
    svg = (a / "suite.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2 * 2 + 2  # 2 bars x 2 panels + 2 legend keys
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "suite.json").write_text('{"rows": 3}')
    with pytest.raises(ValueError, match="not a suite result"):
        suite_report.merge([str(a), str(tmp_path / "c")])
    with pytest.raises(ValueError, match="suite.json"):
        suite_report.merge([str(tmp_path / "nowhere")])


@pytest.mark.parametrize("flags, match", [
    (["--only", "contender=nope"], "--only contender: unknown 'nope'"),
    (["--only", "color=red"], "expected KEY=NAME"),
    (["--only", "trace="], "--only trace names none"),
    (["--profile", "nope"], "--profile: unknown 'nope'"),
    (["--profile", "paged-sdpa-256@clean"], "--profile: unknown 'paged-sdpa-256@clean'"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--tenth", "0"], "--tenth must be a fraction"),
    (["--tenth", "nan"], "--tenth must be a fraction"),
    (["--check-requests", "-1"], "--check-requests must be at least 0"),
    (["--requests", "2001"], "2000 requests, 2001 asked"),
    (["--page-size", "bogus"], "--page-size"), (["--page-size", "3"], "is not one of vmem's page sizes"),
    (["--page-size", "4K"], "is not one of vmem's page sizes"), (["--timeout", "0"], "--timeout must be more than 0"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1"),
    (["--out", "/proc/version/x"], "--out '/proc/version/x' cannot be created"),
    (["--schedule", "--page-size", "128K"], "no other size does"),
])
def test_suite_refuses_bad_flags_with_one_usage_line(flags, match, tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="serving_suite.py imports the contenders")
    import serving_suite

    with pytest.raises(SystemExit) as e:
        serving_suite.main(["--tiny", "--out", str(tmp_path / "o"), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2, last
    assert match in last, last


def test_suite_merge_refuses_what_is_no_result(tmp_path, capsys) -> None:
    import serving_suite

    with pytest.raises(SystemExit) as e:
        serving_suite.main(["--merge", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "--merge: " in capsys.readouterr().err


def test_profile_of_what_the_engine_refuses_stops_with_one_line_and_exit_1(tmp_path, capsys) -> None:
    """The engine refuses async batching without CUDA: --profile says so in one line on stderr,
    prints nothing on stdout and writes no profile.txt (before: the engine's traceback)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("the engine runs async batching on a GPU: nothing to refuse")
    import serving_suite

    out = tmp_path / "o"
    rc = serving_suite.main(["--tiny", "--requests", "2", "--new-tokens", "2", "--max-prompt", "50",
                             "--only", "model=llama3-8b-x8", "--only", "trace=conv",
                             "--profile", "vmem-token-major-graphs-async-compile", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert cap.out == ""
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("serving_suite: --profile vmem-token-major-graphs-async-compile on conv/llama3-8b-x8/fits "
                           "failed: RuntimeError: "), cap.err
    # No traceback of the engine's (which ends in a line "RuntimeError: ..."); a logging handler
    # left on an earlier test's closed stream may print its own "--- Logging error ---".
    assert not any(x.startswith("RuntimeError") for x in cap.err.splitlines()), cap.err
    assert not (out / "profile.txt").exists()


def test_profile_on_a_full_disk_says_so_and_keeps_the_files_before(tmp_path, capsys, monkeypatch) -> None:
    """Writing profile.txt or rounds.jsonl fails (ENOSPC): one line naming the file, exit 1,
    nothing on stdout, and both files of a run before stay as they were, with no ``.tmp`` left."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import serving_suite
    from harness import stepprofile

    monkeypatch.setattr(stepprofile, "profile", lambda *a, **k: ("the body", [{"kind": "decode", "wall_ns": 1}]))
    args = ["--tiny", "--requests", "2", "--new-tokens", "2", "--max-prompt", "50", "--only", "model=llama3-8b-x8",
            "--only", "trace=conv", "--profile", "vmem-per-layer", "--out", str(tmp_path)]
    assert serving_suite.main(args) == 0
    before = {n: read(str(tmp_path), n) for n in ("profile.txt", "rounds.jsonl")}
    assert "the body" in before["profile.txt"] and json.loads(before["rounds.jsonl"]) == {"kind": "decode", "wall_ns": 1}
    capsys.readouterr()
    real = open

    for failing in ("profile.txt", "rounds.jsonl"):
        monkeypatch.setattr("builtins.open", full_disk_at(failing + ".tmp"))
        monkeypatch.setattr(stepprofile, "profile", lambda *a, **k: ("another body", []))
        assert serving_suite.main(args) == 1
        monkeypatch.setattr("builtins.open", real)
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.strip().splitlines()[-1].startswith(
            f"serving_suite: --profile: writing {tmp_path / failing}: [Errno 28]"), cap.err
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
        assert {n: read(str(tmp_path), n) for n in before} == before


def test_a_full_disk_during_a_suite_run_is_one_line_and_keeps_the_last_whole_table(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """The suite saves its table after each run; a save that cannot be written ends the suite
    with one line naming the file and exit 1 (not a traceback), the last whole files kept."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import serving_suite
    from harness import suite, suite_report

    suite_report.save(str(tmp_path), [{"device": "before"}], fake_rows(["x"], "fits"), [])
    before = {n: read(str(tmp_path), n) for n in ("suite.json", "suite.txt", "suite.svg")}
    real = open

    def one_run(args, names, only, peaks, on_row):
        monkeypatch.setattr("builtins.open", full_disk_at("suite.svg.tmp"))
        on_row(fake_rows(["y"], "fits"), [])
        raise AssertionError("the save above must fail")

    monkeypatch.setattr(suite, "run_suite", one_run)
    code = serving_suite.main(["--tiny", "--requests", "2", "--new-tokens", "2", "--max-prompt", "50", "--only",
                               "model=llama3-8b-x8", "--only", "trace=conv", "--only", "contender=vmem-per-layer",
                               "--out", str(tmp_path)])
    monkeypatch.setattr("builtins.open", real)
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"serving_suite: writing {tmp_path / 'suite.svg'}: [Errno 28] No space left on device")
    assert {n: read(str(tmp_path), n) for n in before} == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read()


def full_disk_at(suffix: str, real=open):
    """An ``open`` that fails with ENOSPC for a path ending in ``suffix`` (a file being written
    beside its place, ``...tmp``) and opens anything else as ``real`` does."""
    import errno

    def fake(path, *a, **k):
        if str(path).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)
    return fake


def test_tiny_suite_runs_end_to_end_and_merges(tmp_path) -> None:
    """The CI smoke test: the whole pipeline on the CPU, one trace and model, both budgets, two
    contenders; then --profile and --merge of two parts."""
    pytest.importorskip("transformers")
    import serving_suite
    from harness import contenders as ct

    # the engine's own cache under the name the installed transformers serves (5.19+: no paged|)
    native = "paged-sdpa-256" if ct.family() == ct.V517 else "sdpa-256"
    clean = native + "@clean"  # the same contender in a process where vmem was never imported
    common = ["--tiny", "--requests", "4", "--new-tokens", "3", "--max-prompt", "100", "--check-requests", "2",
              "--check-tokens", "3", "--only", "model=llama3-8b-x8",
              "--only", f"contender={native},vmem-per-layer"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert serving_suite.main([*common[:-1], f"contender={native},vmem-per-layer,{clean}", "--only", "trace=conv",
                               "--out", a]) == 0
    data = json.loads(read(a, "suite.json"))
    rows = data["rows"]
    assert [(r["contender"], r["budget"]) for r in rows] == [
        (native, "fits"), ("vmem-per-layer", "fits"), (clean, "fits"),
        (native, "tenth"), ("vmem-per-layer", "tenth"), (clean, "tenth")]
    for r in rows:
        cell = [x for x in rows if x["budget"] == r["budget"]]
        inside, apart = cell[0]["tok_s"], cell[2]["tok_s"]
        assert r["completed"] == 4 and r["requests"] == 4 and r["tok_s"] > 0, r
        assert r["bound_s"] > 0 and r["roofline"] == pytest.approx(r["bound_s"] / r["wall_s"])
        assert r["vs_engine"] == pytest.approx(r["tok_s"] / inside)
        assert r["vs_engine_clean"] == pytest.approx(r["tok_s"] / apart)
        assert r["vs_engine_best"] == pytest.approx(r["tok_s"] / max(inside, apart))
        assert r["vs_fi_paged"] is None and r["device_mb"] is None  # no fi-paged here; no CUDA
    # the worker's own sys.modules after each run: no vmem module was ever imported there
    assert [r["vmem_modules"] for r in rows if r["contender"] == clean] == [[], []]
    assert all("vmem_modules" not in r for r in rows if r["contender"] != clean)
    assert rows[0]["kv_budget_mb"] > rows[3]["kv_budget_mb"]
    assert {c["contender"]: c["top1_agree"] == c["decisive"] > 0 for c in data["checks"]} == {
        native: True, "vmem-per-layer": True}  # the @clean row runs the engine's code checked here
    assert clean in read(a, "suite.txt") and "vs_engine_clean" in read(a, "suite.txt")
    assert data["parts"][0]["peaks"]["matmul_flops"] > 0
    for name in ("suite.txt", "suite.svg"):
        assert os.path.getsize(os.path.join(a, name)) > 0
    assert serving_suite.main([*common, "--only", "trace=code", "--only", "budget=tenth", "--check-requests", "0",
                               "--out", b]) == 0
    assert serving_suite.main([*common, "--only", "trace=code", "--profile", "vmem-per-layer", "--out", b]) == 0
    prof = read(b, "profile.txt")
    filed = [json.loads(line) for line in read(b, "rounds.jsonl").splitlines()]
    assert filed and {r["kind"] for r in filed} <= {"decode", "prefill"}
    assert all(r["wall_ns"] > 0 and "thread_ms" in r["extra"] for r in filed[:-1]), filed[0]
    assert "host in forward" in prof
    # the round clock (what a graph replay, which runs no forward hook, is profiled by)
    rounds = prof[prof.index("per engine round"):].splitlines()
    kinds = {line.split()[0]: line.split() for line in rounds[2:] if line.strip()}
    assert "prefill" in kinds and int(kinds["prefill"][1]) >= 1 and float(kinds["prefill"][2]) > 0, rounds
    # the tail probes, under the profiler and in the run again without it: vmem maps every round
    plain = prof[prof.index("again without torch.profiler"):]
    for part in (prof[:prof.index("again without")], plain):
        median = next(line for line in part.splitlines() if line.startswith("  median round's probes"))
        assert "vmem_map_n 1" in median and "vmem_round_n 1" in median, median
    assert "TBT p50" in plain and "slowest" in plain
    # the TBT tail's gaps set in the rounds (harness.tailgaps), in both runs; its p99 is the run's
    for part in (prof[:prof.index("again without")], plain):
        head = next(line for line in part.splitlines() if line.startswith("TBT tail: "))
        assert int(head.split()[2]) > 0 and "at or past p99" in part, head
    p99 = plain.split("TBT p50", 1)[1].split("p99 ", 1)[1].split(" ms", 1)[0]
    tail_head = next(line for line in plain.splitlines() if line.startswith("TBT tail: "))
    assert f"p99 {p99} ms" in tail_head, (p99, tail_head)
    # the timed window's accounting: from the first round on, the loop's turns tile the run (one
    # clock reading closes a turn and opens the next), so the rounds and idle turns cover all of
    # it but the print's rounding; the wait before the first round is the host's and can be long
    # on a loaded CI machine, so it is not held to a share (CPU: no device events to count)
    pattern = (r"the run's ([\d.]+) ms: engine rounds ([\d.]+) ms, idle loop turns \d+ \(([\d.]+) ms, "
               r"longest [\d.]+\), first round opened at ([\d.]+) ms, outside every turn (-?[\d.]+) ms")
    for part in (prof[:prof.index("again without")], plain):
        line = next(x for x in part.splitlines() if x.startswith("the run's "))
        m = re.fullmatch(pattern, line)
        assert m, line
        wall, rounds, idle, first, outside = map(float, m.groups())
        assert 0 < rounds <= wall + 1 and 0 <= first < wall, line
        assert rounds + idle >= wall - first - 1.5, line  # the turns cover the run after the first round
        assert outside == pytest.approx(wall - rounds - idle, abs=1.5), line
    assert "GPU busy: no device events in the timed window" in prof
    m = str(tmp_path / "m")
    assert serving_suite.main(["--merge", a, b, "--out", m]) == 0
    merged = json.loads(read(m, "suite.json"))
    assert len(merged["rows"]) == 8 and len(merged["parts"]) == 2
    assert "code" in read(m, "suite.txt")


def test_schedule_refuses_rows_past_the_map_count_with_the_fix_before_anything_runs(tmp_path, capsys,
                                                                                     monkeypatch) -> None:
    pytest.importorskip("transformers", reason="serving_suite.py imports the contenders")
    import serving_suite

    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    monkeypatch.setattr(serving_suite, "MAP_COUNT", str(limit))
    with pytest.raises(SystemExit) as e:
        serving_suite.main(["--schedule", "--only", "model=llama3-8b", "--out", str(tmp_path / "o")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2, last
    assert "need about 135680 memory mappings" in last and "vm.max_map_count is 65530" in last, last
    assert "sysctl -w vm.max_map_count=" in last and not (tmp_path / "o").exists()


def test_schedule_stand_ins_hold_the_gpu_runs_tokens_a_page() -> None:
    """A stand-in's 64K token-major page holds as many tokens as its model's 2M page: 16 at
    Llama-3-8B's 32 layers, 64 at 8 layers and at Llama-3.2-1B's 16 (its --tiny stand-in's 4
    layers would hold 32)."""
    pytest.importorskip("transformers")
    from harness import suite

    for name, tokens in (("llama3-8b", 16), ("llama3-8b-x8", 64), ("llama3.2-1b", 64)):
        real = rf.ModelShape.from_config(suite.model_config(name, False), 2)
        tiny = rf.ModelShape.from_config(suite.model_config(name, True, 8192, pages_like=True), 4)
        assert ((2 << 20) // real.token_kv_bytes, (64 << 10) // tiny.token_kv_bytes) == (tokens, tokens), name
    assert rf.ModelShape.from_config(suite.model_config("llama3.2-1b", True), 4).token_kv_bytes == 2048


def test_schedule_runs_the_stand_ins_under_the_runs_limits_and_reports_the_rounds(tmp_path) -> None:
    """--schedule keeps the rows, context and batch tokens given (--tiny caps them at 8 rows and
    2,048 tokens), so vmem holds more than 8 requests at once, the stand-in reads positions past
    2,048, and each row carries its rounds and requests at once (the table's columns)."""
    pytest.importorskip("transformers")
    import serving_suite
    from harness import contenders as ct

    native = "paged-sdpa-256" if ct.family() == ct.V517 else "sdpa-256"
    out = str(tmp_path / "s")
    assert serving_suite.main(["--schedule", "--requests", "20", "--new-tokens", "4", "--max-prompt", "2300",
                               "--max-requests", "24", "--max-context", "4096", "--max-batch-tokens", "8192",
                               "--check-requests", "0", "--warmup", "0", "--only", "model=llama3-8b-x8",
                               "--only", "trace=conv", "--only", "budget=fits",
                               "--only", f"contender={native},vmem-token-major", "--out", out]) == 0
    data = json.loads(read(out, "suite.json"))
    args = data["parts"][0]["args"]
    assert (args["max_requests"], args["max_context"], args["max_batch_tokens"]) == ("24", "4096", "8192")
    rows = {r["contender"]: r for r in data["rows"]}
    assert all(r["completed"] == 20 and r["rounds"] > 0 for r in rows.values()), rows
    assert rows["vmem-token-major"]["max_running"] > 8, rows["vmem-token-major"]
    header = read(out, "suite.txt").splitlines()[1]
    assert "| rounds |" in header and "| max_running |" in header, header


def test_gpu_busy_counts_the_union_inside_the_timed_window() -> None:
    """Overlapping device events count once in the busy time, events outside the timed mark not
    at all, and each class its own time."""
    torch = pytest.importorskip("torch")  # the torch-less stage skips it; the serving stage runs it
    from harness.engine import TIMED_MARK
    from harness.stepprofile import gpu_busy, kernel_class

    def ev(name: str, a: float, b: float, cuda: bool = True) -> SimpleNamespace:
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=a, end=b))

    events = [ev(TIMED_MARK, 1_000, 11_000, cuda=False),
              ev("nvjet_sm90_tst_144x64", 0, 2_000),  # half inside: 1 ms
              ev("nvjet_sm90_tst_144x64", 3_000, 6_000),  # 3 ms
              ev("flash_fwd_kernel", 5_000, 7_000),  # overlaps the last by 1 ms
              ev("index_elementwise_kernel", 20_000, 21_000)]  # after the window
    out = gpu_busy(SimpleNamespace(events=lambda: events), plain_wall_s=0.012)
    assert "5 of 10 ms (50.0%)" in out and "(12 ms): 41.7%" in out, out
    assert "GEMM 4 ms, attention 2 ms" in out and "KV write" not in out, out
    assert kernel_class("void at::native::vectorized_elementwise_kernel") == "other"
    assert kernel_class("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, "
                        "cutlass::bfloat16_t>>") == "attention"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma") == "attention"
    assert kernel_class("triton_per_fused__scaled_dot_product_cudnn_attention_0") == "attention"
    assert kernel_class("_slot_kernel") == "attention" and kernel_class("_combine_kernel") == "attention"
    assert kernel_class("nvjet_sm90_tst_96x64_64x10_2x1_v_bz_splitK_TNN") == "GEMM"
    assert kernel_class("triton_poi_fused__to_copy_add_mul_rsqrt_0") == "other"
    assert kernel_class("void at::native::index_elementwise_kernel<128, 4>") == "KV write / index"
    assert kernel_class("Memcpy HtoD (Pinned -> Device)") == "copy / fill"
    assert "no timed mark" in gpu_busy(SimpleNamespace(events=lambda: events[1:]))


def test_the_clean_worker_imports_no_vmem_and_the_suite_refuses_a_row_that_did() -> None:
    """The check written into a ``@clean`` result: the worker's ``sys.modules`` after the run
    holds no vmem module; the same check in this process (which imported vmem) names it, and a
    result naming one is refused as the row's error, not reported as the engine's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from harness import clean, suite
    from harness import contenders as ct
    from harness import roofline as rf
    from harness.trace import random_prompts

    assert "vmem" in clean.vmem_modules()
    native = "paged-sdpa-256" if ct.family() == ct.V517 else "sdpa-256"
    config = suite.model_config("llama3-8b-x8", tiny=True)
    prompts = random_prompts([20, 9], config.vocab_size, 0)
    args = SimpleNamespace(new_tokens=2, memory_percent=0.9, timeout=120.0, graph_warmup=True, tenth=0.1,
                           max_batch_tokens=64)
    shape = rf.ModelShape.from_config(config, 4)
    w = suite.workload("conv", "llama3-8b-x8", "fits", prompts, shape, args, 64 << 10)
    peaks = rf.Peaks(matmul_flops=1e9, copy_bytes=1e9)
    with clean.CleanEngine(config, torch.float32, "cpu") as worker:
        row = suite.run_one(None, w, native + clean.SUFFIX, args, shape, peaks, 0, worker)
    assert "error" not in row and row["vmem_modules"] == [] and row["completed"] == 2, row

    class Leaky:
        def run(self, *a, **k):
            return {**row, "vmem_modules": ["vmem", "vmem.transformers"]}

    bad = suite.run_one(None, w, native + clean.SUFFIX, args, shape, peaks, 0, Leaky())
    assert bad["completed"] == 0 and "vmem was imported in the vmem-free process" in bad["error"], bad
    assert clean.is_clean(native + "@clean") and clean.base(native + "@clean") == native


def test_the_defaults_run_the_engines_best_in_both_processes() -> None:
    pytest.importorskip("transformers")
    from harness import contenders as ct
    from harness import suite

    names, reg = suite.default_contenders(), suite.registry()
    best = ct.engine_best()
    assert best in names and best + "@clean" in names and all(n in reg for n in names)
    assert reg[best + "@clean"] == reg[best] and suite.is_engine_native(best + "@clean", reg[best + "@clean"])
    assert not any(n.endswith("@clean") for n in reg if not suite.is_engine_native(n, reg[n]))
    assert suite.MODELS[0] == "llama3-8b" and suite.model_config("llama3-8b", False).num_hidden_layers == 32
    assert [suite.model_config(m, False).num_hidden_layers for m in suite.MODELS] == [32, 8, 16]
    assert [suite.model_config(m, True).num_hidden_layers for m in suite.MODELS] == [8, 2, 4]


def test_merge_on_a_full_disk_is_one_line_and_keeps_the_merge_before(tmp_path, capsys, monkeypatch) -> None:
    """--merge whose suite.svg cannot be written: one line naming it, exit 1, nothing on stdout,
    and the merged output of a run before stays whole."""
    pytest.importorskip("transformers", reason="--merge's ratios import the contenders")
    import serving_suite
    from harness import suite_report

    a, out = tmp_path / "a", tmp_path / "m"
    a.mkdir()
    suite_report.save(str(a), [{"device": "A"}], fake_rows(["x"], "fits"), [])
    assert serving_suite.main(["--merge", str(a), "--out", str(out)]) == 0
    before = {n: read(str(out), n) for n in ("suite.json", "suite.txt", "suite.svg")}
    capsys.readouterr()
    real = open
    suite_report.save(str(a), [{"device": "B"}], fake_rows(["x", "y"], "fits"), [])
    monkeypatch.setattr("builtins.open", full_disk_at("suite.svg.tmp"))
    assert serving_suite.main(["--merge", str(a), "--out", str(out)]) == 1
    monkeypatch.setattr("builtins.open", real)
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.strip() == f"serving_suite: --merge: writing {out / 'suite.svg'}: [Errno 28] No space left on device"
    assert {n: read(str(out), n) for n in before} == before
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
