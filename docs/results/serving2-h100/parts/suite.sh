#!/bin/bash
# The final H100 runs of the serving suite: $1 = part name, the rest = serving_suite.py flags.
set -o pipefail
part=$1; shift
site=/tmp/site-final
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target $site .whl/vmem*.whl .carry/fi/*.whl 2>&1 | tail -2
export PYTHONPATH=$site PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi
if [ -n "$TF523" ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/tf523 .carry/tf523/*.whl 2>&1 | tail -2
  export PYTHONPATH=$site:/tmp/tf523
fi
python3 -c "import vmem, vmem.pool, transformers, flashinfer; print('vmem ok; transformers', transformers.__version__)" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee $OUT/nvidia-smi-$part.txt
t0=$(date +%s)
timeout ${BUDGET:-520} python3 python/benches/serving_suite.py "$@" --out $OUT/$part 2>&1 | tee $OUT/log-$part.txt
echo "suite exit $? after $(( $(date +%s) - t0 )) s" | tee -a $OUT/log-$part.txt
