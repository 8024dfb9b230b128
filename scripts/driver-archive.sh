#!/usr/bin/env bash
# Debian's package archive as the driver checks use it: whatever it offers today, never a
# pinned version. apt runs on a private state (lists and downloads under $VMEM_APT_DIR,
# default /var/tmp/vmem-apt) with bookworm and trixie, their -updates, -security and
# -backports, main and contrib: the machine's own sources are not touched and nothing is
# installed (packages are downloaded and unpacked into a directory), so suites of two Debian
# releases can sit side by side.
#
#   scripts/driver-archive.sh newest PACKAGE [VERSION_PREFIX [SUITE...]]
#       prints "VERSION SUITE" of the newest PACKAGE whose version starts with VERSION_PREFIX
#       (in one of SUITEs, when given); exit 1 when there is none
#   scripts/driver-archive.sh versions PACKAGE      every "VERSION SUITE" on offer
#   scripts/driver-archive.sh download PACKAGE=VERSION DIR
#   scripts/driver-archive.sh kernel SUITE[,SUITE...] DIR
#       the newest amd64 kernel of those suites (e.g. bookworm,bookworm-updates,bookworm-security
#       for bookworm's own kernel, bookworm-backports for the newer one): unpacks its
#       headers (the -common and -amd64 trees and linux-kbuild, made usable where they lie)
#       and its vmlinuz under DIR, and prints "KVER VERSION COMMON_TREE FLAVOUR_TREE VMLINUZ"
#
# The lists are refreshed when older than an hour (VMEM_APT_REFRESH=1 forces it).
set -euo pipefail
state=${VMEM_APT_DIR:-/var/tmp/vmem-apt}
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
{
  # Kernels come from bookworm's suites (built with bookworm's gcc-12; trixie's need gcc-14
  # and a newer glibc than bookworm's), the driver sources from either release's contrib.
  for suite in bookworm bookworm-updates bookworm-backports; do
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main contrib"
  done
  echo "deb [signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main contrib"
  for suite in trixie trixie-updates trixie-backports; do
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite contrib"
  done
} > "$state/sources.list"
opts=(-o "Dir::Etc::sourcelist=$state/sources.list" -o Dir::Etc::sourceparts=-
      -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache"
      -o Dir::State::status=/dev/null -o APT::Sandbox::User=root -o Debug::NoLocking=1)

refresh() {
  if [ "${VMEM_APT_REFRESH:-0}" = 1 ] || [ -z "$(find "$state/updated" -mmin -60 2>/dev/null)" ]; then
    apt-get "${opts[@]}" update -qq >&2
    touch "$state/updated"
  fi
}

# "VERSION SUITE" lines for PACKAGE.
versions() {
  apt-cache "${opts[@]}" madison "$1" |
    awk -F' [|] ' -v p="$1" '{ gsub(/ /, "", $1); gsub(/ /, "", $2) }
      $1 == p { split($3, w, " "); split(w[2], s, "/"); print $2, s[1] }'
}

newest() {
  local pkg=$1 prefix=${2:-} best="" best_suite="" v s
  shift $(( $# < 2 ? $# : 2 ))
  while read -r v s; do
    [[ "$v" == "$prefix"* ]] || continue
    if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$s"; then continue; fi
    if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v; best_suite=$s; fi
  done < <(versions "$pkg")
  [ -n "$best" ] || return 1
  echo "$best $best_suite"
}

download() {
  mkdir -p "$2"
  (cd "$2" && apt-get "${opts[@]}" download -qq "$1" >&2)
}

# The package names in PACKAGE=VERSION's Depends line.
depends() {
  apt-cache "${opts[@]}" show "$1" | sed -n 's/^Depends: //p' | head -1 | tr ',|' '\n\n' |
    sed 's/^ *//; s/ .*//'
}

kernel() {
  local suites=$1 dir=$2 version kver deps common kbuild root deb
  read -r version _ < <(newest linux-headers-amd64 "" ${suites//,/ }) ||
    { echo "no linux-headers-amd64 in $suites" >&2; return 1; }
  kver=$(depends "linux-headers-amd64=$version" | sed -n 's/^linux-headers-//p' | head -1)
  [ -n "$kver" ] || { echo "linux-headers-amd64=$version names no headers package" >&2; return 1; }
  deps=$(depends "linux-headers-$kver=$version")
  common=$(echo "$deps" | grep -- '^linux-headers-.*-common$' | head -1)
  kbuild=$(echo "$deps" | grep -- '^linux-kbuild-' | head -1)
  [ -n "$common" ] && [ -n "$kbuild" ] || { echo "linux-headers-$kver: no -common or kbuild dependency" >&2; return 1; }
  mkdir -p "$dir/debs"
  download "linux-headers-$kver=$version" "$dir/debs"
  download "$common=$version" "$dir/debs"
  download "$kbuild=$(newest "$kbuild" | cut -d' ' -f1)" "$dir/debs"
  download "linux-image-$kver-unsigned=$version" "$dir/debs" 2>/dev/null ||
    download "linux-image-$kver=$version" "$dir/debs"
  root=$dir/root
  for deb in "$dir"/debs/linux-headers-*.deb "$dir"/debs/linux-kbuild-*.deb; do
    dpkg-deb -x "$deb" "$root"
  done
  dpkg-deb --fsys-tarfile "$dir"/debs/linux-image-*.deb | tar -C "$root" -x "./boot/vmlinuz-$kver"
  rm -rf "$dir/debs"
  # The flavour tree includes the -common tree's Makefile by absolute path; the scripts and
  # tools links are relative, so they already point into $root.
  sed -i "s|^include /usr/src/|include $root/usr/src/|" "$root/usr/src/linux-headers-$kver/Makefile"
  echo "$kver $version $root/usr/src/$common $root/usr/src/linux-headers-$kver $root/boot/vmlinuz-$kver"
}

cmd=${1:?usage: $0 newest|versions|download|kernel ...}
shift
refresh
case "$cmd" in
  newest) newest "$@" ;;
  versions) versions "${1:?package}" ;;
  download) download "${1:?PACKAGE=VERSION}" "${2:?directory}" ;;
  kernel) kernel "${1:?suite}" "${2:?directory}" ;;
  *) echo "usage: $0 newest|versions|download|kernel ..." >&2; exit 2 ;;
esac
