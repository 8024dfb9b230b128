#!/usr/bin/env bash
# kernel="flashinfer" on the GPU machine (one call): GPU test, engine check, serving bench.
set -o pipefail
cd "$(dirname "$0")"
TF=${TF:-}
rm -rf /tmp/site-hfi  # a warm machine may hold another engineer's /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-hfi vmem*.whl ../fi/*.whl
PP=/tmp/site-hfi
if [ -n "$TF" ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/tf523 ../tf523/*.whl; PP=/tmp/site-hfi:/tmp/tf523; fi
export PYTHONPATH=$PP PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers, flashinfer, vmem.transformers as vt; print(torch.__version__, transformers.__version__, flashinfer.__version__, vt.__file__, vt.KERNELS)" || exit 1
cd python
S=$SECONDS
if [ -z "$TF" ]; then
  timeout 110 python3 -P -m pytest -x -q -s tests/test_gpu.py -k flashinfer 2>&1 | tail -80 > $OUT/test_gpu_flashinfer.txt; echo "pytest rc=$? $((SECONDS-S)) s"; tail -3 $OUT/test_gpu_flashinfer.txt
fi
S=$SECONDS
(cd benches && timeout ${CHECK_S:-100} python3 flashinfer_check.py --out $OUT 2>&1 | grep -v WARNING | tail -40 > $OUT/flashinfer_check.txt); echo "check rc=$? $((SECONDS-S)) s"; tail -14 $OUT/flashinfer_check.txt
S=$SECONDS
(cd benches && timeout ${BENCH_S:-130} python3 serving_bench.py --contenders ${CONT:-vmem-per-layer,vmem-per-layer-fi,vmem-token-major,vmem-token-major-fi} --requests ${REQ:-128} --new-tokens ${NEW:-128} --out $OUT 2>&1 | grep -v WARNING | tail -30 > $OUT/serving_bench_log.txt); echo "bench rc=$? $((SECONDS-S)) s"; tail -12 $OUT/serving_bench_log.txt
