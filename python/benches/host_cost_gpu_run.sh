#!/usr/bin/env bash
# The host cost per engine round on a CUDA GPU, in under 10 minutes: host_cost.py with --device
# cuda, vmem against the engine's own paged cache, interleaved. Needs a CUDA GPU with torch and
# transformers. Run from the repository root with vmem installed (or its wheel in the current
# folder); results in $OUT (default /tmp/host-cost-gpu).
set -o pipefail
. "$(dirname "$0")/../../scripts/gpu-env.sh"
export PYTHONUNBUFFERED=1
if ls vmem*.whl >/dev/null 2>&1; then
  gpu_site /tmp/site-h-hostcost vmem*.whl || exit 1
fi
python3 -c "import vmem.transformers" || exit 1
gpu_name
out=${OUT:-/tmp/host-cost-gpu}
# The decode batches the suite serves and a prefill-heavy start; 1B-x16 first (16 layers: where the
# per-layer and per-row host work shows). Capped so that both shapes fit one call.
timeout 280 python3 python/benches/host_cost.py --device cuda --shapes 1b-x16 --batches 16,64,256 --repeats 2 \
  --new-tokens 32 --profile --out "$out/1b-x16" 2>&1 | grep -v WARNING | tee "$out/1b-x16.log"
timeout 200 python3 python/benches/host_cost.py --device cuda --shapes 8b-x8 --batches 64,256 --repeats 2 \
  --new-tokens 32 --out "$out/8b-x8" 2>&1 | grep -v WARNING | tee "$out/8b-x8.log"
