#!/usr/bin/env bash
# Registers a patched kernel-open tree with DKMS, so the vMem nvidia-uvm is rebuilt for new
# kernels, from packaging/dkms/dkms.conf.in. VERSION must be the installed NVIDIA driver's
# version (e.g. 580.159.04).
#   sudo scripts/driver-dkms.sh TREE VERSION           # add, build and install
#   scripts/driver-dkms.sh --render TREE VERSION DIR   # only write and check DIR/dkms.conf
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
render_only=0
if [ "${1:-}" = --render ]; then render_only=1; shift; fi
tree=${1:?patched kernel-open tree}; version=${2:?driver version}
[[ "$version" =~ ^[0-9]+(\.[0-9]+)+$ ]] || { echo "VERSION must look like 580.159.04, not '$version'" >&2; exit 2; }
[ -f "$tree/nvidia-uvm/uvm_vmem.c" ] || { echo "$tree is not a kernel-open tree with the vMem series applied (scripts/driver-apply.sh)" >&2; exit 2; }

# Writes DIR/dkms.conf and checks it as DKMS reads it (a bash fragment).
render() {
  mkdir -p "$1"
  sed "s/@VERSION@/$version/" "$root/packaging/dkms/dkms.conf.in" > "$1/dkms.conf"
  (
    set +u
    kernelver=$(uname -r)
    # shellcheck disable=SC1091
    . "$1/dkms.conf"
    [ "$PACKAGE_NAME" = nvidia-uvm-vmem ] && [ "$PACKAGE_VERSION" = "$version" ] &&
      [ "${BUILT_MODULE_NAME[0]}" = nvidia-uvm ] && [[ "${MAKE[0]}" == *nvidia-uvm* ]]
  ) || { echo "$1/dkms.conf does not read as expected" >&2; exit 1; }
}

if [ "$render_only" = 1 ]; then
  render "${3:?output directory}"
  echo "wrote $3/dkms.conf (nvidia-uvm-vmem $version)"
  exit 0
fi
command -v dkms >/dev/null || { echo "install dkms first" >&2; exit 1; }
dest=/usr/src/nvidia-uvm-vmem-$version
# A second run replaces the first: DKMS must forget the old copy before it goes.
dkms remove -m nvidia-uvm-vmem -v "$version" --all >/dev/null 2>&1 || true
rm -rf "$dest"
cp -r "$tree" "$dest"
render "$dest"
dkms add -m nvidia-uvm-vmem -v "$version"
dkms build -m nvidia-uvm-vmem -v "$version"
dkms install -m nvidia-uvm-vmem -v "$version"
