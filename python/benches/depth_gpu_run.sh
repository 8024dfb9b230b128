#!/usr/bin/env bash
# The serving suite's full-depth rows on a CUDA GPU, bounded at 10 minutes: Llama-3-8B shapes at
# all 32 layers, the conv trace, 128 requests x 128 new tokens, both budgets (every request fits;
# a tenth of the working set), the two FlashInfer paged peers (their eager prompt rounds read
# with FlashInfer's fa2, and with its Hopper kernel: fi-paged-fa3-...) beside vmem with its
# decode rounds read by vmem's slot kernel (split_reader="triton") and its eager rounds' prompts
# by FlashInfer's Hopper prefill (prompt_reader="flashinfer"), then the profile of one of vmem's
# contenders at a tenth: $DEPTH_PROFILE (none: no profile), by default the one in the rows.
# $DEPTH_CONTENDERS (comma-separated) names other contenders for the suite's rows, $DEPTH_MODEL
# another of the suite's models (llama3.2-1b: Llama-3.2-1B's shapes at its 16 layers).
#
#   bash python/benches/depth_gpu_run.sh [WHEEL_DIR]
#
# Needs a CUDA GPU, torch, transformers, FlashInfer 0.6 and vmem (pip install "vmem-kv[flashinfer]"),
# run from the repository root. A host without a package index can bring them as wheels: every
# wheel in .whl/ (vmem's from scripts/python-gpu.sh build, FlashInfer's) is installed into a site
# folder of the run's own first, when .whl/ holds vmem's. WHEEL_DIR: wheels of another
# transformers and its dependencies, installed the same way over the one installed (5.24: its
# wheel and regex's; 5.25: also huggingface_hub 2.4, kernels 0.19 and theirs). Results in
# $VMEM_BENCH_OUT/depth (/tmp/depth if it is unset). DEPTH_SECONDS bounds the whole run (570 by
# default; the suite takes at most 400 of them, the profile what is left: the three contenders at
# both budgets took 237-365 s on an H100, 47-123 s of it each peer's warm-up, which captures
# every graph it replays and, the first time on a machine, has FlashInfer build its kernels;
# the profile about 160 s).
set -o pipefail
usage="usage: $0 [WHEEL_DIR]"
[ $# -le 1 ] || { echo "$usage" >&2; exit 2; }
if [ $# -eq 1 ] && ! compgen -G "$1/*.whl" > /dev/null; then
  echo "$0: $1 holds no wheels (*.whl); $usage" >&2
  exit 2
fi
seconds=${DEPTH_SECONDS:-570}
case "$seconds" in ''|*[!0-9]*) seconds=bad ;; esac
[ "$seconds" != bad ] && [ ${#seconds} -le 6 ] && seconds=$((10#$seconds)) && [ "$seconds" -ge 1 ] \
  && [ "$seconds" -le 86400 ] || {
  echo "$0: DEPTH_SECONDS must be a whole number of seconds from 1 to 86400, not '${DEPTH_SECONDS}'" >&2; exit 2; }
[ -f python/benches/serving_suite.py ] || { echo "$0: run it from the repository root; $usage" >&2; exit 2; }
command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1 || {
  echo "$0: needs a CUDA GPU (nvidia-smi finds none here)" >&2; exit 1; }
. "$(dirname "$0")/../../scripts/gpu-env.sh"
if compgen -G ".whl/vmem*.whl" > /dev/null; then
  gpu_site /tmp/site-depth .whl/*.whl || exit 1
fi
if [ $# -eq 1 ]; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site-depth-tf "$1"/*.whl || exit 1
  export PYTHONPATH=/tmp/site-depth-tf:$PYTHONPATH
fi
export USE_HUB_KERNELS=NO FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
out=${VMEM_BENCH_OUT:-/tmp}/depth
mkdir -p "$out"
gpu_name > "$out/nvidia-smi.txt"
python3 -c "import transformers, vmem.transformers; print('transformers', transformers.__version__)" \
  > "$out/versions.txt" 2> "$out/import.log" || {
  echo "$0: torch, transformers and vmem must import here (pip install \"vmem-kv[flashinfer]\"): $(tail -1 "$out/import.log")" >&2
  exit 1; }
cat "$out/versions.txt"
peer=fi-paged-graphs-async-512-compile
peer_fa3=fi-paged-fa3-graphs-async-512-compile
slots_fi=vmem-token-major-fatri-fiprompts-graphs-async-compile
w=(--only "model=${DEPTH_MODEL:-llama3-8b}" --only trace=conv --requests 128 --new-tokens 128)
start=$(date +%s)
suite_s=$(( seconds < 400 ? seconds : 400 ))
timeout "$suite_s" python3 python/benches/serving_suite.py "${w[@]}" --check-requests 0 --rounds 1 \
  --only "contender=${DEPTH_CONTENDERS:-$peer,$peer_fa3,$slots_fi}" --out "$out/suite" 2>&1 | tee "$out/suite.log"
suite=$?
[ "${DEPTH_PROFILE:-}" != none ] || exit "$suite"  # DEPTH_PROFILE=none: the suite's rows only
left=$(( seconds - ($(date +%s) - start) ))
[ "$left" -gt 0 ] || { echo "$0: no time left for the profile (DEPTH_SECONDS=$seconds)" >&2; exit 1; }
timeout "$left" python3 python/benches/serving_suite.py "${w[@]}" --only budget=tenth --profile "${DEPTH_PROFILE:-$slots_fi}" \
  --out "$out/profile" 2>&1 | tee "$out/profile.log"
profile=$?
# Either part failing (or cut off by its timeout) fails the run.
[ "$suite" -eq 0 ] && [ "$profile" -eq 0 ]
