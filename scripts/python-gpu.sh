#!/usr/bin/env bash
# The Python package's GPU tests and benchmarks: wheels built on a build machine (Rust and
# maturin), run on a CUDA GPU machine with torch and transformers (no Rust needed there).
# Tests are in python/tests (test_gpu.py holds the ones that need a GPU; pytest skips them
# elsewhere); benchmarks are in python/benches.
#   scripts/python-gpu.sh build      # here: build the abi3 wheel into .whl/
#   scripts/python-gpu.sh run        # GPU (.whl/ copied): install it, run the whole pytest suite
#                                    # with torch and transformers (GPU tests included)
#   scripts/python-gpu.sh bench-gpu  # GPU (.whl/ copied): python/benches/gpu_bench.py, decode
#                                    # throughput vs DynamicCache/StaticCache and pad_rows vs
#                                    # zero_page (BENCHES=name,name runs only those)
#   scripts/python-gpu.sh prefill    # GPU (.whl/ copied): TTFT of demand paging (prefill_cost.py)
#   scripts/python-gpu.sh compiled   # GPU (.whl/ copied): VmemCache(static=True) vs StaticCache,
#                                    # both compiled by generate (CUDA graphs): compiled_bench.py
#   scripts/python-gpu.sh bench-build  # here: vmem's wheel and the benchmark helpers' wheel
#                                    # (python/benches/native, module vmem_bench) into .whl/
#   scripts/python-gpu.sh bench      # GPU (.whl/ copied): the in-process allocation benchmark,
#                                    # vmem vs raw CUDA VMM vs kvcached (alloc_bench.py);
#                                    # kvcached's PyPI sdist must be in .whl/ (it is built
#                                    # on the GPU machine, never committed)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# On the GPU machine: install the wheels of .whl/ into /tmp/site (replacing what an earlier run
# left there) and point Python at it; results go to $out.
install_wheel() {
  cd "$root"
  out=${VMEM_BENCH_OUT:-/tmp/vmem-python-gpu}
  mkdir -p "$out"
  . "$root/scripts/gpu-env.sh"
  gpu_site /tmp/site .whl/vmem*.whl
}
# Here: an abi3 wheel (CPython 3.9+; the GPU machine has Python 3.12) of the crate in $1. No
# auditwheel: the extension needs only glibc, and loads libcuda at run time.
build_wheel() {
  (cd "$1" && maturin build --release --out "$root/.whl" --compatibility linux --skip-auditwheel)
}
case "${1:-}" in
  build)
    rm -f "$root"/.whl/vmem*.whl
    build_wheel "$root/python"
    ls -l "$root"/.whl/vmem*.whl
    ;;
  run)
    install_wheel
    echo "== pytest python/tests (torch, transformers and the GPU present here)"
    python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 | tee "$out/pytest.txt"
    ;;
  bench-gpu)
    install_wheel
    VMEM_BENCH_OUT="$out" python3 python/benches/gpu_bench.py 2>&1 | tee "$out/gpu_bench.txt"
    ;;
  prefill)
    install_wheel
    VMEM_BENCH_OUT="$out" python3 python/benches/prefill_cost.py 2>&1 | tee "$out/prefill_cost.txt"
    ;;
  compiled)
    install_wheel
    status=0
    echo "== pytest python/tests/test_hf.py python/tests/test_kvcache.py (torch, transformers present)"
    python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_hf.py python/tests/test_kvcache.py 2>&1 | tee "$out/pytest-hf.txt" || status=1
    echo "== python/benches/compiled_bench.py"
    VMEM_BENCH_OUT="$out" python3 python/benches/compiled_bench.py 2>&1 | tee "$out/compiled_bench.txt" || status=1
    exit $status
    ;;
  bench-build)
    rm -f "$root"/.whl/vmem*.whl
    build_wheel "$root/python"
    build_wheel "$root/python/benches/native"
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
    VMEM_BENCH_OUT="$out" python3 python/benches/alloc_bench.py 2>&1 | tee "$out/alloc_bench.txt"
    ;;
  *)
    echo "usage: $0 build|run|bench-gpu|prefill|compiled|bench-build|bench" >&2
    exit 2
    ;;
esac
