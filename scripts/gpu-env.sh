# Sourced by the scripts that run on the GPU machine (scripts/gpu-pending.sh,
# scripts/python-gpu.sh, python/benches/*_gpu_run.sh): wheels built elsewhere installed into a
# site directory of the script's own, and the GPU named.
#
#   gpu_site SITE WHEEL...   installs the wheels into SITE, replacing what is there (--upgrade: an
#                            earlier run may have left another build, which pip --target would keep),
#                            and points Python at it (PYTHONPATH=SITE, unbuffered output)
#   gpu_name                 the GPU's name, driver and memory as CSV (nvidia-smi)

gpu_site() {
  local site=$1
  shift
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$site" "$@" || return 1
  export PYTHONPATH=$site PYTHONUNBUFFERED=1
}

gpu_name() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
}
