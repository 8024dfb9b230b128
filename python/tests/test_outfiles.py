"""The harness's output files are replaced whole (python/benches/harness/outfiles.py): a set of
files is written beside and renamed together; a write error (a full disk) names the file,
replaces none of them and leaves no ``.tmp`` behind; the writers that use it keep their files."""

from __future__ import annotations

import errno
import json
import os

import pytest
from harness import outfiles


def full_disk(monkeypatch, failing: str) -> None:
    """``open`` of ``failing`` + ``.tmp`` succeeds, and its write then fails with ENOSPC."""
    real = open

    class Full:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, _text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    def fake(path, *a, **k):
        f = real(path, *a, **k)
        return Full(f) if str(path).endswith(failing + ".tmp") else f

    monkeypatch.setattr("builtins.open", fake)


def listing(d) -> dict[str, str]:
    return {n: (d / n).read_text() for n in sorted(os.listdir(d))}


def test_a_set_is_replaced_together(tmp_path) -> None:
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.json")
    outfiles.replace({a: "one", b: "[1]"})
    assert listing(tmp_path) == {"a.txt": "one", "b.json": "[1]"}
    outfiles.replace({a: "two", b: "[2]"})
    assert listing(tmp_path) == {"a.txt": "two", "b.json": "[2]"}
    outfiles.replace_one(a, "")
    assert listing(tmp_path) == {"a.txt": "", "b.json": "[2]"}


@pytest.mark.parametrize("failing", ["a.txt", "b.json"])
def test_a_full_disk_names_the_file_and_replaces_none(tmp_path, monkeypatch, failing) -> None:
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.json")
    outfiles.replace({a: "before", b: "[0]"})
    full_disk(monkeypatch, failing)
    with pytest.raises(outfiles.WriteError) as e:
        outfiles.replace({a: "after", b: "[1]"})
    assert isinstance(e.value, OSError) and e.value.path == str(tmp_path / failing)
    assert str(e.value) == f"writing {tmp_path / failing}: [Errno 28] No space left on device"
    assert listing(tmp_path) == {"a.txt": "before", "b.json": "[0]"}


def test_a_missing_folder_is_a_write_error(tmp_path) -> None:
    with pytest.raises(outfiles.WriteError, match="writing .*nowhere/a.txt: .*No such file"):
        outfiles.replace_one(str(tmp_path / "nowhere" / "a.txt"), "x")


@pytest.mark.parametrize("files", [None, ["a"], {"a": b"bytes"}, {1: "x"}])
def test_anything_but_paths_to_text_is_a_type_error(files) -> None:
    with pytest.raises(TypeError, match="mapping of path strings to text strings"):
        outfiles.replace(files)


def test_the_suite_table_keeps_its_last_whole_files_on_a_full_disk(tmp_path, monkeypatch) -> None:
    from harness import suite_report

    rows = [{"contender": "x", "trace": "conv", "model": "m", "budget": "fits", "round": 0, "tok_s": 10.0}]
    suite_report.save(str(tmp_path), [{"device": "A"}], rows, [])
    before = listing(tmp_path)
    assert set(before) == {"suite.json", "suite.txt", "suite.svg"}
    full_disk(monkeypatch, "suite.svg")
    with pytest.raises(outfiles.WriteError, match="suite.svg"):
        suite_report.save(str(tmp_path), [{"device": "B"}], rows * 2, [])
    assert listing(tmp_path) == before and json.loads(before["suite.json"])["parts"] == [{"device": "A"}]


def test_the_status_file_and_a_tenant_result_are_whole_json(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers", reason="the steady-load harness imports the server's")
    from harness import serve_steady, tenant

    serve_steady.write_status(str(tmp_path), state="building")
    serve_steady.write_status(str(tmp_path), pid=7)
    assert {k: v for k, v in serve_steady.read_status(str(tmp_path)).items() if k != "updated"} == {
        "state": "building", "pid": 7}
    tenant.write_json(str(tmp_path / "r.json"), {"tok_s": 1.5})
    full_disk(monkeypatch, "r.json")
    with pytest.raises(outfiles.WriteError):
        tenant.write_json(str(tmp_path / "r.json"), {"tok_s": 2.5})
    assert json.loads((tmp_path / "r.json").read_text()) == {"tok_s": 1.5}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_folder_in_the_way_is_refused_before_anything_is_written(tmp_path) -> None:
    a = str(tmp_path / "a.txt")
    outfiles.replace_one(a, "before")
    (tmp_path / "b.json").mkdir()
    with pytest.raises(outfiles.WriteError, match=r"writing .*b\.json: \[Errno 21\] Is a directory"):
        outfiles.replace({a: "after", str(tmp_path / "b.json"): "[1]"})
    assert (tmp_path / "a.txt").read_text() == "before" and sorted(os.listdir(tmp_path)) == ["a.txt", "b.json"]


def test_an_interrupt_while_writing_leaves_the_files_and_no_tmp(tmp_path, monkeypatch) -> None:
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.json")
    outfiles.replace({a: "before", b: "[0]"})
    real = open

    def interrupted(path, *args, **kw):
        if str(path).endswith("b.json.tmp"):
            raise KeyboardInterrupt
        return real(path, *args, **kw)

    monkeypatch.setattr("builtins.open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outfiles.replace({a: "after", b: "[1]"})
    assert listing(tmp_path) == {"a.txt": "before", "b.json": "[0]"}


def test_a_failed_rename_is_a_write_error_and_leaves_no_tmp(tmp_path, monkeypatch) -> None:
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.json")
    real = os.replace

    def read_only(src, dst):
        if str(dst).endswith("b.json"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(outfiles.WriteError, match=r"writing .*b\.json: \[Errno 30\] Read-only file system"):
        outfiles.replace({a: "new", b: "[1]"})
    assert listing(tmp_path) == {"a.txt": "new"}
