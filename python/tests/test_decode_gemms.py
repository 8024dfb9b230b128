"""The decode-round GEMM bench (python/benches/decode_gemms.py): the fused and separate forms
hold the same weights (so the same FLOPs and bytes), the roofline's count of them; a ``--tiny``
run on the CPU writes its table (its flags: test_bench_cli.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["llama3.2-1b", "tiny"])
def test_both_forms_hold_the_roofline_weights(name) -> None:
    import decode_gemms as dg

    dims = {**dg.SHAPES, **dg.TINY}[name]
    small = (2, *dims[1:]) if name != "tiny" else dims  # two layers are enough to count
    s = dg.shape_of(small, 100)
    counts = {f: [sum(w.numel() for w in layer) for layer in dg.weights(s, f, "cpu", torch.float32)]
              for f in (*dg.FORMS, "head")}
    assert counts["separate"] == counts["fused"] == [s.layer_matmul_params] * s.layers
    assert counts["head"] == [s.head_params]
    shapes = [tuple(w.shape) for w in dg.weights(s, "fused", "cpu", torch.float32)[0]]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    assert shapes == [(q + 2 * kv, s.hidden), (s.hidden, q), (2 * s.intermediate, s.hidden), (s.hidden, s.intermediate)]


def test_tiny_run_writes_its_table(tmp_path, capsys) -> None:
    import decode_gemms as dg

    assert dg.main(["--tiny", "--rows", "2,8", "--reps", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "decode_gemms.json").read_text())
    assert [(r["rows"], r["form"]) for r in doc["rows"]] == [(2, "separate"), (2, "fused"), (8, "separate"), (8, "fused")]
    assert all(r["layers_ms"] > 0 and r["round_ms"] == pytest.approx(r["layers_ms"] + r["head_ms"]) for r in doc["rows"])
    text = (tmp_path / "decode_gemms.txt").read_text()
    assert "median of 2 calls" in text
    assert text == capsys.readouterr().out


def test_a_full_disk_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch) -> None:
    import errno

    import decode_gemms as dg

    real = open

    def full(path, *a, **k):
        if str(path).endswith(".json.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    assert dg.main(["--tiny", "--rows", "2", "--reps", "1", "--out", str(tmp_path)]) == 1
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip() == (
        f"decode_gemms: writing {tmp_path / 'decode_gemms.json'}: [Errno 28] No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
