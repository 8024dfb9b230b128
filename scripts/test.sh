#!/usr/bin/env bash
# Every test, Rust and Python: the README's test command, and what CI runs.
#   1. cargo test --workspace (GPU tests are listed as ignored: they need a GPU)
#   2. the Python package, built and installed into a fresh venv under target/ with mypy, then
#      pytest: the stubs checked against the built module (mypy.stubtest), the docstring
#      examples and the docs' first steps included (tests that need torch, transformers or a
#      GPU say they are skipped, and why)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

echo "== Rust: cargo test --workspace"
cargo test --workspace

echo "== Python: pip install ./python into target/py-test-venv, then pytest (stubtest included)"
venv=target/py-test-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q ./python numpy pytest mypy
# Run from outside the source tree so `import vmem` finds the installed package.
(cd "$venv" && bin/python -m pytest -rs -p no:cacheprovider "$root/python/tests")
