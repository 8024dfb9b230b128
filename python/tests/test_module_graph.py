"""The package's modules and the extension's Rust files import one another one way only: no
import circle (issue #31). Read from the source, so nothing is built or imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]


def _circle(graph: Dict[str, Set[str]]) -> List[str]:
    """One circle of `graph` as the names along it (empty when there is none)."""
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(n: str) -> List[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        path.pop()
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def _python_graph() -> Dict[str, Set[str]]:
    pkg = ROOT / "vmem"
    graph: Dict[str, Set[str]] = {}
    for f in pkg.rglob("*.py"):
        mod = ".".join(("vmem",) + f.relative_to(pkg).with_suffix("").parts)
        if mod.endswith(".__init__"):
            continue  # a package's face hands names on
        base = mod.rsplit(".", 1)[0].split(".")
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parent = ".".join(base[: len(base) - node.level + 1])
                target = parent + ("." + node.module if node.module else "")
                if node.module:
                    deps.add(target)
                else:  # `from . import torch`: each name is a module of the parent
                    deps.update(f"{parent}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("vmem."))
        graph[mod] = {d for d in deps if d != mod}
    return graph


def _rust_graph(src: Path) -> Dict[str, Set[str]]:
    """The crate's top modules and the ones each uses; a module's child files (`ledger/check.rs`)
    count as the module itself (`ledger`), as their `crate::` paths are its."""
    files = [f for f in src.rglob("*.rs") if f.relative_to(src).parts[0] != "lib.rs"]
    top = {f: f.relative_to(src).parts[0].removesuffix(".rs") for f in files}
    mods = set(top.values())
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for f, m in top.items():
        text = f.read_text()
        used = set(re.findall(r"crate::(\w+)", text))
        # `use crate::{a::X, b::Y}`
        for group in re.findall(r"use crate::\{([^}]*)\}", text):
            used.update(re.findall(r"(\w+)::", group))
        graph[m] |= (used & mods) - {m}
    return graph


def test_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) == []


def test_a_child_module_file_counts_as_its_module(tmp_path):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "lib.rs").write_text("mod floor;\nmod ledger;\n")
    (tmp_path / "floor.rs").write_text("use crate::ledger::Ledger;\n")
    (tmp_path / "ledger.rs").write_text("mod check;\n")
    (tmp_path / "ledger" / "check.rs").write_text("use crate::{error::Result, floor::Floor};\n")
    assert _rust_graph(tmp_path) == {"floor": {"ledger"}, "ledger": {"floor"}}
    assert _circle(_rust_graph(tmp_path)) == ["floor", "ledger", "floor"]


def test_the_python_package_has_no_import_circle():
    assert _circle(_python_graph()) == []


def test_the_extension_has_no_import_circle():
    assert _circle(_rust_graph(ROOT / "src")) == []


def test_vmem_pool_has_no_import_circle():
    assert _circle(_rust_graph(ROOT.parent / "vmem-pool" / "src")) == []


def _imports_of(text: str, module: str, package: bool = False) -> Set[str]:
    """Every absolute module name the source ``text`` of ``module`` imports (relative imports
    resolved from its package; ``package``: it is a package's ``__init__``), and each name
    taken from one as ``module.name``."""
    parts = module.split(".") if package else module.split(".")[:-1]
    names: Set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _engine_imports(names: Set[str]) -> List[str]:
    return sorted(n for n in names if n.split(".")[0] == "transformers" or n.startswith("vmem.transformers"))


def test_the_kernels_know_no_engine():
    """vmem.kernels (the readers) import neither transformers nor vmem's engine glue, so another
    engine can serve with them; the glue imports them, never the other way."""
    kernels = sorted((ROOT / "vmem" / "kernels").glob("*.py"))
    assert len(kernels) > 5
    for f in kernels:
        module = "vmem.kernels" if f.name == "__init__.py" else f"vmem.kernels.{f.stem}"
        bad = _engine_imports(_imports_of(f.read_text(), module, package=f.name == "__init__.py"))
        assert not bad, f"{f.name} imports {bad}"


def test_the_layer_check_sees_an_import_of_the_glue():
    """The check above can fail: a kernel's relative or absolute import of the engine is seen."""
    text = "from ..transformers.options import Options\nfrom .. import transformers\nimport transformers.cache_utils\n"
    assert _engine_imports(_imports_of(text, "vmem.kernels.fa")) == [
        "transformers.cache_utils", "vmem.transformers", "vmem.transformers.options", "vmem.transformers.options.Options"]
    assert _engine_imports(_imports_of("from .fa import FaReader\n", "vmem.kernels", package=True)) == []
