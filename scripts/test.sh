#!/usr/bin/env bash
# Every test, Rust and Python: the README's test command, and what CI runs.
#
#   scripts/test.sh                 # all three parts, in order
#   scripts/test.sh python serving  # some of them
#
#   rust     cargo test --workspace (GPU tests are listed as ignored: they need a GPU)
#   python   the Python package, built and installed into a fresh venv under target/ with
#            NumPy, pytest and mypy (no torch), then pytest: the stubs checked against the
#            built module (mypy.stubtest), the docstring examples and the docs' first steps
#            included (tests that need torch, transformers or a GPU say they are skipped, and why)
#   serving  one fresh venv with torch (the GPU machine's build, run on CPU); for each
#            transformers version below, that version installed into it, then the whole Python
#            suite but the GPU tests (the oldest and newest vmem serves), or its serving core
#            (the versions between); here no test may skip
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

TORCH_VERSION=2.11.0
# The transformers versions vmem.transformers is tested on, in the order installed (one venv,
# each version over the one before), and what runs on each: "all", the whole Python suite but
# the GPU tests, for the oldest and the newest vmem serves (5.17.x's adapter; the 5.19-5.25
# one's newest); "core", SERVING_CORE (the patch table's check included), for the oldest of the
# 5.19-5.25 range, 5.23, the version the GPU machine's numbers are taken on, and 5.24 (the whole
# suite on every version took 28 of CI's 60 minutes).
TRANSFORMERS_VERSIONS=(
  5.17.0:all
  5.19.0:core
  5.23.0:core
  5.24.0:core
  5.25.0:all
)
# The serving core: the version gate and install extra, the engine's own path against vmem's
# (both layouts, preemption, prefix sharing), CUDA graphs' rounds, the compiled forward, no KV
# read through the engine, the scheduler's safety margin checked by vmem (where 5.17 and 5.19+
# schedulers differ).
SERVING_CORE=(
  test_transformers_versions.py
  test_transformers_cb.py
  test_transformers_graphs.py
  test_transformers_compile.py
  test_transformers_kvread.py
  test_transformers_margin.py
)

part_rust() {
  echo "== Rust: cargo test --workspace"
  cargo test --workspace
}

# A fresh venv at $1 with the package and the packages named after it.
make_venv() {
  local venv=$1
  shift
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q ./python "$@"
}

part_python() {
  echo "== Python: pip install ./python into target/py-test-venv, then pytest (stubtest included)"
  local venv=target/py-test-venv
  make_venv "$venv" numpy pytest mypy
  # Run from outside the source tree so `import vmem` finds the installed package.
  (cd "$venv" && bin/python -m pytest -rs -p no:cacheprovider "$root/python/tests")
}

part_serving() {
  local v venv=target/py-serving log t0
  # One venv for every version: torch from PyPI brings the CUDA libraries (~5 GB installed), so
  # a venv per version filled CI's disk. Each version is installed over the one before (pip
  # replaces transformers and moves its dependencies to what that version asks for), and the
  # run checks which version it imported. No pip cache: nothing is downloaded twice.
  t0=$(date +%s)
  echo "== Python serving: one venv with torch $TORCH_VERSION (CPU) at $venv"
  make_venv "$venv" --no-cache-dir "torch==$TORCH_VERSION" numpy pytest mypy psutil  # psutil: the multi-tenant bench watches its processes
  echo "   venv ready in $(( $(date +%s) - t0 ))s"
  local entry what tests
  for entry in "${TRANSFORMERS_VERSIONS[@]}"; do
    v=${entry%%:*} what=${entry#*:}
    if [ "$what" = all ]; then
      tests=("$root/python/tests")
    else
      tests=("${SERVING_CORE[@]/#/$root/python/tests/}")
    fi
    echo "== Python serving: torch $TORCH_VERSION (CPU) and transformers $v ($what), no test may skip"
    t0=$(date +%s)
    "$venv/bin/python" -m pip install -q --no-cache-dir "transformers==$v"
    "$venv/bin/python" -c "import sys, transformers as t; sys.exit(t.__version__ != '$v' and f'transformers {t.__version__} imported, not $v')"
    log=target/py-serving-$v.log
    (cd "$venv" && CUDA_VISIBLE_DEVICES= bin/python -m pytest -rs -p no:cacheprovider \
      --ignore="$root/python/tests/test_gpu.py" "${tests[@]}") 2>&1 | tee "$log"
    # No test may skip for want of torch or transformers. The one that reads the full Azure
    # trace from ../shared/traces (beside the checkout in CI, not in a bare clone) may skip.
    if grep '^SKIPPED' "$log" | grep -qv 'shared traces'; then
      echo "serving with transformers $v: tests skipped where torch and transformers are installed:" >&2
      grep '^SKIPPED' "$log" | grep -v 'shared traces' >&2
      exit 1
    fi
    echo "   transformers $v: done in $(( $(date +%s) - t0 ))s"
  done
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(rust python serving)
for p in "${parts[@]}"; do
  case "$p" in
    rust|python|serving) ;;
    *) echo "$0: unknown part '$p' (rust, python, serving)" >&2; exit 2 ;;
  esac
done
for p in "${parts[@]}"; do "part_$p"; done
