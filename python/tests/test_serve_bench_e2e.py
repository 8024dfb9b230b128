"""The serving benches end to end on the CPU: make_model_dir.py's model directory (random
weights, a tokenizer made here: exact prompt lengths, a chat template), the load generator
against a real ``transformers serve --continuous-batching`` on it, and the drivers
(serve_compare.py, serve_multitenant.py, serve_steady.py) with the fake server of serve_fake.py
started in vmem-serve's place (its command line), each with its outputs read back."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (the serving part of scripts/test.sh runs these)")
pytest.importorskip("transformers", reason="transformers is not installed")
for _mod in ("fastapi", "uvicorn", "httpx", "openai", "accelerate"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (transformers serve and the load generator need it)")

from harness import model_dir, serve_drivers, server_proc  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(TESTS, "serve_fake.py")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("models") / "tiny")
    model_dir.build(model_dir.ModelSpec("llama3-8b", tiny=True, dtype="fp32"), path, "cpu")
    return path


def test_a_model_directory_loads_and_its_text_is_exact(tiny_dir, tmp_path, capsys) -> None:
    import make_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    marker = model_dir.read_marker(tiny_dir)
    assert model.config.vocab_size == len(tok) == marker["vocab_size"] == 256
    assert marker["kv_token_bytes"] == serve_drivers.model_dir.kv_token_bytes(model.config, 4)
    ids = [7, 255, 100, 7]
    assert tok(model_dir.prompt_text(ids)).input_ids == ids  # no BOS: n words, n tokens
    assert tok.eos_token_id == model.generation_config.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "t9 t10"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|> t9 t10 <|assistant|>"
    assert tok.decode([9, 2, 10], skip_special_tokens=True) == "t9 t10"
    # the same spec again: reused; another spec on that path, or a stray directory: refused
    assert model_dir.build(model_dir.ModelSpec("llama3-8b", tiny=True, dtype="fp32"), tiny_dir, "cpu")["reused"]
    for argv in (["--shape", "llama3-8b", "--tiny", "--dtype", "bf16", "--out", tiny_dir],
                 ["--shape", "tiny", "--layers", "3", "--out", str(tmp_path / "x")],
                 ["--shape", "llama3-70b", "--out", str(tmp_path / "y")]):
        with pytest.raises(SystemExit) as e:
            make_model_dir.main(argv)
        assert e.value.code == 2 and ": error: " in capsys.readouterr().err.splitlines()[-1]
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "f").write_text("x")
    with pytest.raises(ValueError, match="not a finished model directory"):
        model_dir.build(model_dir.ModelSpec("tiny"), str(tmp_path / "stray"), "cpu")


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch) -> None:
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_dir, "_write", boom)
    with pytest.raises(OSError, match="No space"):
        model_dir.build(model_dir.ModelSpec("tiny"), str(tmp_path / "m"), "cpu")
    assert os.listdir(tmp_path) == []


TF_SERVE = tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) >= \
    serve_drivers.TF_SERVE_MIN


@pytest.fixture(scope="module")
def tf_server(tiny_dir, tmp_path_factory):
    """``transformers serve --continuous-batching`` on the tiny model, its cache 64 blocks of 16
    (``None`` on a transformers the drivers do not run it on)."""
    if not TF_SERVE:
        yield None
        return
    port = server_proc.free_port()
    log = str(tmp_path_factory.mktemp("tf") / "server.log")
    argv = server_proc.tf_serve_argv(tiny_dir, port, 64, 16, "cpu")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with server_proc.Server("tf", argv, port, log, env, ready_timeout_s=120) as srv:
        yield srv
    assert not srv.alive()


def test_the_load_generator_against_transformers_serve(tf_server, tiny_dir, tmp_path, capsys) -> None:
    """Text prompts of the trace's lengths come back as exactly that many prompt tokens in the
    server's usage, and every answer is forced to its length (generation_config with EOS off).
    On a transformers older than the drivers run its serve on (5.17 in CI), what is checked is
    that the drivers refuse it, as a usage error naming the version."""
    import serve_bench
    import serve_compare

    if not TF_SERVE:
        with pytest.raises(SystemExit) as e:
            serve_compare.main(["--tiny", "--model-dir", tiny_dir, "--servers", "tf", "--out", str(tmp_path)])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and "--servers tf: the drivers run transformers serve from transformers 5.23" in last
        return

    # --model: transformers serve 5.17 answers /v1/models with 500
    rc = serve_bench.main(["--base-url", tf_server.base_url, "--model", tiny_dir, "--num-prompts", "5",
                           "--request-rate", "inf",
                           "--max-prompt", "120", "--max-output", "8", "--force-output", "generation-config",
                           "--warmup", "1", "--out", str(tmp_path), "--strict"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "serve_bench.json").read_text())
    assert doc["model"] == tiny_dir
    for run in doc["runs"]:
        m = run["metrics"]
        assert m["completed"] == 5 and m["failed"] == 0 and m["wrong_length"] == 0 and m["no_usage"] == 0
        assert m["total_output_tokens"] == sum(q["output_len"] for q in run["per_request"])
        for q in run["per_request"]:
            assert q["prompt_tokens"] == q["prompt_len"] and q["finish_reason"] == "length"
            assert 0 < q["ttft_s"] <= q["e2el_s"]
        assert m["mean_tpot_ms"] > 0 and m["p99_itl_ms"] >= m["median_itl_ms"] > 0
    # token-id prompts: transformers serve answers 400, each counted as a failure, the run goes on
    rc = serve_bench.main(["--base-url", tf_server.base_url, "--model", tiny_dir, "--num-prompts", "2",
                           "--prompts", "ids", "--vocab-size", "256",
                           "--force-output", "generation-config", "--warmup", "0", "--out", str(tmp_path / "ids"),
                           "--strict"])
    assert rc == 1
    m = json.loads((tmp_path / "ids" / "serve_bench.json").read_text())["runs"][0]["metrics"]
    assert m["failed"] == 2 and m["failure_reasons"] == {"HTTP 400": 2}
    assert tf_server.alive()


def fake_cmd(*knobs: str) -> str:
    return " ".join([sys.executable, FAKE, *knobs])


def running(marker: str) -> list[str]:
    """Command lines of live processes (zombies left out) that name ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmd and state != "Z":
            out.append(cmd)
    return out


