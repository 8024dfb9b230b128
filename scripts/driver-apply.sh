#!/usr/bin/env bash
# Applies the vMem patch series to a kernel-open source tree (the directory holding
# nvidia-uvm/), with no fuzz. The patches are made against upstream's kernel-open/, hence -p2.
#   scripts/driver-apply.sh TREE
set -euo pipefail
tree=${1:?kernel-open tree}
series_dir=$(cd "$(dirname "$0")/../driver-patch/patches" && pwd)
while read -r p; do
  [ -z "$p" ] && continue
  echo "applying $p"
  patch -d "$tree" -p2 -F0 -N --no-backup-if-mismatch < "$series_dir/$p"
done < "$series_dir/series"
