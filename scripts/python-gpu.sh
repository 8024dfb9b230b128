#!/usr/bin/env bash
# The Python package's GPU checks and benchmarks, built here, run on the GPU machine in one call.
#   scripts/python-gpu.sh build   # here: build the abi3 wheel into .whl/
#   scripts/python-gpu.sh run     # there (carry .whl): install it, run the pytest suite with
#                                 # torch and transformers, then python/tests/gpu_check.py
#                                 # (CHECKS=name,name runs only those of its checks)
#   scripts/python-gpu.sh prefill # there (carry .whl): TTFT of demand paging (prefill_cost.py)
#   scripts/python-gpu.sh compiled # there (carry .whl): VmemCache(static=True) vs StaticCache,
#                                 # both compiled by generate (CUDA graphs): compiled_bench.py
#   scripts/python-gpu.sh bench-build  # here: the wheel with the `bench` feature, into .whl/
#   scripts/python-gpu.sh bench   # there (carry .whl): the in-process allocation benchmark,
#                                 # vmem vs raw CUDA VMM vs kvcached; kvcached's PyPI sdist must
#                                 # be in .whl/ (it is built there, never committed here)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# There: install the carried wheel into /tmp/site (replacing what an earlier call on a still
# warm machine left there) and point Python at it; results go to $out.
install_wheel() {
  cd "$root"
  out=${OUT:-/tmp/vmem-python-gpu}
  mkdir -p "$out"
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/vmem-*.whl
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
}
case "${1:-}" in
  build)
    cd "$root/python"
    rm -f "$root"/.whl/vmem-*.whl
    # abi3 (CPython 3.9+); the GPU machine has Python 3.12. No auditwheel: the extension needs
    # only glibc, and loads libcuda at run time.
    maturin build --release --out "$root/.whl" --compatibility linux --skip-auditwheel
    ls -l "$root"/.whl/vmem-*.whl
    ;;
  run)
    install_wheel
    echo "== pytest python/tests (torch and transformers present here)"
    status=0
    python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 | tee "$out/pytest.txt" || status=1
    echo "== python/tests/gpu_check.py"
    OUT="$out" python3 python/tests/gpu_check.py 2>&1 | tee "$out/gpu_check.txt" || status=1
    exit $status
    ;;
  prefill)
    install_wheel
    OUT="$out" python3 python/tests/prefill_cost.py 2>&1 | tee "$out/prefill_cost.txt"
    ;;
  compiled)
    install_wheel
    status=0
    echo "== pytest python/tests/test_hf.py python/tests/test_kvcache.py (torch, transformers present)"
    python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_hf.py python/tests/test_kvcache.py 2>&1 | tee "$out/pytest-hf.txt" || status=1
    echo "== python/tests/compiled_bench.py"
    OUT="$out" python3 python/tests/compiled_bench.py 2>&1 | tee "$out/compiled_bench.txt" || status=1
    exit $status
    ;;
  bench-build)
    cd "$root/python"
    rm -f "$root"/.whl/vmem-*.whl
    maturin build --release --features bench --out "$root/.whl" --compatibility linux --skip-auditwheel
    ls -l "$root"/.whl/
    ;;
  bench)
    install_wheel
    rm -rf /tmp/kvcached && mkdir -p /tmp/kvcached && tar xzf .whl/kvcached-*.tar.gz -C /tmp/kvcached --strip-components=1
    (cd /tmp/kvcached && python3 setup.py build_ext --inplace > "$out/kvcached-build.txt" 2>&1) || { tail -30 "$out/kvcached-build.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:/tmp/kvcached PYTHONUNBUFFERED=1
    # kvcached's extension is built by the machine's newer g++ while the Python process loads
    # an older libstdc++ first; kvcached's page allocator then segfaults printing through
    # std::cout in its constructor (its own KVCacheManager too). Load the compiler's libstdc++.
    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) \
    OUT="$out" python3 python/tests/alloc_bench.py 2>&1 | tee "$out/alloc_bench.txt"
    ;;
  *)
    echo "usage: $0 build|run|prefill|compiled|bench-build|bench" >&2
    exit 2
    ;;
esac
