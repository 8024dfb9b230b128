"""The multi-tenant bench (python/benches/multitenant_bench.py, issue #33 item 5): its arrivals
from the traces' timestamps, the engine runner's timed arrivals, its flag checks, and a real
``--tiny`` run (three tenant processes, host backend): the outputs' structure, the pool never
above its total, the kill check, no process or ledger left behind, a run that cannot finish
ending with exit 1 instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("torch", reason="torch is not installed (the serving part of scripts/test.sh runs these)")

from harness import tenant_plan, trace  # noqa: E402
from harness.engine import Pace  # noqa: E402

BENCHES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "benches"))
SCRIPT = os.path.join(BENCHES, "multitenant_bench.py")


def test_trace_timestamps_are_seconds_and_refused_when_malformed(tmp_path) -> None:
    rows = trace.load_trace(trace.default_trace(), n=3, timestamps=True)
    assert rows[0].timestamp == trace.parse_timestamp("2023-11-16 18:15:46.6805900")
    assert round(rows[1].timestamp - rows[0].timestamp, 6) == round(50.9951690 - 46.6805900, 6)
    assert trace.load_trace(trace.default_trace(), n=1)[0].timestamp is None  # not asked: not parsed
    bad = tmp_path / "t.csv"
    for text, match in (("TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,2\n", "row 2"),
                        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01,1,2\n"
                         "2023-11-16 18:00:00.5,1,2\n", "before the row above"),
                        ("ContextTokens,GeneratedTokens\n1,2\n", "missing columns")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            trace.load_trace(str(bad), n=2 if "before" in match else 1, timestamps=True)


def test_arrivals_replay_the_window_scaled_split_and_staggered() -> None:
    window = tenant_plan.Window(start_s=289, window_s=30, time_scale=2, max_prompt=512)
    bursty = tenant_plan.arrivals(tenant_plan.TENANTS, window, "bursty")
    staggered = tenant_plan.arrivals(tenant_plan.TENANTS, window, "staggered")
    for i, (b, s) in enumerate(zip(bursty, staggered)):
        assert b and all(0 <= a.at_s < 15 for a in b)  # 30 trace seconds at 2x
        assert [a.at_s for a in b] == sorted(a.at_s for a in b)
        assert max(a.prompt_len for a in b) <= 512
        assert [round(x.at_s - y.at_s, 9) for x, y in zip(s, b)] == [round(i * 15.0, 9)] * len(b)
        assert [(x.prompt_len, x.row) for x in s] == [(y.prompt_len, y.row) for y in b]
    # the two code tenants split the code trace's rows of the window: no request twice
    code = [{a.row for a in bursty[i]} for i, t in enumerate(tenant_plan.TENANTS) if t.trace == "code"]
    assert len(code) == 2 and not code[0] & code[1] and {r % 2 for r in code[0]} == {0}
    # the traces' shared clock: the code tenants' first request is the same row of the code file
    capped = tenant_plan.arrivals(tenant_plan.TENANTS, tenant_plan.Window(289, 30, 2, 512, max_requests=4), "bursty")
    assert [len(a) for a in capped] == [4, 4, 4] and capped[1] == bursty[1][:4]
    with pytest.raises(ValueError, match="no request"):
        tenant_plan.arrivals(tenant_plan.TENANTS, tenant_plan.Window(5000, 10, 1, 512), "bursty")
    with pytest.raises(ValueError, match="scenario"):
        tenant_plan.arrivals(tenant_plan.TENANTS, window, "both")
    for bad in ({"window_s": 0}, {"time_scale": float("nan")}, {"start_s": -1}, {"max_prompt": 0},
                {"stagger_s": -2.0}):
        with pytest.raises(ValueError):
            tenant_plan.Window(**{"start_s": 0, "window_s": 1, "time_scale": 1, "max_prompt": 1, **bad})


def test_pace_adds_a_request_when_its_arrival_time_passed() -> None:
    calls = []
    pace = Pace(None, [0.0, 0.5, 2.0], lambda: calls.append(1))
    assert [pace.due(i, 0, 0.4, timed=True) for i in range(3)] == [True, False, False]
    assert [pace.due(i, 0, 0.5, timed=True) for i in range(3)] == [True, True, False]
    assert all(pace.due(i, 0, 0.0, timed=False) for i in range(3))  # primers: at once
    assert pace.wait_s(2, 1.9, timed=True) == pytest.approx(0.1)
    assert pace.wait_s(None, 1.9, timed=True) == 1.0
    assert Pace([0, 3], None, None).due(1, 2, 99.0, timed=True) is False  # stagger counts results
    with pytest.raises(ValueError, match="exclude"):
        Pace([0], [0.0], None)


@pytest.mark.parametrize("flags", [
    ["--total", "0"], ["--total", "lots"], ["--total", "64K"], ["--window", "0"], ["--time-scale", "nan"],
    ["--window-start", "-1"], ["--stagger", "inf"], ["--kill-tenant", "3"], ["--scenarios", "calm"],
    ["--modes", "static,shared"], ["--max-context", "16"], ["--new-tokens", "0"], ["--requests", "0"],
    ["--interval", "0"], ["--kill", "--modes", "static"], ["--page-size", "3K"],
])
def test_bad_flags_are_one_usage_line_before_any_process(flags, tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="the bench imports transformers' configs")
    import multitenant_bench

    with pytest.raises(SystemExit) as e:
        multitenant_bench.main(["--tiny", "--out", str(tmp_path), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2, last
    assert ": error: " in last and flags[0] in last, last


def run_bench(tmp_path, *flags: str, timeout: float = 600,
              kill_after_s: float | None = None) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Runs the bench (``--tiny``) with ``TMPDIR`` in ``tmp_path``; returns the finished process
    and every descendant pid seen while it ran. ``kill_after_s``: SIGKILL one tenant process
    that long after all three were seen (from outside: the bench did not ask for it)."""
    psutil = pytest.importorskip("psutil")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--tiny", "--out", str(tmp_path / "out"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=BENCHES)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    me = psutil.Process(proc.pid)
    all_seen = None
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            children = me.children(recursive=True)
            seen |= {c.pid for c in children}
            tenants = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        except psutil.NoSuchProcess:
            break
        if kill_after_s is not None and len(tenants) >= 3:
            all_seen = all_seen or time.monotonic()
            if time.monotonic() - all_seen > kill_after_s:
                tenants[0].kill()
                kill_after_s = None
        time.sleep(0.2)
    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def assert_nothing_left(tmp_path, pids: set[int]) -> None:
    """No process the bench started runs 10 s after it exited (multiprocessing's resource
    tracker ends on its own once the bench's pipe closes, a moment later), and its temporary
    directory (the pool's ledger) is gone."""
    import psutil

    def alive() -> list[str]:
        out = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid}: {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), f"processes left running: {alive()}"
    left = [n for n in os.listdir(tmp_path / "tmp") if n.startswith("vmem-multitenant-")]
    assert not left, f"the bench's temporary directory (the pool's ledger) was left behind: {left}"


