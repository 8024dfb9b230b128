#!/usr/bin/env bash
# The GPU machine's one call for the multi-tenant bench (docs/multitenant.md, "Three models on
# one GPU"): every scenario and mode plus the kill check (--keep-going: a failed tenant run is
# recorded and the next served), results in $OUT/multitenant-h100.
# Run from the carried tree (.carry/<branch>), with the vmem wheel beside it. The bench saves
# multitenant.json after every run, so a call cut short keeps the runs it finished.
set -o pipefail
. "$(dirname "$0")/../../scripts/gpu-env.sh"
gpu_site /tmp/site-h-tenants vmem*.whl || exit 1
python3 -c "import vmem.pool, vmem.transformers" || exit 1
gpu_name
mkdir -p "$OUT/multitenant-h100"
timeout 570 python3 python/benches/multitenant_bench.py --kill --keep-going --out "$OUT/multitenant-h100" "$@" 2>&1 \
  | tee "$OUT/multitenant-h100/log.txt"
