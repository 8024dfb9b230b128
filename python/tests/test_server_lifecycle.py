"""vmem-serve's life as a process: a bad command line is refused with one line and status 2
before anything loads; a port in use or a path with no model fail with status 1; SIGTERM stops
accepting, lets the requests in flight finish and exits 0; an idle model's KV memory is released
after ``--idle-sleep`` and it wakes on the next request with the same answers.

Needs torch, a transformers vmem serves and the server's dependencies (scripts/test.sh's serving
stage); skipped, saying why, elsewhere."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

import server_util as su

su.require()

import httpx  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return su.make_model_dir(str(tmp_path_factory.mktemp("model") / "tiny"))


def run_cli(args, timeout=120):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "vmem.server", *args], capture_output=True, text=True,
                       timeout=timeout, env=dict(__import__("os").environ, CUDA_VISIBLE_DEVICES=""))
    return r.returncode, r.stdout, r.stderr, time.monotonic() - t0


@pytest.mark.parametrize("args,says", [
    ([], "--model"),
    (["--model", "m", "--port", "abc"], "--port"),
    (["--model", "m", "--port", "70000"], "--port"),
    (["--model", "m", "--port", "-1"], "--port"),
    (["--model", "m", "--memory", "lots"], "--memory"),
    (["--model", "m", "--memory", "0"], "--memory"),
    (["--model", "m", "--max-queue", "-1"], "--max-queue"),
    (["--model", "m", "--max-requests", "0"], "--max-requests"),
    (["--model", "m", "--max-context", "1.5"], "--max-context"),
    (["--model", "m", "--idle-sleep", "-1"], "--idle-sleep"),
    (["--model", "m", "--idle-sleep", "nan"], "--idle-sleep"),
    (["--model", "m", "--drain-timeout", "inf"], "--drain-timeout"),
    (["--model", "m", "--sampling", "maybe"], "--sampling"),
    (["--model", "m", "--api-key", "two words"], "--api-key"),
    (["--model", "m", "--vmem-option", "novalue"], "--vmem-option"),
    (["--model", ""], "--model"),
    (["--model", "a=x", "--model", "a=y", "--memory", "1G"], "twice"),
    (["--model", "a=x", "--limit", "a=50%"], "--limit"),
    (["--model", "a=x", "--model", "b=y"], "--memory"),
    (["--model", "a=x", "--model", "b=y", "--memory", "1G", "--limit", "c=1G"], "no model named"),
    (["--model", "a=x", "--model", "b=y", "--memory", "1G", "--limit", "a=0"], "limit"),
    (["--model", "a=x", "--model", "b=y", "--memory", "1G", "--limit", "a=1G", "--floor", "a=2G"], "floor"),
])
def test_a_bad_command_line_is_one_line_and_status_2_before_anything_loads(args, says):
    code, out, err, took = run_cli(args)
    assert code == 2, (args, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vmem-serve: error:") and says in lines[0], err
    assert out == ""
    assert took < 30, f"{took:.1f} s: something was loaded before the options were checked"


@pytest.mark.parametrize("changes,says", [({"page_size": "3M"}, "page_size"),
                                          ({"vmem_options": (("nonsense", 1),)}, "nonsense"),
                                          ({"vmem_options": (("split_decode", "maybe"),)}, "split_decode"),
                                          ({"max_context": 100000}, "max_position_embeddings")])
def test_options_checked_against_the_model_and_vmem_are_refused_before_loading(model_dir, changes, says):
    import vmem
    from vmem.server.engine import Engine
    from vmem.server.options import ModelSpec, ServerOptions

    opts = ServerOptions(models=(ModelSpec("tiny", model_dir),), **changes)
    engine = Engine(opts, opts.models[0])
    with pytest.raises(vmem.InvalidArgument, match=says):
        engine.prepare()
    assert engine.model is None, "the weights were loaded before the options were checked"


def test_those_are_usage_errors_of_the_command_and_a_missing_model_is_status_1(model_dir, tmp_path):
    code, _, err, _ = run_cli(["--model", model_dir, "--port", "0", "--page-size", "3M"])
    assert code == 2 and "page_size" in err and len(err.strip().splitlines()) == 1, err
    code, _, err, _ = run_cli(["--model", str(tmp_path / "nothing"), "--port", "0"])
    assert code == 1 and "cannot load" in err and len(err.strip().splitlines()) == 1, err


def test_a_port_in_use_fails_at_once_with_status_1(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err, took = run_cli(["--model", model_dir, "--port", str(taken.getsockname()[1]), *su.TINY_ARGS])
    assert code == 1 and "cannot listen" in err, err
    assert took < 30, f"{took:.1f} s: the model was read before the port was taken"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = su.Server(["--model", f"tiny={model_dir}", *su.TINY_ARGS, "--idle-sleep", "1"],
                  str(tmp_path_factory.mktemp("log") / "log")).wait_ready()
    yield s
    s.stop(signal.SIGKILL)  # the SIGTERM test stopped it already (or failed)


def test_an_idle_model_sleeps_and_wakes_on_the_next_request(server):
    api = su.client(server.url)
    before = api.completions.create(model="tiny", prompt="w3 w4", max_tokens=8, temperature=0).choices[0].text
    assert server.metric("vmem:kv_cache_physical_bytes") > 0
    deadline = time.monotonic() + 30
    while server.metric("vmem:asleep") != 1:
        assert time.monotonic() < deadline, "the model did not sleep"
        time.sleep(0.1)
    assert server.metric("vmem:kv_cache_physical_bytes") == 0 and server.metric("vmem:kv_cache_bytes") == 0
    assert server.metric("vmem:idle_sleeps_total") == 1
    after = api.completions.create(model="tiny", prompt="w3 w4", max_tokens=8, temperature=0).choices[0].text
    assert after == before
    assert server.metric("vmem:asleep") == 0 and server.metric("vmem:kv_cache_physical_bytes") > 0


def test_sigterm_stops_accepting_finishes_what_is_in_flight_and_exits_0(server):
    """Last in this module: it stops the server."""
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    whole = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as other, httpx.stream("POST", server.url + "/v1/completions", json=body,
                                                         timeout=60) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: {"))
        pending = other.build_request("POST", server.url + "/v1/completions", json=whole)
        import threading

        answer = {}
        t = threading.Thread(target=lambda: answer.setdefault("r", other.send(pending)))
        t.start()
        time.sleep(0.5)  # the whole-response request is in flight too
        server.proc.send_signal(signal.SIGTERM)
        # New connections are refused once the listening socket closes (at once).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(server.url + "/health", timeout=1)
            except httpx.ConnectError:
                break
            except httpx.RemoteProtocolError:
                pass  # queued as the socket closed, dropped unanswered: not refused yet, so probe again
            time.sleep(0.05)
        else:
            raise AssertionError("the server still accepts connections after SIGTERM")
        rest = [ln for ln in lines if ln.startswith("data: ")]
        t.join(timeout=60)
    assert rest[-1] == "data: [DONE]" and first
    assert json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 40, "the stream was cut"
    assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 30
    assert server.proc.wait(timeout=60) == 0, server.output()[-3000:]
