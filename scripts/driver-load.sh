#!/usr/bin/env bash
# Replaces the loaded nvidia-uvm module with the patched one built in TREE. The rest of the
# driver (nvidia.ko) must be the same version as TREE. Stops nothing else: close CUDA
# programs first (nvidia-uvm cannot be removed while in use).
#   sudo scripts/driver-load.sh TREE
set -euo pipefail
tree=${1:?kernel-open tree}
ko="$tree/nvidia-uvm.ko"
[ -f "$ko" ] || { echo "$ko not built (scripts/driver-build.sh $tree)" >&2; exit 1; }
loaded=$(cat /sys/module/nvidia/version 2>/dev/null || echo none)
built=$(modinfo -F version "$ko")
if [ "$loaded" != "$built" ]; then
  echo "loaded nvidia.ko is $loaded but $ko is $built: install the matching driver first" >&2
  exit 1
fi
if [ "$(cat /proc/sys/kernel/modules_disabled 2>/dev/null || echo 0)" = 1 ]; then
  echo "module loading is disabled on this machine (kernel.modules_disabled=1)" >&2
  exit 1
fi
if lsmod | grep -q '^nvidia_uvm'; then rmmod nvidia_uvm; fi
insmod "$ko"
echo "loaded $ko ($built)"
