#!/usr/bin/env bash
# GPU checks and measurements of the serving work, in four parts of under 10 minutes each; run
# them in this order, since a FAIL in `check` says whether to trust the numbers of the others.
# Needs a CUDA GPU with torch and a served transformers, vmem's wheel in .whl/, and for check,
# suite and profile FlashInfer 0.6.x's wheels (flashinfer-python, apache-tvm-ffi) in .carry/fi/.
#
#   on a build machine:  scripts/python-gpu.sh build    # vmem's abi3 wheel into .whl/
#   on the GPU machine:  scripts/gpu-pending.sh check|suite|tenants|profile
#
#   check    test_gpu.py (FlashInfer over rows included); graphs_check.py with kernel fa and
#            flashinfer, graphs off/on/async: top-1 agreement with the engine and with FA, tok/s
#   suite    serving_suite.py, Llama-3-8B shapes x 8, conv trace: fi-paged-graphs beside vmem with
#            FA + graphs and with FlashInfer + graphs
#   tenants  multitenant_bench.py, bursty mix at 1536M: static, pool and pool-floor (1/6 each),
#            idle release on by default; TENANT_MODES replaces
#            the --floor flag (TENANT_MODES="--modes static,pool,pool-keep --keep 128M"),
#            TENANT_SCENARIOS the scenarios (default bursty), TENANT_TIMEOUT its seconds (540)
#   profile  serving_suite.py --profile, 8B-x8, conv trace, memory-bound (tenth): per engine round
#            its wall time, loop parts, sequences and the kernels' share, for each of
#            PROFILE_CONTENDERS (spaces or commas; default the engine's best native, fi-paged and
#            vmem, all with graphs), 540 s shared between them
#
# SUITE_CONTENDERS replaces the suite's contenders, GRAPHS_KERNELS the check's kernels (fa,flashinfer),
# GRAPHS_TIMEOUT its seconds (330; 0 skips it), CHECK_TIMEOUT and SUITE_TIMEOUT the pytest and suite ones
# (150, 520: lower them to run two parts within 10 minutes), EXTRA_WHEELS more wheels to install (another transformers).
# Results go to $VMEM_BENCH_OUT/<part>/ (default /tmp/vmem-gpu-pending/<part>/), packed into
# $VMEM_BENCH_OUT/<part>.tgz.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
part=${1:-}
out=${VMEM_BENCH_OUT:-/tmp/vmem-gpu-pending}/$part
case "$part" in check|suite|tenants|profile) ;; *) echo "usage: $0 check|suite|tenants|profile" >&2; exit 2 ;; esac
[ -n "$(ls .whl/vmem*.whl 2>/dev/null)" ] || { echo "$0: no .whl/vmem*.whl (build it with scripts/python-gpu.sh build and copy .whl/ here)" >&2; exit 2; }
mkdir -p "$out"

. "$root/scripts/gpu-env.sh"
wheels=(.whl/vmem*.whl)
[ "$part" = tenants ] || wheels+=(.carry/fi/*.whl)
# EXTRA_WHEELS: more wheels for the site, e.g. another transformers:
# EXTRA_WHEELS=.carry/tf523/transformers-5.23.0-py3-none-any.whl runs the part on 5.23.
wheels+=(${EXTRA_WHEELS:-})
gpu_site /tmp/site-pending "${wheels[@]}" || exit 1
export FLASHINFER_WORKSPACE_BASE=/tmp/fi
python3 -c "import vmem, vmem.transformers, transformers; print('vmem ok; transformers', transformers.__version__)" || exit 1
gpu_name | tee "$out/nvidia-smi.txt"

rc=0
case "$part" in
  check)
    # From the root: in python/, `import vmem` would find the sources without the built module.
    # GPU_TESTS: a pytest -k expression (the FlashInfer tests only: GPU_TESTS=flashinfer);
    # GPU_PYTEST_FLAGS: more pytest flags (-s shows what the checks print: timings, PASS lines)
    timeout ${CHECK_TIMEOUT:-150} python3 -m pytest -q -rs ${GPU_PYTEST_FLAGS:-} -p no:cacheprovider python/tests/test_gpu.py \
      ${GPU_TESTS:+-k "$GPU_TESTS"} 2>&1 \
      | tee "$out/test_gpu.txt" || rc=1
    [ "${GRAPHS_TIMEOUT:-330}" = 0 ] || (cd python && PYTHONPATH=benches:$PYTHONPATH timeout ${GRAPHS_TIMEOUT:-330} \
      python3 benches/graphs_check.py --kernels "${GRAPHS_KERNELS:-fa,flashinfer}" --skip-small --bench-requests 48 \
      --new-tokens 96 --repeats 2) 2>&1 | tee "$out/graphs_check.txt" || rc=1
    ;;
  suite)
    timeout ${SUITE_TIMEOUT:-520} python3 python/benches/serving_suite.py --only model=llama3-8b-x8 --only trace=conv \
      --only contender="${SUITE_CONTENDERS:-paged-sdpa-256-graphs,fi-paged-graphs,vmem-token-major-graphs,vmem-token-major-fi-graphs,vmem-token-major-fi-graphs-async,vmem-per-layer-fi-graphs}" \
      --requests 64 --new-tokens 48 ${SUITE_FLAGS:-} --out "$out/suite" 2>&1 | tee "$out/log.txt" || rc=1
    ;;
  tenants)
    timeout "${TENANT_TIMEOUT:-540}" python3 python/benches/multitenant_bench.py --keep-going --total 1536M \
      --scenarios "${TENANT_SCENARIOS:-bursty}" ${TENANT_MODES:---floor 1/6} --out "$out/multitenant" 2>&1 \
      | tee "$out/log.txt" || rc=1
    ;;
  profile)
    # Names separated by spaces or commas; the call's 540 s shared between them.
    pc=${PROFILE_CONTENDERS:-}
    names=(${pc//,/ })
    [ ${#names[@]} -gt 0 ] || names=(paged-sdpa-256-graphs fi-paged-graphs vmem-token-major-graphs)
    for c in "${names[@]}"; do
      timeout $((540 / ${#names[@]})) python3 python/benches/serving_suite.py --profile "$c" --only model=llama3-8b-x8 --only trace=conv \
        --only budget=tenth --requests 64 --new-tokens 48 --out "$out/$c" 2>&1 | tail -40 | tee "$out/$c.log" || rc=1
    done
    ;;
esac
(cd "$out/.." && tar czf "$part.tgz" "$part" && rm -rf "$part")
exit $rc
