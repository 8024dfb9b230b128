"""The docs' examples run: every module's docstring examples (doctest), and the first-steps
snippet docs/python.md gives (the one the README shows)."""

import doctest
import importlib
import os
import re

import pytest

import vmem

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "python.md")


@pytest.mark.parametrize(
    "name,needs",
    [("vmem", None), ("vmem._device", None), ("vmem.vattention", None), ("vmem.torch", "torch"),
     ("vmem.transformers.generate", "transformers")],
)
def test_docstring_examples(name, needs):
    if needs:
        pytest.importorskip(needs, reason=f"{name}'s examples need {needs}, not installed here")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=FLAGS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (output above)"


def first_steps():
    with open(DOCS) as fh:
        text = fh.read()
    m = re.search(r"<!-- first steps: .*? -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/python.md lost its first-steps snippet"
    return m.group(1)


def test_the_first_steps_snippet_runs_as_written(capsys):
    pytest.importorskip("numpy")
    exec(compile(first_steps(), "docs/python.md first steps", "exec"), {})
    out = capsys.readouterr().out
    assert "float16" in out and "cpu" in out, out


def test_the_prefix_sharing_snippet_runs_as_written(capsys):
    pytest.importorskip("numpy")
    with open(DOCS) as fh:
        m = re.search(r"<!-- prefix sharing: .*? -->\s*```python\n(.*?)```", fh.read(), re.S)
    assert m, "docs/python.md lost its prefix-sharing snippet"
    exec(compile(m.group(1), "docs/python.md prefix sharing", "exec"), {})
    assert capsys.readouterr().out.split() == ["64", "0", "15", "896", "1.0", "896"]


def test_every_module_has_examples():
    # A module whose examples were deleted would pass test_docstring_examples by running none.
    for name in ["vmem", "vmem._device"]:
        assert doctest.DocTestFinder().find(importlib.import_module(name))[0].examples, name
    assert vmem.__doc__ and ">>>" in vmem.__doc__


def test_the_stubs_match_the_module():
    # scripts/test.sh runs stubtest too; here it runs wherever mypy is installed.
    pytest.importorskip("mypy", reason="mypy is not installed here; scripts/test.sh installs it and runs stubtest")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "vmem._vmem", "--concise"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def test_the_readme_host_example_runs_as_written():
    # The README's Python example on host memory: a newcomer's first try, so it must run as shown.
    pytest.importorskip("numpy")
    with open(README) as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), re.S)
    host = [b for b in blocks if 'device="cpu"' in b]
    assert host, "README.md lost its host-memory Python example"
    scope: dict = {}
    exec(compile(host[0], "README.md host example", "exec"), scope)
    k0, r = scope["k0"], scope["r"]
    assert k0.shape == (4, 4096, 8, 128) and str(k0.dtype) == "float16"
    assert (k0[r, 1200:] == 0).all(), "rows past the request's length must read as zeros"


def test_the_readme_install_line_brings_what_its_example_imports():
    # Issue #30 item 15: `pip install ./python`, then the example's `import numpy` failed in a
    # fresh venv. Every module the host example imports must come from the install line: vmem
    # itself, a package it names, or an extra of ./python it asks for.
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    with open(README) as fh:
        text = fh.read()
    section = text[text.index("## Python"):]
    line = re.search(r"^(?:#\s*)?pip install ([^:#\n]+)", section, re.M)
    assert line, "README.md's Python section lost its `pip install` line"
    words = line.group(1).split()
    pyproject = os.path.join(os.path.dirname(README), "python", "pyproject.toml")
    with open(pyproject, "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    brought = {"vmem"}
    for w in (w.strip("\"'") for w in words):
        m = re.fullmatch(r"\./python(?:\[(.*)\])?", w)
        if m:
            for extra in filter(None, (m.group(1) or "").split(",")):
                brought |= {re.split(r"[<>=\[ ;]", req)[0].lower() for req in extras[extra.strip()]}
        else:
            brought.add(re.split(r"[<>=\[ ;]", w)[0].lower())
    host = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'device="cpu"' in b)
    imported = {name.split()[0].split(".")[0] for stmt in re.findall(r"^import (.+)$", host, re.M)
                for name in stmt.split(",")}
    assert imported and imported <= brought, f"the example imports {sorted(imported - brought)}, " \
        f"which `pip install {line.group(1).strip()}` does not install"
