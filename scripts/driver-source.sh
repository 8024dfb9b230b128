#!/usr/bin/env bash
# Fetches an nvidia-open-kernel source tree (the layout of upstream's kernel-open/: Kbuild,
# Makefile, nvidia/, nvidia-uvm/ ...) into DIR and prints its path. DIR/source-version then
# names what was fetched (package, version, suite or tag).
#
#   scripts/driver-source.sh debian BRANCH DIR     # the newest nvidia-open-kernel-source of
#                                                  # BRANCH (535, 550, ...) Debian offers, in
#                                                  # any of bookworm's or trixie's suites
#                                                  # (scripts/driver-archive.sh; contrib)
#   scripts/driver-source.sh upstream TAG DIR      # github.com/NVIDIA/open-gpu-kernel-modules
#                                                  # release TAG, e.g. 580.159.04 (needs internet)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kind=${1:?debian|upstream}; version=${2:?version}; dir=${3:?directory}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
case "$kind" in
  debian)
    branch=${version%%.*}
    if ! read -r pkg suite < <("$root/scripts/driver-archive.sh" newest nvidia-open-kernel-source "$branch."); then
      echo "Debian offers no nvidia-open-kernel-source $branch.x; it has:" >&2
      "$root/scripts/driver-archive.sh" versions nvidia-open-kernel-source >&2
      exit 2
    fi
    "$root/scripts/driver-archive.sh" download "nvidia-open-kernel-source=$pkg" "$dir/deb-file"
    dpkg-deb -x "$dir"/deb-file/nvidia-open-kernel-source_*.deb "$dir/deb"
    tar -C "$dir" -xf "$dir/deb/usr/src/nvidia-open-kernel.tar.xz"
    rm -rf "$dir/deb" "$dir/deb-file"
    echo "nvidia-open-kernel-source $pkg ($suite)" > "$dir/source-version"
    echo "$dir/modules/nvidia-open-kernel"
    ;;
  upstream)
    url="https://github.com/NVIDIA/open-gpu-kernel-modules/archive/refs/tags/$version.tar.gz"
    curl -fsSL "$url" | tar -C "$dir" -xz
    echo "open-gpu-kernel-modules $version (upstream tag)" > "$dir/source-version"
    echo "$dir/open-gpu-kernel-modules-$version/kernel-open"
    ;;
  *) echo "usage: $0 debian|upstream VERSION DIR" >&2; exit 2 ;;
esac
