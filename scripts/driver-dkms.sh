#!/usr/bin/env bash
# Registers a patched kernel-open tree with DKMS, so the vMem nvidia-uvm is rebuilt for new
# kernels. VERSION must be the installed NVIDIA driver's version (e.g. 580.159.04).
#   sudo scripts/driver-dkms.sh TREE VERSION
set -euo pipefail
tree=${1:?patched kernel-open tree}; version=${2:?driver version}
root=$(cd "$(dirname "$0")/.." && pwd)
command -v dkms >/dev/null || { echo "install dkms first" >&2; exit 1; }
dest=/usr/src/nvidia-uvm-vmem-$version
rm -rf "$dest"
cp -r "$tree" "$dest"
sed "s/@VERSION@/$version/" "$root/driver-patch/dkms/dkms.conf.in" > "$dest/dkms.conf"
dkms add -m nvidia-uvm-vmem -v "$version"
dkms build -m nvidia-uvm-vmem -v "$version"
dkms install -m nvidia-uvm-vmem -v "$version"
