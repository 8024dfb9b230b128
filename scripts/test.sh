#!/usr/bin/env bash
# Every test, Rust and Python: the README's test command, and what CI runs.
#
#   scripts/test.sh                 # all three parts, in order
#   scripts/test.sh python serving  # some of them
#   VMEM_TEST_TRANSFORMERS="5.17.0 5.24.0" scripts/test.sh serving   # some of the versions below
#
#   rust     cargo test --workspace (GPU tests are listed as ignored: they need a GPU)
#   python   the Python package, built and installed into a venv with NumPy, pytest and mypy (no
#            torch), then pytest: the stubs checked against the built module (mypy.stubtest),
#            the docstring examples and the docs' first steps included (tests that need torch,
#            transformers or a GPU say they are skipped, and why)
#   serving  torch (the GPU machine's build, run on CPU) and, for each transformers version
#            below, the whole Python suite but the GPU tests (the oldest and newest vmem serves)
#            or its serving core (the versions between), then examples/serve_cpu.py; here no
#            test may skip
#
# The venvs are kept between runs under $VMEM_TEST_VENVS (default target/venvs), each named by
# what it holds: py<Python>-test, py<Python>-torch<torch> (torch, the test tools, and the vmem
# build of this run), transformers<version>-py<Python> (that version and its dependencies) and
# py<Python>-torch<torch>-transformers<version> (a venv that sees the two before it). A venv is
# made once, downloading what it holds, and marked complete; later runs only rebuild vmem from
# this tree (no index, no download). Delete a folder to make it again. CI starts from a clean
# clone, so it installs everything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

TORCH_VERSION=2.11.0
# The transformers versions vmem.transformers is tested on, each in a venv of its own, and what
# runs on each: "all", the whole Python suite but the GPU tests, for the oldest and the newest
# vmem serves (5.17.x's adapter; the 5.19-5.25 one's newest); "core", SERVING_CORE (the patch
# table's check included), for the oldest of the 5.19-5.25 range, 5.23 and 5.24 (the whole
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

PYTHON_VERSION=$(python3 -c 'import platform; print(platform.python_version())')
VENVS=${VMEM_TEST_VENVS:-$root/target/venvs}
LOGS=$root/target/test-logs

part_rust() {
  echo "== Rust: cargo test --workspace"
  cargo test --workspace 2>&1 | tee "$LOGS/rust.log"
}

# venv_ready DIR [PACKAGE...]: true when DIR was completed by an earlier run with the same
# PACKAGE... (its packages are kept; a changed list makes it again).
venv_ready() { local d=$1; shift; [ -f "$d/.complete" ] && [ "$(cat "$d/.complete")" = "$*" ]; }

# new_venv DIR PACKAGE...: a venv at DIR with PACKAGE... installed (a half-made one is removed
# first), marked complete once everything is in.
new_venv() {
  local venv=$1
  shift
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q --no-cache-dir "$@"
  echo "$*" > "$venv/.complete"
}

# keep_or_make DIR PACKAGE...: DIR as an earlier run left it, or a new venv of PACKAGE....
keep_or_make() {
  local venv=$1 t0
  if venv_ready "$@"; then
    echo "   $venv: kept from an earlier run (remove the folder to make it again)"
  else
    t0=$(date +%s)
    echo "   $venv: making it (downloads what it holds)"
    new_venv "$@"
    echo "   $venv: ready in $(( $(date +%s) - t0 ))s"
  fi
}

# install_vmem VENV: this tree's vmem built into VENV, with nothing fetched from an index
# (maturin is in VENV; the crates come from cargo's cache).
install_vmem() {
  "$1/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --force-reinstall ./python
}

part_python() {
  local venv=$VENVS/py$PYTHON_VERSION-test
  echo "== Python: vmem into $venv, then pytest (stubtest included)"
  keep_or_make "$venv" numpy pytest mypy "maturin>=1.5,<2"
  install_vmem "$venv"
  # Run from outside the source tree so `import vmem` finds the installed package.
  (cd "$venv" && bin/python -m pytest -rs -p no:cacheprovider "$root/python/tests") 2>&1 | tee "$LOGS/python.log"
}

