#!/usr/bin/env bash
# Builds nvidia.ko and nvidia-uvm.ko from a (patched) kernel-open tree for the running kernel,
# or KVER. Extra make arguments pass through (e.g. C=1 CHECK=sparse).
#   scripts/driver-build.sh TREE [make args...]
set -euo pipefail
tree=${1:?kernel-open tree}; shift
kver=${KVER:-$(uname -r)}
out=/lib/modules/$kver/build
src=$out
# Debian splits the headers: the -common tree holds the sources, the flavour tree the config.
if [ -f "$out/Makefile" ] && grep -q "^include.*-common" "$out/Makefile" 2>/dev/null; then
  src=$(sed -n 's|^include \(.*\)/Makefile|\1|p' "$out/Makefile" | head -1)
fi
make -C "$tree" -j"$(nproc)" modules SYSSRC="${SYSSRC:-$src}" SYSOUT="${SYSOUT:-$out}" \
  NV_KERNEL_MODULES="nvidia nvidia-uvm" "$@"
