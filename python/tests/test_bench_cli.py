"""Every bench script's flags (python/benches/*.py): zero, negative, huge, the wrong type, NaN and
infinity, a missing input file, an ``--out`` that cannot be written, no GPU for a GPU-only script:
each is a usage error, exit 2, one line ``SCRIPT: error: ...`` naming the flag, before any model is
built or any measurement starts (python/benches/README.md promises it; harness/cli.py checks).
Before, ``zero_page_cost.py --rounds 0``, ``plot_throughput.py no.json o.svg``, ``pool_sleep.py
--requests 0`` (and ``--out`` in a missing directory, found only after the whole run) and
``tp_lockstep.py --every 0`` ended in tracebacks, and most scripts took no ``argv`` at all. Also:
every script is in the README, once."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

BENCHES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "benches"))
SCRIPTS = sorted(f[:-3] for f in os.listdir(BENCHES) if f.endswith(".py"))
BAD_OUT = "/proc/version/x"  # under a file: no directory can be made there, root or not

torch = pytest.importorskip("torch", reason="the scripts import torch")
pytest.importorskip("transformers", reason="the serving scripts import transformers")
GPU = torch.cuda.is_available()


def _json(tmp_path, text: str) -> str:
    p = tmp_path / "r.json"
    p.write_text(text)
    return str(p)


#: (script, argv, what the error line says); ``{tmp}`` is the test's own directory, ``{json}`` a
#: JSON file without throughput rows. Cases marked ``cpu`` expect the refusal a CPU host gives.
CASES = [
    ("alloc_bench", ["--nope"], "unrecognized arguments: --nope"),
    ("alloc_bench", [], "needs the 'vmem_bench' module"),
    ("compiled_bench", ["--out"], "argument --out: expected one argument"),
    ("compiled_bench", [], "no GPU: compiled_bench.py runs on CUDA only", "cpu"),
    ("gpu_bench", ["--benches", "nope"], "--benches: unknown 'nope'"),
    ("gpu_bench", [], "no GPU: gpu_bench.py runs on CUDA only", "cpu"),
    ("graphs_check", ["--repeats", "0"], "--repeats must be at least 1"),
    ("graphs_check", ["--bench-requests", "99999"], "--bench-requests must be at most 2000"),
    ("graphs_check", ["--kernels", "flashinfer"], "--kernels: fa or fa,flashinfer"),
    ("graphs_check", ["--kernels", "fa,nope"], "--kernels: unknown 'nope'"),
    ("graphs_check", [], "no GPU: graphs_check.py runs on CUDA only", "cpu"),
    ("kernel_study", ["--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("kernel_study", ["--tol", "inf"], "--tol must be a finite number above 0"),
    ("kernel_study", ["--contexts", "1024", "--prefill-q", "1024"], "--prefill-q 1024 must be below"),
    ("kernel_study", ["--batches", "1,99999999"], "--batches: at most"),
    ("mixed_round", ["--reps", "0"], "--reps must be at least 1, got 0"),
    ("mixed_round", ["--inner", "99999"], "--inner must be at most 1000, got 99999"),
    ("mixed_round", ["--reps", "x"], "argument --reps: invalid int value"),
    ("mixed_round", [], "no GPU: use --tiny for a CPU smoke test", "cpu"),
    ("prefill_round", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("prefill_round", ["--layers", "999"], "--layers must be at most 128, got 999"),
    ("prefill_round", ["--rounds", "fits,nope"], "--rounds: unknown 'nope'"),
    ("prefill_round", ["--inner", "1.5"], "argument --inner: invalid int value"),
    ("prefill_round", [], "no GPU: use --tiny for a CPU smoke test", "cpu"),
    ("multitenant_bench", ["--merge", "{tmp}/no.json"], "--merge '"),
    ("multitenant_bench", ["--tiny", "--total", "64G"], "--tiny's KV lives in host memory"),
    ("multitenant_bench", ["--tiny", "--max-rows", "100000"], "--max-rows must be at most 4096"),
    ("multitenant_bench", ["--tiny", "--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("plot_throughput", ["{tmp}/no.json", "{tmp}/o.svg"], "PYTHON_GPU_JSON '"),
    ("plot_throughput", ["{json}", "{tmp}/no/o.svg"], "OUT_SVG '"),
    ("plot_throughput", ["{json}", "{tmp}"], "is a directory, not a file"),
    ("plot_throughput", ["{json}", "{tmp}/o.svg"], "holds no throughput results"),
    ("plot_throughput", [], "the following arguments are required"),
    ("pool_sleep", ["--requests", "0"], "--requests must be at least 1"),
    ("pool_sleep", ["--device", "cpu", "--out", "{tmp}/no/x.json"], "--out '"),
    ("pool_sleep", ["--device", "cpu", "--tokens", "x"], "argument --tokens: invalid int value"),
    ("pool_sleep", ["--device", "cpu", "--layers", "64", "--requests", "64", "--tokens", "65536"],
     "more than the pool's 16.0 GiB"),
    ("pool_sleep", ["--device", "cuda"], "no GPU: pool_sleep.py --device cuda", "cpu"),
    ("prefill_cost", [], "no GPU: prefill_cost.py runs on CUDA only", "cpu"),
    ("prefix_serving", ["--tiny", "--kv-gib", "nan", "--out", "{tmp}/o"], "--kv-gib must be a finite number"),
    ("prefix_serving", ["--tiny", "--tol", "-1", "--out", "{tmp}/o"], "--tol must be a finite number"),
    ("prefix_serving", ["--tiny", "--layers", "100000", "--out", "{tmp}/o"], "--layers must be at most 128"),
    ("prefix_serving", ["--tiny", "--trace", "{tmp}/no.csv", "--out", "{tmp}/o"], "--trace '"),
    ("make_model_dir", ["--shape", "llama3-8b", "--layers", "0", "--out", "{tmp}/o"], "layers must be in [1, 512], got 0"),
    ("make_model_dir", ["--shape", "tiny", "--seed", "-1", "--out", "{tmp}/o"], "--seed must be at least 0"),
    ("make_model_dir", ["--shape", "llama3-8b", "--layers", "100000", "--out", "{tmp}/o"], "layers must be in [1, 512]"),
    ("make_model_dir", ["--shape", "tiny", "--max-context", "1e9", "--out", "{tmp}/o"],
     "argument --max-context: invalid int value"),
    ("make_model_dir", ["--shape", "tiny", "--out", "{json}"], "is not a finished model directory"),
    ("make_model_dir", ["--shape", "tiny", "--out", BAD_OUT], "--out '/proc/version' cannot be created"),
    ("make_model_dir", ["--shape", "tiny", "--device", "cuda:x", "--out", "{tmp}/o"], "--device 'cuda:x'"),
    ("make_model_dir", ["--shape", "tiny", "--device", "cuda", "--out", "{tmp}/o"], "no CUDA GPU here", "cpu"),
    ("serve_bench", ["--num-prompts", "0", "--out", "{tmp}/o"], "--num-prompts must be at least 1"),
    ("serve_bench", ["--max-output", "-5", "--out", "{tmp}/o"], "--max-output must be at least 1"),
    ("serve_bench", ["--num-prompts", "100001", "--out", "{tmp}/o"], "--num-prompts must be at most 100000"),
    ("serve_bench", ["--max-time", "1e9", "--out", "{tmp}/o"], "--max-time must be at most"),
    ("serve_bench", ["--max-time", "x", "--out", "{tmp}/o"], "argument --max-time: invalid float value"),
    ("serve_bench", ["--trace", "{tmp}/no.csv", "--out", "{tmp}/o"], "--trace '"),
    ("serve_bench", ["--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("serve_compare", ["--tiny", "--num-prompts", "0", "--out", "{tmp}/o"], "--num-prompts must be at least 1"),
    ("serve_compare", ["--tiny", "--min-prompts", "-1", "--out", "{tmp}/o"], "--min-prompts must be at least 1"),
    ("serve_compare", ["--tiny", "--kv-memory", "64G", "--out", "{tmp}/o"], "--kv-memory 64G: --tiny's KV lives in"),
    ("serve_compare", ["--tiny", "--overhead-requests", "10000000", "--out", "{tmp}/o"],
     "--overhead-requests must be at most 100000"),
    ("serve_compare", ["--tiny", "--capacity", "x", "--out", "{tmp}/o"], "argument --capacity: invalid float value"),
    ("serve_compare", ["--merge", "{tmp}/no", "--out", "{tmp}/o"], "--merge '"),
    ("serve_compare", ["--tiny", "--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("serve_compare", ["--out", "{tmp}/o"], "no GPU: use --tiny", "cpu"),
    ("serve_multitenant", ["--tiny", "--requests", "0", "--out", "{tmp}/o"], "--requests must be at least 1"),
    ("serve_multitenant", ["--tiny", "--window", "-1", "--out", "{tmp}/o"], "--window must be more than 0"),
    ("serve_multitenant", ["--tiny", "--total", "64G", "--out", "{tmp}/o"], "--total 64G: --tiny's KV lives in"),
    ("serve_multitenant", ["--tiny", "--window", "x", "--out", "{tmp}/o"], "argument --window: invalid float value"),
    ("serve_multitenant", ["--merge", "{tmp}/no", "--out", "{tmp}/o"], "--merge '"),
    ("serve_multitenant", ["--tiny", "--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("serve_steady", ["--tiny", "--rate", "0", "--out", "{tmp}/o"], "--rate must be a finite number above 0"),
    ("serve_steady", ["--tiny", "--duration", "-1", "--out", "{tmp}/o"], "--duration must be more than 0"),
    ("serve_steady", ["--tiny", "--rate", "1e9", "--out", "{tmp}/o"], "--rate 1e+09 for --duration 600 is more than"),
    ("serve_steady", ["--tiny", "--rate", "x", "--out", "{tmp}/o"], "argument --rate: invalid float value"),
    ("serve_steady", ["--tiny", "--trace", "{tmp}/no.csv", "--out", "{tmp}/o"], "--trace '"),
    ("serve_steady", ["--tiny", "--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("serve_steady", ["--wait", "--out", "{tmp}/o"], "holds no background run"),
    ("serving_check", ["--tiny", "--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
    ("serving_check", ["--tiny", "--tol", "inf", "--out", "{tmp}/o"], "--tol must be a finite number"),
    ("serving_check", ["--tiny", "--requests", "5000", "--out", "{tmp}/o"], "--requests must be at most 1000"),
    ("serving_suite", ["--tiny", "--rounds", "5000", "--out", "{tmp}/o"], "--rounds must be at most 1000"),
    ("serving_suite", ["--tiny", "--max-prompt", "100", "--new-tokens", "4000", "--out", "{tmp}/o"],
     "pass --max-context 2048"),
    ("serving_suite", ["--tiny", "--timeout", "inf", "--out", "{tmp}/o"], "--timeout must be at most"),
    ("serving_suite", ["--tiny", "--profile-top", "0", "--out", "{tmp}/o"], "--profile-top must be at least 1"),
    ("serving_suite", ["--tiny", "--profile-top", "ten", "--out", "{tmp}/o"], "--profile-top: invalid int value"),
    ("serving_suite", ["--tiny", "--only", "model=llama3-8b-x32", "--out", "{tmp}/o"], "--only model: unknown"),
    ("suite_plot", ["{tmp}/no.log", "--out", "{tmp}/o.svg"], "LOG '"),
    ("suite_plot", ["{json}", "--out", "{tmp}/no/o.svg"], "--out '"),
    ("suite_plot", ["{json}", "--out", "{tmp}"], "is a directory, not a file"),
    ("suite_plot", ["{json}", "--out", "{tmp}/o.svg"], "no suite table"),
    ("suite_plot", ["--out", "{tmp}/o.svg"], "the following arguments are required: LOG"),
    ("suite_plot", ["{json}", "--out", ""], "--out must name a file, not ''"),
    ("tp_lockstep", ["--every", "0"], "--every must be at least 1"),
    ("tp_lockstep", ["--world", "1000"], "--world must be at most 64"),
    ("decode_kernels", ["--shapes", "3b"], "--shapes: unknown '3b'"),
    ("decode_kernels", ["--reps", "0"], "--reps must be at least 1"),
    ("decode_kernels", ["--layers", "100"], "--layers must be at most 16"),
    ("decode_kernels", ["--configs", "64:4"], "--configs: '64:4' is not block_n:num_warps:num_stages"),
    ("decode_kernels", ["--configs", "48:4:2"], "needs block_n a power of two"),
    ("decode_kernels", [], "no GPU: decode_kernels.py runs on CUDA only", "cpu"),
    ("decode_gemms", ["--rows", "0"], "--rows: values must be at least 1"),
    ("decode_gemms", ["--rows", "x"], "--rows: not a comma-separated list"),
    ("decode_gemms", ["--reps", "0"], "--reps must be at least 1"),
    ("decode_gemms", ["--rows", "16,100000"], "--rows must be at most 65536, got 100000"),
    ("decode_gemms", ["--out", "/proc/version/x"], "--out '/proc/version/x' cannot be created"),
    ("decode_gemms", [], "no GPU: decode_gemms.py runs on CUDA only", "cpu"),
    ("tp_lockstep", ["--steps", "10", "--diverge-at", "11"], "--diverge-at must be at most 10"),
    ("tp_lockstep", ["--cap", "x"], "--cap 'x'"),
    ("tp_lockstep", ["--device", "cuda"], "no GPU: tp_lockstep.py --device cuda", "cpu"),
    ("versions_check", ["--nope"], "unrecognized arguments: --nope"),
    ("versions_check", [], "no GPU: versions_check.py runs on CUDA only", "cpu"),
    ("zero_page_cost", ["--rounds", "0"], "--rounds must be at least 2"),
    ("zero_page_cost", ["--rounds", "1"], "--rounds must be at least 2"),
    ("zero_page_cost", ["--rounds", "1e9"], "argument --rounds: invalid int value"),
    ("zero_page_cost", ["--rounds", "100000"], "--rounds must be at most 1000"),
    ("zero_page_cost", ["--out", BAD_OUT], "--out '/proc/version/x' cannot be created"),
]


def _argv(argv: list[str], tmp_path) -> list[str]:
    json_file = _json(tmp_path, '{"results": {}}')
    return [a.replace("{tmp}", str(tmp_path)).replace("{json}", json_file) for a in argv]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}:{' '.join(c[1]) or '-'}" for c in CASES])
def test_a_bad_flag_is_one_usage_line_before_any_work(case, tmp_path, capsys, monkeypatch) -> None:
    script, argv, want = case[:3]
    if len(case) > 3 and GPU:
        pytest.skip("a GPU is here: the no-GPU refusal does not apply")
    monkeypatch.delenv("VMEM_BENCH_OUT", raising=False)
    monkeypatch.delenv("BENCHES", raising=False)
    mod = __import__(script)
    args = _argv(argv, tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        mod.main(args)
    err = capsys.readouterr()
    last = err.err.strip().splitlines()[-1]
    assert e.value.code == 2, err.err[-2000:]
    assert ": error: " in last, last
    assert want in last, last
    assert "Traceback" not in err.err and err.out == "", (err.out[-500:], err.err[-500:])
    # Nothing made, not even the --out directory a check made before a later flag was refused.
    assert sorted(os.listdir(tmp_path)) == before


def test_every_script_has_a_case_and_a_readme_line() -> None:
    """Each script is tried above, and named once in the benches README's table of scripts."""
    assert {c[0] for c in CASES} == set(SCRIPTS), set(SCRIPTS) ^ {c[0] for c in CASES}
    with open(os.path.join(BENCHES, "README.md")) as f:
        readme = f.read()
    scripts = readme[readme.index("## Scripts"):readme.index("## harness/")]
    rows = re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", scripts, flags=re.M)
    shell = sorted(f for f in os.listdir(BENCHES) if f.endswith(".sh"))
    assert sorted(rows) == sorted([s + ".py" for s in SCRIPTS] + shell), sorted(set(rows) ^ set(
        [s + ".py" for s in SCRIPTS] + shell))


