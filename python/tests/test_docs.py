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


ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "serve_cpu.py")
_SKIP_DIRS = {".git", "target", "node_modules", ".venv", "__pycache__", ".pytest_cache"}
#: Files the README links to that another branch is writing (docs/server.md: the HTTP server's
#: guide, issue #52). A link to one may dangle until that branch lands; drop it from here then.
AWAITED = {os.path.join("docs", "server.md")}


def _markdown_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        for f in files:
            if f.endswith(".md"):
                yield os.path.join(top, f)


def _prose(text):
    """``text`` without fenced code blocks and inline code spans (code is not linked from)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path, cache={}):  # noqa: B006 (a cache across calls)
    """The heading anchors GitHub makes for the markdown file at ``path``."""
    if path not in cache:
        with open(path, encoding="utf-8") as fh:
            text = re.sub(r"^```.*?^```", "", fh.read(), flags=re.S | re.M)
        slugs = set()
        for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M):
            slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
            slugs.add(slug)
        cache[path] = slugs
    return cache[path]


def test_every_relative_link_in_the_docs_resolves():
    """Every ``[text](target)`` in every markdown file of the repository that is not a URL names a
    file or folder that exists, and its ``#anchor`` a heading of that file."""
    dead = []
    files = list(_markdown_files())
    assert len(files) > 10, f"found only {files} under {ROOT}"
    for md in files:
        with open(md, encoding="utf-8") as fh:
            text = _prose(fh.read())
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            where = f"{os.path.relpath(md, ROOT)}: ({target})"
            if not os.path.exists(full) and os.path.relpath(full, ROOT) not in AWAITED:
                dead.append(f"{where}: no {os.path.relpath(full, ROOT)}")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                dead.append(f"{where}: no heading #{anchor}")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_link_check_finds_a_dead_link(tmp_path):
    # The check above must be able to fail: a missing file and a missing heading are both caught.
    (tmp_path / "a.md").write_text("# A\n[ok](a.md#a) [gone](b.md) [no heading](a.md#nope) `[code](x.md)`\n")
    text = _prose((tmp_path / "a.md").read_text())
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    assert targets == ["a.md#a", "b.md", "a.md#nope"]
    assert not (tmp_path / "b.md").exists() and "nope" not in _anchors(str(tmp_path / "a.md"))
    assert "a" in _anchors(str(tmp_path / "a.md"))


def _serving_snippet(path):
    with open(path, encoding="utf-8") as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), re.S)
    served = [b for b in blocks if "generate_batch" in b and "from_config" in b]
    assert served, f"{path} lost its CPU serving snippet"
    return served[0]


@pytest.mark.parametrize("doc", ["README.md", os.path.join("docs", "serving.md")])
def test_the_serving_snippets_are_the_example_verbatim(doc):
    """The README's and docs/serving.md's CPU serving snippet is the part of examples/serve_cpu.py
    above its check, character for character (CI runs the example on every transformers version)."""
    with open(EXAMPLE, encoding="utf-8") as fh:
        example = fh.read()
    snippet = _serving_snippet(os.path.join(ROOT, doc))
    assert snippet.startswith("import ") and snippet in example, f"{doc}'s snippet is not in {EXAMPLE}"
    body = example[example.index('"""', 3) + 3:].lstrip("\n")
    assert body.startswith(snippet), f"{doc}'s snippet is not the example's first part"
    assert "# The check:" in body[len(snippet):], "the example's check no longer follows its serving part"


def test_the_readme_is_at_most_100_lines():
    with open(README, encoding="utf-8") as fh:
        assert len(fh.read().splitlines()) <= 100


def test_every_results_path_the_docs_name_exists():
    """Paths under docs/results/ named in code spans (`results/x/y.txt`, globs and `{a,b}` allowed)
    exist: a results folder renamed or deleted leaves no stale path behind."""
    import glob

    stale = []
    for md in _markdown_files():
        with open(md, encoding="utf-8") as fh:
            text = re.sub(r"^```.*?^```", "", fh.read(), flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]*results/[^`\n]*)`", text):
            for path in re.findall(r"(?:\.\./|docs/)?results/[\w./*{},|-]*", span):
                prefix = re.split(r"[*{|]", path)[0]
                bases = (os.path.dirname(md), ROOT, os.path.join(ROOT, "docs"))
                if not any(glob.glob(os.path.join(base, prefix) + "*") for base in bases):
                    stale.append(f"{os.path.relpath(md, ROOT)}: `{path}`")
    assert not stale, "results paths that do not exist:\n" + "\n".join(stale)
