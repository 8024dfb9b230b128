#!/usr/bin/env bash
# The pool on a CUDA GPU (docs/multitenant.md): sleep/wake (pool_sleep.py), then the pool's Python
# tests with torch (host backend). Run from the repository root with vmem's wheel in the current
# folder; results in $VMEM_BENCH_OUT (default /tmp/vmem-pool).
set -o pipefail
. "$(dirname "$0")/../../scripts/gpu-env.sh"
gpu_site /tmp/site-h-poolpy vmem*.whl || exit 1
python3 -c "import vmem.pool" || exit 1
gpu_name
out=${VMEM_BENCH_OUT:-/tmp/vmem-pool}
mkdir -p "$out"
python3 python/benches/pool_sleep.py --out "$out/pool_sleep.json" 2>&1 | tee "$out/pool_sleep.log"
python3 python/benches/pool_sleep.py --layers 32 --requests 8 --tokens 8192 --repeats 3 \
  --out "$out/pool_sleep_32l.json" 2>&1 | tee "$out/pool_sleep_32l.log"
cd python && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_pool.py tests/test_pool_serving.py \
  2>&1 | tail -5 | tee "$out/pytest.log"