def test_serve_multitenant_pool_and_static_with_a_fake_vmem_serve(tmp_path, monkeypatch, capsys) -> None:
    """Pool mode starts one server of three named models and the total; static mode three, a
    third each; every tenant's requests go to its model; the parts merge into one table."""
    import serve_multitenant

    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("SERVE_FAKE_ARGV_LOG", str(argv_log))
    common = ["--tiny", "--models-root", str(tmp_path / "models"), "--vmem-serve-cmd", fake_cmd("--itl", "0.001"),
              "--windows", "100", "--window", "10", "--time-scale", "20", "--requests", "3", "--max-output", "4",
              "--total", "24M", "--ready-timeout", "60"]
    for mode in ("pool", "static"):
        assert serve_multitenant.main([*common, "--modes", mode, "--out", str(tmp_path / mode)]) == 0
    assert running(str(tmp_path / "models")) == []  # every server stopped
    starts = [json.loads(line) for line in argv_log.read_text().splitlines()]
    names = ["llama8b-conv", "llama1b-code", "qwen7b-code"]
    assert [[m.split("=")[0] for m in s["model"]] for s in starts] == [names, *[[n] for n in names]]
    assert [s["memory"] for s in starts] == [24 << 20] + [(24 << 20) // 3] * 3
    assert serve_multitenant.main(["--merge", str(tmp_path / "pool"), str(tmp_path / "static"),
                                   "--out", str(tmp_path / "all")]) == 0
    doc = json.loads((tmp_path / "all" / "serve_multitenant.json").read_text())
    assert {(r["mode"], r["window"], r["tenant"]) for r in doc["runs"]} == \
        {(m, 100.0, n) for m in ("pool", "static") for n in names}
    assert all(r["metrics"]["failed"] == 0 and r["metrics"]["completed"] == r["metrics"]["requests"] > 0
               for r in doc["runs"])
    assert doc["metrics_samples"] and "vmem:kv_held_bytes" in next(iter(doc["metrics_samples"][0]["samples"][0]
                                                                         ["metrics"]))
    text = (tmp_path / "all" / "serve_multitenant.txt").read_text()
    assert "demand_peak/share" in text and text.count("llama1b-code") == 1
    with pytest.raises(SystemExit):
        serve_multitenant.main([*common, "--windows", "99999", "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit) as e:  # one run in two parts: a usage error
        serve_multitenant.main(["--merge", str(tmp_path / "pool"), str(tmp_path / "pool"),
                                "--out", str(tmp_path / "twice")])
    assert e.value.code == 2 and "in two parts" in capsys.readouterr().err.splitlines()[-1]


def test_serve_compare_and_steady_with_a_fake_vmem_serve(tiny_dir, tmp_path, capsys) -> None:
    import serve_compare
    import serve_steady

    common = ["--tiny", "--model-dir", tiny_dir, "--max-prompt", "64", "--max-output", "4", "--ready-timeout", "60"]
    # Nx rates with no transformers serve run and no --capacity: a usage error
    with pytest.raises(SystemExit) as e:
        serve_compare.main([*common, "--servers", "vmem", "--out", str(tmp_path / "c0")])
    assert e.value.code == 2
    rc = serve_compare.main([*common, "--servers", "vmem", "--capacity", "20", "--rates", "0.5x,inf,1x",
                             "--num-prompts", "6", "--min-prompts", "3", "--rate-seconds", "0.5",
                             "--vmem-serve-cmd", fake_cmd("--itl", "0.001"), "--out", str(tmp_path / "c")])
    assert rc == 0
    doc = json.loads((tmp_path / "c" / "serve_compare.json").read_text())
    assert [(r["rate_text"], round(float(r["rate_req_s"]), 3), r["metrics"]["requests"]) for r in doc["runs"]] == \
        [("inf", float("inf"), 6), ("0.5x", 10.0, 5), ("1x", 20.0, 6)]
    assert doc["capacity"]["vmem"] > 0 and doc["meta"]["tf_blocks"] == (16 << 20) // (256 * 1024)
    assert running(f"{FAKE} --itl") == []  # its one server stopped
    # the overhead part: the engine in process (a child) with vmem, then the server, at one load;
    # where vmem does not serve this transformers, a usage error naming it
    served = True
    try:
        import vmem.transformers as vt

        vt.install()
        vt.uninstall()
    except Exception:  # noqa: BLE001 (VmemError: not served)
        served = False
    argv = [*common, "--parts", "overhead", "--overhead-requests", "4", "--overhead-tokens", "4",
            "--inproc-contender", "vmem-token-major", "--inproc-max-requests", "4", "--inproc-max-context", "1024",
            "--vmem-serve-cmd", fake_cmd("--itl", "0.001"), "--out", str(tmp_path / "o")]
    if not served:
        with pytest.raises(SystemExit) as e:
            serve_compare.main(argv)
        assert e.value.code == 2 and "--parts overhead: " in capsys.readouterr().err
    else:
        assert serve_compare.main(argv) == 0
        o = json.loads((tmp_path / "o" / "serve_compare.json").read_text())["overhead"]
        assert o["inprocess"]["generated_tokens"] == 16 and o["inprocess"]["tok_s"] > 0
        assert o["server"]["metrics"]["completed"] == 4 and o["server"]["metrics"]["total_output_tokens"] == 16
        assert o["server_over_inprocess"] == pytest.approx(o["server"]["metrics"]["output_throughput"]
                                                           / o["inprocess"]["tok_s"])
        assert "server overhead: vmem-serve" in capsys.readouterr().out
    # a server that fails one request in three: the steady run says FAILED and exits 1
    rc = serve_steady.main([*common, "--server", "vmem", "--rate", "10", "--duration", "2", "--warm-skip", "0.5",
                            "--sample-every", "0.2", "--vmem-serve-cmd", fake_cmd("--fail-every", "3"),
                            "--out", str(tmp_path / "s")])
    assert rc == 1
    doc = json.loads((tmp_path / "s" / "serve_steady.json").read_text())
    assert doc["metrics"]["failed"] > 0 and not doc["passed"] and doc["flatness"]["rss"]["flat"] is not None
    assert len(doc["samples"]) >= 5 and all(s["rss"] for s in doc["samples"][:-1])
    assert "steady run: FAILED" in capsys.readouterr().out
    assert running(f"{FAKE} --fail-every") == []
