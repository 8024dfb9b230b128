#!/usr/bin/env bash
# CI compile check of the vMem patch series against Debian's packaged driver sources
# (nvidia-open-kernel-source 535.261.03 from bookworm and 550.163.01 from trixie, contrib) and
# bookworm's kernel headers. For each version: apply the series with no fuzz, check that the
# files it adds are exactly driver-patch/src + include, build nvidia + nvidia-uvm, and require
#   - every nvidia-uvm object built and nvidia-uvm.o linked, with no warning or error naming an
#     nvidia-uvm file (nvidia/nv-pci.c fails against 6.1 in NVIDIA's own code: make's exit
#     status is therefore not used; see shared/docs/driver-build.md),
#   - every symbol uvm_vmem.o uses resolved by the kernel's exports or nvidia-uvm itself,
#   - no sparse warning in the nvidia-uvm files the series adds or changes,
#   - the module loaded for real: scripts/driver-vm-test.sh boots Debian's kernel under QEMU
#     with the patched nvidia-uvm.ko and a generated stub nvidia.ko, runs uvm-ioctl's
#     vm_check, unloads, and checks the kernel log.
# Then: the committed series is what scripts/gen-driver-patches.sh makes from the sources, and
# checkpatch.pl (from Debian's linux-source-6.1) reports nothing in our files.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
log() { printf '[driver-check %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }
fail() { echo "DRIVER CHECK FAILED: $*" >&2; exit 1; }

log "installing kernel headers, sparse and build tools"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq linux-headers-amd64 sparse make gcc patch xz-utils git >/dev/null
common=$(ls -d /usr/src/linux-headers-*-common | sort -V | tail -1)
flavour=${common%-common}-amd64
[ -d "$flavour" ] || fail "no $flavour"
log "headers: $common + $flavour"

log "fetching checkpatch.pl from Debian's linux-source-6.1"
(cd "$work" && apt-get download -qq linux-source-6.1)
dpkg-deb --fsys-tarfile "$work"/linux-source-6.1_*.deb | tar -C "$work" -x ./usr/src/linux-source-6.1.tar.xz
tar -C "$work" -xJf "$work/usr/src/linux-source-6.1.tar.xz" \
  linux-source-6.1/scripts/checkpatch.pl linux-source-6.1/scripts/spelling.txt \
  linux-source-6.1/scripts/const_structs.checkpatch
checkpatch="$work/linux-source-6.1/scripts/checkpatch.pl"
rm -rf "$work/usr" "$work"/linux-source-6.1_*.deb

mk() {
  make -C "$1" -k -j"$(nproc)" modules SYSSRC="$common" SYSOUT="$flavour" \
    NV_KERNEL_MODULES="nvidia nvidia-uvm" "${@:2}"
}

for v in 535 550; do
  log "== $v: fetching Debian's nvidia-open-kernel-source"
  tree=$("$root/scripts/driver-source.sh" debian "$v" "$work/$v")
  [ "$v" = 535 ] && cp -r "$tree" "$work/pristine-535"
  log "$v: applying the series (no fuzz)"
  "$root/scripts/driver-apply.sh" "$tree" | sed 's/^/    /'
  for f in src/uvm_vmem.c src/uvm_vmem.h src/uvm_vmem_check.h include/uvm_vmem_ioctl.h; do
    cmp -s "$root/driver-patch/$f" "$tree/nvidia-uvm/$(basename "$f")" ||
      fail "$v: the series' $(basename "$f") differs from driver-patch/$f (run scripts/gen-driver-patches.sh)"
  done
  log "$v: building nvidia + nvidia-uvm"
  mk "$tree" > "$work/build-$v.log" 2>&1 || true
  [ -f "$tree/nvidia-uvm.o" ] || { tail -40 "$work/build-$v.log"; fail "$v: nvidia-uvm.o was not linked"; }
  [ -f "$tree/nvidia-uvm/uvm_vmem.o" ] || fail "$v: uvm_vmem.o was not built"
  built=$(grep -c 'CC \[M\].*/nvidia-uvm/' "$work/build-$v.log" || true)
  if grep -E '/nvidia-uvm/[^ ]*:[0-9]+:[0-9]+: (warning|error)' "$work/build-$v.log"; then
    fail "$v: compiler warnings or errors in nvidia-uvm"
  fi
  log "$v: $built nvidia-uvm objects compiled, nvidia-uvm.o linked, no warning or error in nvidia-uvm"
  { awk '{print $2}' "$flavour/Module.symvers"; nm --defined-only "$tree/nvidia-uvm.o" | awk '{print $3}'; } |
    sort -u > "$work/provided"
  nm -u "$tree/nvidia-uvm/uvm_vmem.o" | awk '{print $2}' | sort -u > "$work/used"
  comm -23 "$work/used" "$work/provided" > "$work/missing"
  sed 's/^/    unresolved: /' "$work/missing"
  missing=$(wc -l < "$work/missing")
  [ "$missing" = 0 ] || fail "$v: uvm_vmem.o uses symbols nothing provides"
  log "$v: every symbol uvm_vmem.o uses is provided"
  # uvm_va_range.c (4 lines of ours) is left out: NVIDIA's own code there has sparse
  # warnings (a plain 0 as a NULL pointer), which are not ours to fix.
  touch "$tree"/nvidia-uvm/{uvm_vmem.c,uvm.c,uvm_va_space.c}
  mk "$tree" C=1 CHECK=sparse > "$work/sparse-$v.log" 2>&1 || true
  [ "$(grep -c '  CHECK .*nvidia-uvm/' "$work/sparse-$v.log")" = 3 ] || fail "$v: sparse did not run on the 3 files"
  if grep -E '/nvidia-uvm/(uvm_vmem|uvm_vmem_check|uvm|uvm_va_space)\.[ch]:[0-9]+' "$work/sparse-$v.log"; then
    fail "$v: sparse warnings"
  fi
  log "$v: sparse: no warnings in uvm_vmem.c (and the headers it includes), uvm.c, uvm_va_space.c"
  log "$v: loading the module in a VM"
  "$root/scripts/driver-vm-test.sh" "$tree" 2>&1 | sed 's/^/    /' || fail "$v: the VM test failed"
done

log "checking that the committed series is generated from the sources"
"$root/scripts/gen-driver-patches.sh" "$work/pristine-535" "$work/regen" > /dev/null
diff -r "$work/regen" "$root/driver-patch/patches" || fail "driver-patch/patches is stale: run scripts/gen-driver-patches.sh"

# UVM's conventions, not ours: NvU64-style CamelCase types and *_PARAMS typedefs (the ioctl
# routing macro needs cmd##_PARAMS type names); stdint types and 1ull << n in the uapi
# header, which user space also compiles.
log "checkpatch.pl --strict on our files"
(cd "$work" && "$checkpatch" --no-tree --strict --quiet --ignore NEW_TYPEDEFS,CAMELCASE,PREFER_KERNEL_TYPES,BIT_MACRO \
  -f "$root"/driver-patch/src/uvm_vmem.c "$root"/driver-patch/src/uvm_vmem.h \
  "$root"/driver-patch/src/uvm_vmem_check.h \
  "$root"/driver-patch/include/uvm_vmem_ioctl.h) || fail "checkpatch reports problems"
log "driver patch: all checks passed in $(( $(date +%s) - start )) s"
