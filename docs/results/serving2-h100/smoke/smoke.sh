#!/bin/bash
# The serving suite's GPU smoke run (reduced sizes, existing contenders) and a profile.
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site vmem*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $OUT/nvidia-smi.txt
C=vmem-per-layer,vmem-token-major,paged-sdpa-256,paged-flex-256
t0=$(date +%s)
timeout 215 python3 python/benches/serving_suite.py --requests 32 --new-tokens 32 --only contender=$C \
  --out $OUT/smoke 2>&1 | tee $OUT/log.txt
echo "suite exit $? after $(( $(date +%s) - t0 )) s" | tee -a $OUT/log.txt
t1=$(date +%s)
timeout 60 python3 python/benches/serving_suite.py --requests 32 --new-tokens 32 --profile vmem-token-major \
  --only model=llama3.2-1b --only trace=conv --only budget=fits --out $OUT/smoke 2>&1 | tee $OUT/profile-log.txt
echo "profile exit $? after $(( $(date +%s) - t1 )) s" | tee -a $OUT/profile-log.txt
