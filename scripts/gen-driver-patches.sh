#!/usr/bin/env bash
# Regenerates driver-patch/patches/ from driver-patch/src/ and driver-patch/include/ against a
# pristine kernel-open tree (by default Debian's newest 535, fetched with driver-source.sh).
# Patch 0001 adds our files (their content comes from src/ and include/); patch 0002 holds the
# hooks into NVIDIA's files and is edited by hand. Output is reproducible (fixed dates, zero
# commit ids), so CI can check that the committed series matches the sources.
#   scripts/gen-driver-patches.sh [PRISTINE_TREE] [OUT_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pristine=${1:-}
if [ -z "$pristine" ]; then
  pristine=$("$root/scripts/driver-source.sh" debian 535 "$work/src")
fi
out=${2:-$root/driver-patch/patches}
export GIT_AUTHOR_NAME="vmem authors" GIT_AUTHOR_EMAIL="vmem@invalid"
export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
export GIT_AUTHOR_DATE="2026-11-22T00:00:00Z" GIT_COMMITTER_DATE="2026-11-22T00:00:00Z"
mkdir -p "$work/repo"
cp -r "$pristine" "$work/repo/kernel-open"
cd "$work/repo"
git init -q && git add -A && git commit -qm base
mapfile -t series < "$root/driver-patch/patches/series"
git am -q "$root/driver-patch/patches/${series[0]}"
cp "$root"/driver-patch/src/*.[ch] \
   "$root/driver-patch/include/uvm_vmem_ioctl.h" kernel-open/nvidia-uvm/
git add kernel-open/nvidia-uvm && git commit -q --amend --no-edit --date="$GIT_AUTHOR_DATE"
for p in "${series[@]:1}"; do
  git am -q "$root/driver-patch/patches/$p"
  git commit -q --amend --no-edit --date="$GIT_AUTHOR_DATE"
done
mkdir -p "$out"
rm -f "$out"/*.patch
git format-patch -q -U2 --zero-commit --no-signature -"${#series[@]}" -o "$out"
(cd "$out" && ls *.patch > series)
echo "wrote $out"