def test_tiny_run_serves_three_tenant_processes_in_both_modes_and_the_kill_check(tmp_path) -> None:
    pytest.importorskip("transformers")
    from vmem import pool  # noqa: F401  (the bench's pool mode)

    done, pids = run_bench(tmp_path, "--kill")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(pids) >= 3  # three tenants (plus multiprocessing's resource tracker)
    assert_nothing_left(tmp_path, pids)
    out = tmp_path / "out"
    res = json.loads((out / "multitenant.json").read_text())
    names = [t["name"] for t in res["tenants"]]
    assert len(names) == 3
    keys = [(r["scenario"], r["mode"], r["tenant"]) for r in res["rows"]]
    assert keys == [(s, m, t) for s in ("bursty", "staggered") for m in ("static", "pool") for t in [*names, "all"]]
    total = res["pool_total"]
    for row in res["rows"]:
        assert row["completed"] == row["requests"] > 0, row
        assert row["tok_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0, row
    for run in res["runs"]:
        assert run["samples"], run["key"]
        if run["mode"] == "pool":
            # the pool's own sum and the tenants' usage never above the total, and really used
            assert 0 < run["pool_max_used"] <= total, run["key"]
            assert 0 < run["held_sum_max"] <= total, run["key"]
        else:
            # static: each tenant holds its third, made up front
            assert all(t["idle_held_bytes"] >= 0 for t in run["tenants"])
            assert run["held_sum_max"] <= total
    assert [(r["scenario"], r["tenant"]) for r in res["ratios"]] == \
        [(s, t) for s in ("bursty", "staggered") for t in [*names, "all"]]
    kill = res["kill"]
    assert kill["victim"] == names[2] and kill["held_bytes"] > 0
    assert kill["ledger_back_s"] is not None and kill["ledger_back_s"] < 1.0, kill
    assert kill["others_completed"] == kill["others_requests"] > 0 and kill["others_errors"] == []
    text = (out / "multitenant.txt").read_text()
    assert "ttft_p99 static/pool" in text and "kill check: SIGKILL" in text
    assert text.strip().splitlines()[-1] in done.stdout
    root = ET.fromstring((out / "multitenant.svg").read_text())
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) >= 5 * (3 + 1)  # 5 runs: 3 tenants + the pool's total each