# transformers_venv V: a venv that sees the torch venv and transformers V (installed once, with
# its dependencies, into a folder of its own), for the runs of version V.
transformers_venv() {
  local v=$1 torch_venv=$2 tf venv sp torch_sp
  tf=$VENVS/transformers$v-py$PYTHON_VERSION
  venv=$VENVS/py$PYTHON_VERSION-torch$TORCH_VERSION-transformers$v
  if ! venv_ready "$tf"; then
    rm -rf "$tf"
    echo "   $tf: installing transformers $v (downloads it and its dependencies)" >&2
    # (A command substitution does not inherit `set -e`: every step says its failure itself.)
    "$torch_venv/bin/python" -m pip install -q --no-cache-dir --target "$tf" "transformers==$v" >&2 || return 1
    touch "$tf/.complete" || return 1
  fi
  if ! venv_ready "$venv"; then
    rm -rf "$venv"
    python3 -m venv --without-pip "$venv" || return 1
    sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    torch_sp=$("$torch_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    # transformers' folder first (its dependencies win), then the torch venv as a site folder
    # (its own .pth files are read: vmem, torch and the test tools).
    echo "$tf" > "$sp/a_transformers.pth" || return 1
    echo "import site; site.addsitedir('$torch_sp')" > "$sp/b_torch.pth" || return 1
    touch "$venv/.complete" || return 1
  fi
  echo "$venv"
}

part_serving() {
  local torch_venv=$VENVS/py$PYTHON_VERSION-torch$TORCH_VERSION
  echo "== Python serving: torch $TORCH_VERSION (CPU) at $torch_venv"
  # torch from PyPI brings the CUDA libraries (~5 GB installed): one torch venv, kept; each
  # transformers version is a folder of its own beside it.
  # psutil: the multi-tenant bench watches its processes; fastapi, uvicorn, httpx,
  # prometheus-client: vmem-serve (the server extra's); openai: its tests' client; accelerate:
  # `transformers serve` and loading straight to the device (test_server*, test_serve_bench*)
  keep_or_make "$torch_venv" "torch==$TORCH_VERSION" numpy pytest mypy psutil "maturin>=1.5,<2" \
    "fastapi>=0.135" "uvicorn>=0.30" "httpx>=0.27" "prometheus-client>=0.20" openai accelerate
  install_vmem "$torch_venv"
  local entry v what tests venv log t0 only=" ${VMEM_TEST_TRANSFORMERS:-} "
  for entry in "${TRANSFORMERS_VERSIONS[@]}"; do
    v=${entry%%:*} what=${entry#*:}
    [ "$only" = "  " ] || [[ "$only" == *" $v "* ]] || continue
    if [ "$what" = all ]; then
      tests=("$root/python/tests")
    else
      tests=("${SERVING_CORE[@]/#/$root/python/tests/}")
    fi
    echo "== Python serving: torch $TORCH_VERSION (CPU) and transformers $v ($what), no test may skip"
    t0=$(date +%s)
    venv=$(transformers_venv "$v" "$torch_venv") || { echo "transformers $v: could not make its venv" >&2; exit 1; }
    "$venv/bin/python" -c "import sys, transformers as t; sys.exit(t.__version__ != '$v' and f'transformers {t.__version__} imported, not $v')"
    log=$LOGS/serving-$v.log
    (cd "$venv" && CUDA_VISIBLE_DEVICES= bin/python -m pytest -rs -p no:cacheprovider \
      --ignore="$root/python/tests/test_gpu.py" "${tests[@]}") 2>&1 | tee "$log"
    # No test may skip for want of torch or transformers. The one that reads the full Azure
    # trace from ../shared/traces (beside the checkout in CI, not in a bare clone) may skip.
    if grep '^SKIPPED' "$log" | grep -qv 'shared traces'; then
      echo "serving with transformers $v: tests skipped where torch and transformers are installed:" >&2
      grep '^SKIPPED' "$log" | grep -v 'shared traces' >&2
      exit 1
    fi
    echo "== examples/serve_cpu.py on transformers $v"
    (cd "$venv" && CUDA_VISIBLE_DEVICES= bin/python "$root/examples/serve_cpu.py") 2>&1 | tee "$LOGS/example-$v.log"
    echo "   transformers $v: done in $(( $(date +%s) - t0 ))s"
  done
}

# What ran, from the logs of this run: the counts docs/status.md points to.
summary() {
  local f v
  echo "== Summary (this run; logs in ${LOGS#$root/})"
  if [ -f "$LOGS/rust.log" ]; then
    awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1); if ($i ~ /^ignored;?$/) g += $(i-1) } }
         END { printf "   rust: %d passed, %d failed, %d ignored (the GPU tests)\n", p, f, g }' "$LOGS/rust.log"
  fi
  [ -f "$LOGS/python.log" ] && echo "   python (no torch): $(grep -E '^=+ .* in [0-9.]+s' "$LOGS/python.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
  for f in "$LOGS"/serving-*.log; do
    [ -f "$f" ] || continue
    v=${f##*/serving-}; v=${v%.log}
    echo "   serving, transformers $v: $(grep -E '^=+ .* in [0-9.]+s' "$f" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//'); example: $(tail -1 "$LOGS/example-$v.log" 2>/dev/null)"
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
for v in ${VMEM_TEST_TRANSFORMERS:-}; do
  case " ${TRANSFORMERS_VERSIONS[*]} " in
    *" $v:"*) ;;
    *) echo "$0: VMEM_TEST_TRANSFORMERS: $v is not one of the versions tested (${TRANSFORMERS_VERSIONS[*]%%:*})" >&2; exit 2 ;;
  esac
done
rm -rf "$LOGS"
mkdir -p "$LOGS" "$VENVS"
for p in "${parts[@]}"; do "part_$p"; done
summary
