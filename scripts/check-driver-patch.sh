#!/usr/bin/env bash
# CI check of the vMem patch series on what Debian's archive offers today (nothing is pinned:
# the next point release is picked up with no change here, and every version is logged):
#   - driver sources: the newest nvidia-open-kernel-source of each branch in BRANCHES
#     (bookworm's or trixie's suites, contrib; scripts/driver-source.sh);
#   - kernels: the newest amd64 headers and image of each suite set in KERNELS
#     (scripts/driver-archive.sh kernel; unpacked, not installed): bookworm's own (6.1) and
#     bookworm-backports' (6.12 today: trixie's kernel series, built with bookworm's gcc-12;
#     trixie's own 6.12 headers need gcc-14 and a newer glibc than bookworm has).
# For each pair in COMBOS (BRANCH@KERNEL): apply the series with no fuzz, check that the files
# it adds are exactly driver-patch/src + include, build nvidia + nvidia-uvm, and require
#   - every nvidia-uvm object built and nvidia-uvm.o linked, with no warning or error naming an
#     nvidia-uvm file (nvidia/nv-pci.c fails against 6.1 in NVIDIA's own code: make's exit
#     status is therefore not used; see shared/docs/driver-build.md),
#   - every symbol uvm_vmem.o uses resolved by the kernel's exports or nvidia-uvm itself,
#   - no sparse warning in the nvidia-uvm files the series adds or changes,
#   - the module loaded for real: scripts/driver-vm-test.sh boots that kernel's image under
#     QEMU with the patched nvidia-uvm.ko and a generated stub nvidia.ko, runs uvm-ioctl's
#     vm_check, unloads, and checks the kernel log.
# Then: the committed series is what scripts/gen-driver-patches.sh makes from the sources, and
# checkpatch.pl (from Debian's linux-source-6.1) reports nothing in our files.
#
# Environment (defaults are what CI runs):
#   BRANCHES="535 550"   COMBOS="535@bookworm 550@bookworm 550@backports"
#   KERNELS="bookworm=bookworm,bookworm-updates,bookworm-security backports=bookworm-backports"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
log() { printf '[driver-check %4ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }
fail() { echo "DRIVER CHECK FAILED: $*" >&2; exit 1; }
archive="$root/scripts/driver-archive.sh"
BRANCHES=${BRANCHES:-535 550}
KERNELS=${KERNELS:-bookworm=bookworm,bookworm-updates,bookworm-security backports=bookworm-backports}
COMBOS=${COMBOS:-535@bookworm 550@bookworm 550@backports}

log "installing sparse and build tools"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq sparse make gcc patch xz-utils git pahole >/dev/null
log "refreshing the private Debian package lists (scripts/driver-archive.sh)"
VMEM_APT_REFRESH=1 "$archive" versions nvidia-open-kernel-source > "$work/offered"
sed 's/^/    nvidia-open-kernel-source /' "$work/offered"
others=$(awk '{ split($1, v, "."); print v[1] }' "$work/offered" | sort -u | grep -vxF -f <(tr ' ' '\n' <<< "$BRANCHES") || true)
[ -z "$others" ] || log "the archive also offers branch(es) $(echo $others), not checked (add to BRANCHES)"

declare -A common flavour vmlinuz kname_ver
for spec in $KERNELS; do
  name=${spec%%=*}
  log "kernel $name: newest linux-headers-amd64 and image of ${spec#*=}"
  read -r kver kversion c f z < <("$archive" kernel "${spec#*=}" "$work/kernel-$name") ||
    fail "no kernel from ${spec#*=}"
  common[$name]=$c; flavour[$name]=$f; vmlinuz[$name]=$z; kname_ver[$name]="$kver ($kversion)"
  log "kernel $name: $kver, package version $kversion"
done

declare -A source_version upstream_version
for v in $BRANCHES; do
  log "== $v: fetching Debian's newest nvidia-open-kernel-source $v.x"
  tree=$("$root/scripts/driver-source.sh" debian "$v" "$work/src-$v")
  source_version[$v]=$(cat "$work/src-$v/source-version")
  read -r _ pkgver _ < "$work/src-$v/source-version"
  upstream_version[$v]=${pkgver%%-*}
  log "$v: ${source_version[$v]}"
done

log "fetching checkpatch.pl from Debian's linux-source-6.1"
(cd "$work" && apt-get download -qq linux-source-6.1)
dpkg-deb --fsys-tarfile "$work"/linux-source-6.1_*.deb | tar -C "$work" -x ./usr/src/linux-source-6.1.tar.xz
tar -C "$work" -xJf "$work/usr/src/linux-source-6.1.tar.xz" \
  linux-source-6.1/scripts/checkpatch.pl linux-source-6.1/scripts/spelling.txt \
  linux-source-6.1/scripts/const_structs.checkpatch
checkpatch="$work/linux-source-6.1/scripts/checkpatch.pl"
rm -rf "$work/usr" "$work"/linux-source-6.1_*.deb

proven=()
for combo in $COMBOS; do
  v=${combo%@*}; k=${combo#*@}
  [ -n "${source_version[$v]:-}" ] || fail "$combo: branch $v is not in BRANCHES"
  [ -n "${common[$k]:-}" ] || fail "$combo: kernel $k is not in KERNELS"
  c=${common[$k]}; f=${flavour[$k]}
  mk() {
    make -C "$1" -k -j"$(nproc)" modules SYSSRC="$c" SYSOUT="$f" \
      NV_KERNEL_MODULES="nvidia nvidia-uvm" "${@:2}"
  }
  log "== $combo: ${source_version[$v]} on ${kname_ver[$k]}"
  tree="$work/$v-$k/nvidia-open-kernel"
  mkdir -p "$work/$v-$k"
  cp -r "$work/src-$v/modules/nvidia-open-kernel" "$tree"
  log "$combo: applying the series (no fuzz)"
  "$root/scripts/driver-apply.sh" "$tree" | sed 's/^/    /'
  for file in src/uvm_vmem.c src/uvm_vmem.h src/uvm_vmem_check.h include/uvm_vmem_ioctl.h; do
    cmp -s "$root/driver-patch/$file" "$tree/nvidia-uvm/$(basename "$file")" ||
      fail "$combo: the series' $(basename "$file") differs from driver-patch/$file (run scripts/gen-driver-patches.sh)"
  done
  log "$combo: building nvidia + nvidia-uvm"
  mk "$tree" > "$work/build-$combo.log" 2>&1 || true
  [ -f "$tree/nvidia-uvm.o" ] || { tail -40 "$work/build-$combo.log"; fail "$combo: nvidia-uvm.o was not linked"; }
  [ -f "$tree/nvidia-uvm/uvm_vmem.o" ] || fail "$combo: uvm_vmem.o was not built"
  built=$(grep -c 'CC \[M\].*/nvidia-uvm/' "$work/build-$combo.log" || true)
  if grep -E '/nvidia-uvm/[^ ]*:[0-9]+:[0-9]+: (warning|error)' "$work/build-$combo.log"; then
    fail "$combo: compiler warnings or errors in nvidia-uvm"
  fi
  log "$combo: $built nvidia-uvm objects compiled, nvidia-uvm.o linked, no warning or error in nvidia-uvm"
  { awk '{print $2}' "$f/Module.symvers"; nm --defined-only "$tree/nvidia-uvm.o" | awk '{print $3}'; } |
    sort -u > "$work/provided"
  nm -u "$tree/nvidia-uvm/uvm_vmem.o" | awk '{print $2}' | sort -u > "$work/used"
  comm -23 "$work/used" "$work/provided" > "$work/missing"
  sed 's/^/    unresolved: /' "$work/missing"
  [ "$(wc -l < "$work/missing")" = 0 ] || fail "$combo: uvm_vmem.o uses symbols nothing provides"
  log "$combo: every symbol uvm_vmem.o uses is provided"
  # uvm_va_range.c (4 lines of ours) is left out: NVIDIA's own code there has sparse
  # warnings (a plain 0 as a NULL pointer), which are not ours to fix.
  touch "$tree"/nvidia-uvm/{uvm_vmem.c,uvm.c,uvm_va_space.c}
  mk "$tree" C=1 CHECK=sparse > "$work/sparse-$combo.log" 2>&1 || true
  [ "$(grep -c '  CHECK .*nvidia-uvm/' "$work/sparse-$combo.log")" = 3 ] || fail "$combo: sparse did not run on the 3 files"
  if grep -E '/nvidia-uvm/(uvm_vmem|uvm_vmem_check|uvm_vmem_ioctl|uvm|uvm_va_space)\.[ch]:[0-9]+' "$work/sparse-$combo.log"; then
    fail "$combo: sparse warnings"
  fi
  log "$combo: sparse: no warnings in uvm_vmem.c (and the headers it includes), uvm.c, uvm_va_space.c"
  log "$combo: loading the module in a VM"
  "$root/scripts/driver-vm-test.sh" "$tree" "$c" "$f" "${vmlinuz[$k]}" 2>&1 | sed 's/^/    /' ||
    fail "$combo: the VM test failed"
  "$root/scripts/driver-dkms.sh" --render "$tree" "${upstream_version[$v]}" "$work/dkms-$combo" | sed 's/^/    /' ||
    fail "$combo: packaging/dkms/dkms.conf.in does not render"
  proven+=("${source_version[$v]} on linux ${kname_ver[$k]}")
  rm -rf "$work/$v-$k"
done

log "checking that the committed series is generated from the sources"
first=${BRANCHES%% *}
"$root/scripts/gen-driver-patches.sh" "$work/src-$first/modules/nvidia-open-kernel" "$work/regen" > /dev/null
diff -r "$work/regen" "$root/driver-patch/patches" || fail "driver-patch/patches is stale: run scripts/gen-driver-patches.sh"

# UVM's conventions, not ours: NvU64-style CamelCase types and *_PARAMS typedefs (the ioctl
# routing macro needs cmd##_PARAMS type names); stdint types and 1ull << n in the uapi
# header, which user space also compiles.
log "checkpatch.pl --strict on our files"
(cd "$work" && "$checkpatch" --no-tree --strict --quiet --ignore NEW_TYPEDEFS,CAMELCASE,PREFER_KERNEL_TYPES,BIT_MACRO \
  -f "$root"/driver-patch/src/uvm_vmem.c "$root"/driver-patch/src/uvm_vmem.h \
  "$root"/driver-patch/src/uvm_vmem_check.h \
  "$root"/driver-patch/include/uvm_vmem_ioctl.h) || fail "checkpatch reports problems"
log "proven (applied, compiled, sparse, VM-loaded):"
for p in "${proven[@]}"; do log "  $p"; done
log "driver patch: all checks passed in $(( $(date +%s) - start )) s"