def test_a_run_that_cannot_finish_exits_1_and_leaves_nothing(tmp_path) -> None:
    """Tenants cannot build their models within --timeout 0.5 s: the bench says which run
    failed and exits 1 instead of waiting, with every tenant ended and the ledger removed."""
    pytest.importorskip("transformers")
    done, pids = run_bench(tmp_path, "--timeout", "0.5", timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error: run bursty-static: tenants not ready after" in done.stderr
    assert_nothing_left(tmp_path, pids)


def fake_run(key: str, scenario: str, mode: str, ttft_s: list[list[float]], tok_s: list[float],
             held: list[float]) -> dict:
    tenants = [{"index": i, "tenant": f"t{i}", "scenario": scenario, "mode": mode, "requests": len(t),
                "completed": len(t), "ttft_s": t, "ttft_p50_ms": 1e3 * sorted(t)[len(t) // 2],
                "ttft_p99_ms": 1e3 * max(t), "tok_s": s, "preemptions": 0, "peak_mapped_bytes": 2**20,
                "idle_held_bytes": 2 * 65536, "page_bytes": 65536} for i, (t, s) in enumerate(zip(ttft_s, tok_s))]
    return {"key": key, "scenario": scenario, "mode": mode, "tenants": tenants,
            "samples": [{"t": 0.0, "held": held, "pool_used": int(sum(held))}, {"t": 0.1, "held": [0.0] * 2}]}


def test_report_ratios_merge_and_outputs(tmp_path) -> None:
    from harness import tenant_report as rep

    meta = {"tenants": [{"name": "t0"}, {"name": "t1"}], "pool_total": 2**30, "device": "cpu", "header": "h"}
    static = fake_run("bursty-static", "bursty", "static", [[0.4, 0.8], [0.2]], [100.0, 50.0], [5.0, 7.0])
    pool = fake_run("bursty-pool", "bursty", "pool", [[0.1, 0.2], [0.2]], [110.0, 50.0], [9.0, 3.0])
    kill = dict(fake_run("kill", "bursty", "pool", [[0.1]], [10.0], [1.0, 0.0]),
                kill={"victim": "t1", "at_s": 1.0, "held_bytes": 2**20, "ledger_back_s": 0.01, "gpu_back_s": None,
                      "target_s": 1.0, "gpu": False})
    doc = rep.summarize(rep.merge([{**meta, "runs": [static]}, {**meta, "runs": [pool, kill]}]))
    assert [(r["mode"], r["tenant"]) for r in doc["rows"]] == [(m, t) for m in ("static", "pool")
                                                               for t in ("t0", "t1", "all")]
    by = {(r["tenant"]): r for r in doc["ratios"]}
    assert by["t0"]["ttft_p99 static/pool"] == "4.00x" and by["t0"]["tok_s pool/static"] == "1.10x"
    assert by["all"]["ttft_p99_static_ms"] == pytest.approx(800.0) and by["all"]["tok_s_pool"] == 160.0
    assert doc["runs"][1]["pool_max_used"] == 12 and doc["runs"][0]["held_sum_max"] == 12.0
    assert doc["kill"]["others_completed"] == 1 and doc["kill"]["others_errors"] == []
    assert [r["peak_held_mib"] for r in doc["rows"] if r["tenant"] != "all"] == [5 / 2**20, 7 / 2**20,
                                                                                  9 / 2**20, 3 / 2**20]
    text = rep.write_outputs(str(tmp_path), doc)
    assert "4.00x" in text and "ledger back in 10.0 ms" in text and "n/a (no GPU)" in text
    assert json.loads((tmp_path / "multitenant.json").read_text())["ratios"] == doc["ratios"]
    assert ET.fromstring((tmp_path / "multitenant.svg").read_text()).tag.endswith("svg")
    with pytest.raises(ValueError, match="two parts"):
        rep.merge([{**meta, "runs": [static]}, {**meta, "runs": [static]}])
    with pytest.raises(ValueError, match="differ"):
        rep.merge([{**meta, "runs": [static]}, {**meta, "pool_total": 1, "runs": [pool]}])


def test_merge_flag_joins_parts_and_refuses_bad_files(tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="the bench imports transformers' configs")
    import multitenant_bench

    meta = {"tenants": [{"name": "t0"}, {"name": "t1"}], "pool_total": 2**30, "device": "cpu", "header": "h"}
    parts = []
    for k, run in enumerate((fake_run("bursty-static", "bursty", "static", [[0.4], [0.2]], [1.0, 2.0], [1.0, 1.0]),
                             fake_run("bursty-pool", "bursty", "pool", [[0.1], [0.2]], [1.0, 2.0], [1.0, 1.0]))):
        p = tmp_path / f"part{k}.json"
        p.write_text(json.dumps({**meta, "runs": [run]}))
        parts.append(str(p))
    assert multitenant_bench.main(["--merge", *parts, "--out", str(tmp_path / "merged")]) == 0
    assert "4.00x" in (tmp_path / "merged" / "multitenant.txt").read_text()
    assert multitenant_bench.main(["--merge", parts[0], parts[0], "--out", str(tmp_path / "m2")]) == 1
    assert "two parts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a missing input file: a usage error, before anything is written
        multitenant_bench.main(["--merge", str(tmp_path / "absent.json"), "--out", str(tmp_path / "m3")])
    assert e.value.code == 2 and "--merge '" in capsys.readouterr().err and not (tmp_path / "m3").exists()


def test_a_tenant_killed_from_outside_ends_the_bench_with_exit_1(tmp_path) -> None:
    """A tenant that dies without the bench asking (here SIGKILL from outside, during its start
    or a run) is reported by name and the bench exits 1, the other tenants ended."""
    pytest.importorskip("transformers")
    done, pids = run_bench(tmp_path, timeout=300, kill_after_s=3.0)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: tenant ") and " exited with -9 in run " in last, last
    assert_nothing_left(tmp_path, pids)


def test_tenants_end_when_the_bench_is_killed(tmp_path) -> None:
    """SIGKILL of the bench itself (no clean-up runs): its tenant processes notice their parent
    is gone and exit within seconds instead of serving on as orphans."""
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("transformers")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--tiny", "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=BENCHES)
    me = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    tenants: list = []
    while len(tenants) < 3 and time.monotonic() < deadline:
        tenants = [c for c in me.children() if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.2)
    assert len(tenants) == 3, "the tenants did not start"
    time.sleep(2.0)
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(tenants, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"tenants outlived the bench: {[p.pid for p in alive]}"


def test_report_of_a_failed_tenant_run_keeps_the_rest(tmp_path) -> None:
    """--keep-going: a tenant's failed run is a row with its reason and no numbers, the run's
    'all' row and its ratios are n/a, the other runs' ratios stand."""
    from harness import tenant_report as rep

    meta = {"tenants": [{"name": "t0"}, {"name": "t1"}], "pool_total": 2**30, "device": "cpu", "header": "h"}
    static = fake_run("bursty-static", "bursty", "static", [[0.4], [0.2]], [100.0, 50.0], [5.0, 7.0])
    pool = fake_run("bursty-pool", "bursty", "pool", [[0.1], [0.2]], [110.0, 50.0], [9.0, 3.0])
    pool["tenants"][1] = {"tenant": "t1", "index": 1, "scenario": "bursty", "mode": "pool", "key": "bursty-pool",
                          "requests": 1, "failed": "RuntimeError: no room"}
    doc = rep.summarize({**meta, "runs": [static, pool]})
    by = {r["tenant"]: r for r in doc["ratios"]}
    assert by["t0"]["ttft_p99 static/pool"] == "4.00x"
    assert by["t1"]["ttft_p99 static/pool"] == "n/a" and by["all"]["tok_s pool/static"] == "n/a"
    text = rep.write_outputs(str(tmp_path), doc)
    assert "FAILED: t1 in bursty/pool: RuntimeError: no room" in text


def test_a_pool_tenant_starved_by_its_neighbours_waits_instead_of_failing(tmp_path) -> None:
    """Three tenants' bursts in a pool of 1 MiB: a tenant with no request running whose next
    request finds the room held by the others used to stop its engine ("No requests can be
    scheduled and no requests can be offloaded", exit 1); it now waits for their room and every
    request of every tenant completes, the pool never above its total."""
    pytest.importorskip("transformers")
    from vmem import pool  # noqa: F401  (the bench's pool mode)

    done, pids = run_bench(tmp_path, "--requests", "16", "--total", "1M", "--max-prompt", "200",
                           "--max-context", "256", "--new-tokens", "8", "--scenarios", "bursty")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_nothing_left(tmp_path, pids)
    res = json.loads((tmp_path / "out" / "multitenant.json").read_text())
    for row in res["rows"]:
        assert row["completed"] == row["requests"] == (48 if row["tenant"] == "all" else 16), row
    for run in res["runs"]:
        if run["mode"] == "pool":
            assert 0 < run["pool_max_used"] <= res["pool_total"], run["key"]


def test_tiny_run_with_a_floor_and_a_keep_serves_their_modes_beside_static_and_pool(tmp_path) -> None:
    """``--floor 1/6 --keep 256K``: ``pool-floor``, in which every tenant joined with a floor of
    a sixth of the pool (the ledger held it), and ``pool-keep``, in which every tenant kept up
    to 4 made pages when its requests finished (more than its trash row's page held right after
    them), each with its ratios against static; every pooled tenant was down to its trash row's
    page after its idle release (``pool_idle_s``), and its ``released_after_s`` says when."""
    pytest.importorskip("transformers")
    from vmem import pool  # noqa: F401  (the bench's pool modes)

    done, pids = run_bench(tmp_path, "--floor", "1/6", "--keep", "256K", "--scenarios", "bursty")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_nothing_left(tmp_path, pids)
    res = json.loads((tmp_path / "out" / "multitenant.json").read_text())
    names = [t["name"] for t in res["tenants"]]
    keys = [(r["mode"], r["tenant"]) for r in res["rows"]]
    modes = ("static", "pool", "pool-floor", "pool-keep")
    assert keys == [(m, t) for m in modes for t in [*names, "all"]]
    for run in res["runs"]:
        for t in run["tenants"]:
            # every tenant's rounds clocked; only pooled ones compare their room with a static third
            assert t["rounds"] > 0 and t["round_ms_p50"] > 0 and t["round_ms_p90"] >= t["round_ms_p50"], t
            assert 0 <= t["rounds_short_of_third"] <= t["rounds"]
            if run["mode"] == "static":
                assert "released_held_bytes" not in t and t["rounds_short_of_third"] == 0
                continue
            assert t["released_held_bytes"] == t["page_bytes"], (run["mode"], t)  # token-major: one trash page
            assert 0 <= t["released_after_s"] < 4.5
            if run["mode"] == "pool-keep":
                assert t["idle_held_bytes"] > t["page_bytes"], t
    total = res["pool_total"]
    for run in res["runs"]:
        floors = {t["floor_bytes"] for t in run["tenants"]}
        assert floors == ({total // 6} if run["mode"] == "pool-floor" else {0}), (run["mode"], floors)
        if run["mode"] != "static":
            assert 0 < run["pool_max_used"] <= total, run["key"]
    assert [(r["mode"], r["tenant"]) for r in res["ratios"]] == \
        [(m, t) for m in modes[1:] for t in [*names, "all"]]
    text = (tmp_path / "out" / "multitenant.txt").read_text()
    assert "pool-floor" in text and "pool-keep" in text and "pages_after_idle_s" in text
    assert "round_ms_p50" in text and "rounds_short_of_third" in text


@pytest.mark.parametrize("flags", [["--floor", "0"], ["--floor", "1/2"], ["--floor", "abc"], ["--floor", "-1G"],
                                   ["--floor", "nan%"], ["--modes", "static,pool-floor"],
                                   ["--floor", "1/6", "--modes", "static,pool"], ["--keep", "lots"],
                                   ["--keep", "-1M"], ["--modes", "static,pool-keep"],
                                   ["--keep", "1M", "--modes", "static,pool"]])
def test_a_bad_floor_or_keep_is_one_usage_line_before_any_process(flags, tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="the bench imports transformers' configs")
    import multitenant_bench

    with pytest.raises(SystemExit) as e:
        multitenant_bench.main(["--tiny", "--out", str(tmp_path), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("--keep" if "keep" in " ".join(flags) else "--floor") in err, err