@pytest.mark.parametrize("argv", [
    ["zero_page_cost.py", "--rounds", "0"],
    ["plot_throughput.py", "no.json", "o.svg"],
    ["pool_sleep.py", "--requests", "0"],
    ["pool_sleep.py", "--device", "cpu", "--out", "no/such/dir/x.json"],
    ["tp_lockstep.py", "--every", "0"],
])
def test_the_reported_scripts_exit_2_with_one_line_as_a_user_runs_them(argv, tmp_path) -> None:
    """issue #48 item 9, as a user runs them: ``python3 python/benches/X.py ...`` from another
    directory, exit 2, the usage and one error line on stderr, nothing on stdout, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "VMEM_BENCH_OUT"}
    r = subprocess.run([sys.executable, os.path.join(BENCHES, argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert lines[0].startswith(f"usage: {argv[0]}") and lines[-1].startswith(f"{argv[0]}: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "" and not os.listdir(tmp_path), r.stderr


@pytest.mark.parametrize("argv, first", [(["mixed_round.py", "--tiny"], "round"),
                                         (["prefill_round.py", "--tiny"], "round"),
                                         (["zero_page_cost.py", "--rounds", "2"], "per-layer")])
def test_a_closed_output_pipe_ends_the_run_with_1_and_no_traceback(tmp_path, argv, first) -> None:
    """``SCRIPT ... | head -1``: the reader closes the pipe after the first line (each line
    written as printed, so the next one meets the closed pipe)."""
    if argv[0] in ("mixed_round.py", "prefill_round.py"):
        pytest.importorskip("torch", reason="torch is not installed")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(BENCHES, argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith(first)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 1 and "Traceback" not in err, err[-2000:]


def test_every_script_ends_through_cli_exit_with() -> None:
    """Every bench script's last statement is ``cli.exit_with(main)``, so that a closed output
    pipe (``| head``) ends it with exit 1 and no traceback, as the test above shows for two."""
    for name in SCRIPTS:
        with open(os.path.join(BENCHES, name + ".py")) as f:
            tail = f.read().rstrip().splitlines()[-1].strip()
        assert tail == "cli.exit_with(main)", f"{name}.py ends with {tail!r}"


def test_the_default_output_folder_is_vmem_bench_out_else_tmp(monkeypatch) -> None:
    from harness import cli

    monkeypatch.setenv("OUT", "/somewhere/else")  # a name too generic to be the benches' own
    monkeypatch.delenv("VMEM_BENCH_OUT", raising=False)
    assert cli.default_out() == "/tmp"
    monkeypatch.setenv("VMEM_BENCH_OUT", "/data/runs")
    assert cli.default_out() == "/data/runs"


def test_suite_plot_draws_the_logs_tables(tmp_path) -> None:
    """suite_plot.py over the committed full-depth logs: every row of each log's table is a bar,
    its model tagged with the log's transformers version, its tok/s and roofline as printed."""
    logs = [os.path.join(BENCHES, "..", "..", "docs", "results", "serving-suite-h200", f"conv-8b32-v{v}", "log.txt")
            for v in ("517", "525")]
    out = tmp_path / "p.svg"
    run = subprocess.run([sys.executable, os.path.join(BENCHES, "suite_plot.py"), *logs, "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("12 rows from 2 logs")
    svg = out.read_text()
    assert svg.count("<rect") - svg.count('width="12" height="12"') == 2 * 12  # two panels, a bar a row
    assert "fi-paged-graphs-async-512-compile conv/llama3-8b (5.17.0)/fits: 3211 tok/s, roofline 0.577" in svg
    assert "vmem-token-major-graphs-async-compile conv/llama3-8b (5.25.0)/tenth: 1217 tok/s, roofline 0.496" in svg


def test_suite_plot_refuses_a_table_cell_that_is_no_number(tmp_path) -> None:
    log = os.path.join(BENCHES, "..", "..", "docs", "results", "serving-suite-h200", "conv-8b32-v517", "log.txt")
    with open(log) as f:
        text = f.read()
    assert "| 3211.3 |" in text
    bad = tmp_path / "bad.log"
    bad.write_text(text.replace("| 3211.3 |", "| 3211.3x |"))
    run = subprocess.run([sys.executable, os.path.join(BENCHES, "suite_plot.py"), str(bad), "--out",
                          str(tmp_path / "p.svg")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "tok_s '3211.3x' is not a number" in run.stderr and not run.stdout, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "p.svg").exists()
