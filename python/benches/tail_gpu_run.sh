#!/usr/bin/env bash
# The serving tail on a CUDA GPU, in one run of under 10 minutes (issue #50):
# Llama-3-8B shapes at full depth (32 layers), the conv trace, 128 requests x 128 new tokens, a
# tenth of the working set as KV memory. First the suite's rows for the FlashInfer paged peer,
# vmem, vmem holding a new request back a round rather than let it take pages still being
# unmapped (whose round would wait for the one in flight), vmem with deferred reclamation
# (preemptions counted the same way for each: the engine's), then vmem's profile: its slowest
# rounds with what their time went to (vmem_step: mapping on the host, of which vmem_wait waited
# for pages being unmapped; vmem_zero; the rest).
# `tail_gpu_run.sh peer` profiles the peer instead of vmem. Results in
# $VMEM_BENCH_OUT/tail (/tmp/tail if it is unset). Run from the repository root with .whl/
# holding vmem's wheel (scripts/python-gpu.sh build) and FlashInfer's for the machine's Python
# (`pip download --no-deps flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2`).
set -o pipefail
. "$(dirname "$0")/../../scripts/gpu-env.sh"
gpu_site /tmp/site-tail .whl/*.whl || exit 1
export USE_HUB_KERNELS=NO FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer
out=${VMEM_BENCH_OUT:-/tmp}/tail
mkdir -p "$out"
gpu_name > "$out/nvidia-smi.txt"
vmem=vmem-token-major-graphs-async-compile
peer=fi-paged-graphs-async-512-compile
profiled=$vmem
[ "${1:-}" = peer ] && profiled=$peer
w=(--only model=llama3-8b --only trace=conv --only budget=tenth --requests 128 --new-tokens 128)
start=$(date +%s)
timeout 400 python3 python/benches/serving_suite.py "${w[@]}" --check-requests 0 --rounds 1 \
  --only "contender=$peer,$vmem,$vmem-hold-admissions,$vmem-deferred" --out "$out/suite" 2>&1 \
  | tee "$out/suite.log"
suite=$?
left=$(( 570 - ($(date +%s) - start) ))
timeout "$left" python3 python/benches/serving_suite.py "${w[@]}" --profile "$profiled" --out "$out/profile" 2>&1 \
  | tee "$out/profile.log"
profile=$?
# Either part failing (or cut off by its timeout) fails the run.
[ "$suite" -eq 0 ] && [ "$profile" -eq 0 ]
