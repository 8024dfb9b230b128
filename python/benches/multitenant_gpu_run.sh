#!/usr/bin/env bash
# The multi-tenant bench on a CUDA GPU (docs/multitenant.md, "Three models on one GPU"): every
# scenario and mode plus the kill check (--keep-going: a failed tenant run is recorded and the next
# served), results in $VMEM_BENCH_OUT/multitenant (/tmp/multitenant if it is unset).
# Run from the repository root with vmem's wheel in the current folder. The bench saves
# multitenant.json after every run, so a run cut short keeps the runs it finished.
set -o pipefail
. "$(dirname "$0")/../../scripts/gpu-env.sh"
gpu_site /tmp/site-h-tenants vmem*.whl || exit 1
python3 -c "import vmem.pool, vmem.transformers" || exit 1
gpu_name
out=${VMEM_BENCH_OUT:-/tmp}/multitenant
mkdir -p "$out"
timeout 570 python3 python/benches/multitenant_bench.py --kill --keep-going --out "$out" "$@" 2>&1 \
  | tee "$out/log.txt"
