#!/usr/bin/env bash
# GPU checks and benchmarks, built here, run on the GPU machine in one call.
#   scripts/gpu-bench.sh build   # here: release-build vmem-gpu, vmem and the GPU tests into .carry/
#   scripts/gpu-bench.sh run     # there: run them (carry .carry), print the table last
#   scripts/gpu-bench.sh alloc   # there: only alloc-bench, vmem's allocation path vs raw
#   scripts/gpu-bench.sh manager # there: only manager-cost, what the KV manager adds to the
#                                # backend's calls and what their placement costs the driver
#   scripts/gpu-bench.sh table-build / table   # the in-process allocation table with kvcached
#                                # (scripts/python-gpu.sh bench-build / bench; carry .whl)
# The GPU machine has no Rust toolchain; the binaries load libcuda at run time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  build)
    cd "$root"
    cargo build --release -p vmem-bench -p vmem-cli --bins
    mkdir -p .carry
    cp target/release/vmem-gpu target/release/alloc-bench target/release/manager-cost target/release/vmem .carry/
    # The GPU tests, as a test executable (#[ignore]d in `cargo test`; run with
    # --include-ignored there, where a missing GPU fails them).
    exe=$(cargo test --release -p vmem-tests --test gpu --no-run --message-format=json 2>/dev/null \
      | grep -o '"executable":"[^"]*/deps/gpu-[^"]*"' | cut -d'"' -f4 | tail -1)
    cp "$exe" .carry/gpu-tests
    strip .carry/vmem-gpu .carry/alloc-bench .carry/manager-cost .carry/vmem .carry/gpu-tests   # stay under the 64 MiB carry limit
    echo "built .carry/vmem-gpu .carry/alloc-bench .carry/manager-cost .carry/vmem .carry/gpu-tests"
    ;;
  alloc)
    cd "$root"
    out=${OUT:-/tmp/vmem-gpu-out}
    mkdir -p "$out"
    .carry/alloc-bench 2>&1 | tee "$out/alloc-bench.txt"
    ;;
  manager)
    cd "$root"
    out=${OUT:-/tmp/vmem-gpu-out}
    mkdir -p "$out"
    .carry/manager-cost 2>&1 | tee "$out/manager-cost.txt"
    ;;
  run)
    cd "$root"
    out=${OUT:-/tmp/vmem-gpu-out}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$out/gpu.txt"
    ls -l /dev/nvidia-uvm 2>&1 | tee -a "$out/gpu.txt" || true
    echo "== vmem detect"
    .carry/vmem detect 2>&1 | tee "$out/detect.txt"
    echo "== vmem replay on the GPU (CUDA backend, 2MB), first 500 requests"
    .carry/vmem replay --trace vmem-cli/data/traces/azure-conv-2023-first2000.csv --requests 500 --budget 8GiB 2>&1 | tee "$out/replay.txt"
    echo "== GPU tests (cargo test -p vmem-tests --test gpu, built here)"
    .carry/gpu-tests --include-ignored --nocapture --test-threads=1 2>&1 | tee "$out/gpu-tests.txt"
    echo "== vmem-gpu"
    # cuBLAS and nvrtc are loaded at run time: point the loader at the CUDA toolkit's copies.
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    RUST_LOG=warn VMEM_OUT="$out" .carry/vmem-gpu 2>&1 | tee "$out/vmem-gpu.txt"
    echo "== alloc-bench"
    .carry/alloc-bench 2>&1 | tee "$out/alloc-bench.txt"
    echo "== manager-cost"
    .carry/manager-cost 2>&1 | tee "$out/manager-cost.txt"
    echo "== stock-driver proxy of the vMem map path (tests/gpu/uvm_semaphore_proxy.cu)"
    /usr/local/cuda/bin/nvcc -O2 -arch=sm_90 -o /tmp/uvm-proxy tests/gpu/uvm_semaphore_proxy.cu -lcuda
    /tmp/uvm-proxy 2>&1 | tee "$out/uvm-semaphore-proxy.txt"
    ;;
  table-build)
    exec "$root/scripts/python-gpu.sh" bench-build
    ;;
  table)
    exec "$root/scripts/python-gpu.sh" bench
    ;;
  *)
    echo "usage: $0 build|run|alloc|manager|table-build|table" >&2
    exit 2
    ;;
esac
