#!/usr/bin/env bash
# GPU checks and benchmarks: built on a machine with the Rust toolchain, run on the GPU machine
# from a copy of the repository that includes target/gpu-bench/bin/.
#   scripts/gpu-bench.sh build         # build machine: release-build vmem-gpu, alloc-bench,
#                                      # manager-cost, prefill-overlap, pool-pressure, vmem and
#                                      # the GPU tests into target/gpu-bench/bin/
#   scripts/gpu-bench.sh run [DIR]     # GPU machine: run them all, print the table last
#   scripts/gpu-bench.sh alloc [DIR]   # GPU machine: only alloc-bench, vmem's allocation path
#                                      # vs raw
#   scripts/gpu-bench.sh manager [DIR] # GPU machine: only manager-cost, what the KV manager
#                                      # adds to the backend's calls and what their placement
#                                      # costs the driver
#   scripts/gpu-bench.sh prefill [DIR] # GPU machine: only prefill-overlap, a 128K-token prefill
#                                      # mapped beside 64 decoding requests
#   scripts/gpu-bench.sh pressure [DIR]  # GPU machine: only pool-pressure, the pool's idle
#                                      # pages given back below min_free_memory
#   scripts/gpu-bench.sh table-build / table   # the in-process allocation table with kvcached
#                                      # (scripts/python-gpu.sh bench-build / bench)
# Outputs go to DIR (default target/gpu-bench/results). The GPU machine needs no Rust
# toolchain: the binaries load libcuda at run time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/gpu-bench/bin
out=$(realpath -m "${2:-$root/target/gpu-bench/results}")
case "${1:-}" in
  build)
    cd "$root"
    cargo build --release -p vmem-bench -p vmem-cli --bins
    mkdir -p "$bin"
    cp target/release/vmem-gpu target/release/alloc-bench target/release/manager-cost \
      target/release/prefill-overlap target/release/pool-pressure target/release/vmem "$bin/"
    # The GPU tests, as a test executable (#[ignore]d in `cargo test`; run with
    # --include-ignored there, where a missing GPU fails them).
    exe=$(cargo test --release -p vmem-tests --test gpu --no-run --message-format=json 2>/dev/null \
      | grep -o '"executable":"[^"]*/deps/gpu-[^"]*"' | cut -d'"' -f4 | tail -1)
    cp "$exe" "$bin/gpu-tests"
    # Stripped: small enough to copy to the GPU machine with the repository.
    (cd "$bin" && strip vmem-gpu alloc-bench manager-cost prefill-overlap pool-pressure vmem gpu-tests)
    echo "built $bin/: vmem-gpu alloc-bench manager-cost prefill-overlap pool-pressure vmem gpu-tests"
    ;;
  alloc | manager | prefill | pressure)
    # One benchmark binary alone, its output also saved as DIR/<binary>.txt.
    case "$1" in
      alloc) bench=alloc-bench ;;
      manager) bench=manager-cost ;;
      prefill) bench=prefill-overlap ;;
      pressure) bench=pool-pressure ;;
    esac
    cd "$root"
    mkdir -p "$out"
    "$bin/$bench" 2>&1 | tee "$out/$bench.txt"
    ;;
  run)
    cd "$root"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$out/gpu.txt"
    ls -l /dev/nvidia-uvm 2>&1 | tee -a "$out/gpu.txt" || true
    echo "== vmem detect"
    "$bin"/vmem detect 2>&1 | tee "$out/detect.txt"
    echo "== vmem replay on the GPU (CUDA backend, 2MB), first 500 requests"
    "$bin"/vmem replay --trace vmem-cli/data/traces/azure-conv-2023-first2000.csv --requests 500 --budget 8GiB 2>&1 | tee "$out/replay.txt"
    echo "== GPU tests (cargo test -p vmem-tests --test gpu, built here)"
    "$bin"/gpu-tests --include-ignored --nocapture --test-threads=1 2>&1 | tee "$out/gpu-tests.txt"
    echo "== vmem-gpu"
    # cuBLAS and nvrtc are loaded at run time: point the loader at the CUDA toolkit's copies.
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    RUST_LOG=warn VMEM_OUT="$out" "$bin"/vmem-gpu 2>&1 | tee "$out/vmem-gpu.txt"
    echo "== alloc-bench"
    "$bin"/alloc-bench 2>&1 | tee "$out/alloc-bench.txt"
    echo "== manager-cost"
    "$bin"/manager-cost 2>&1 | tee "$out/manager-cost.txt"
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
    echo "usage: $0 build | run|alloc|manager|prefill|pressure [DIR] | table-build | table" >&2
    exit 2
    ;;
esac
