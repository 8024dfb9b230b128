#!/usr/bin/env bash
# Fetches an nvidia-open-kernel source tree (the layout of upstream's kernel-open/: Kbuild,
# Makefile, nvidia/, nvidia-uvm/ ...) into DIR and prints its path.
#
#   scripts/driver-source.sh debian 535|550 DIR   # Debian's nvidia-open-kernel-source
#                                                  # (535.261.03 bookworm, 550.163.01 trixie; contrib)
#   scripts/driver-source.sh upstream TAG DIR      # github.com/NVIDIA/open-gpu-kernel-modules
#                                                  # release TAG, e.g. 580.159.04 (needs internet)
set -euo pipefail
kind=${1:?debian|upstream}; version=${2:?version}; dir=${3:?directory}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
case "$kind" in
  debian)
    case "$version" in
      535*) suite=bookworm; pkg=535.261.03-1 ;;
      550*) suite=trixie; pkg=550.163.01-2 ;;
      *) echo "Debian ships 535 (bookworm) and 550 (trixie)" >&2; exit 2 ;;
    esac
    # contrib is not enabled by default: add it for this download only.
    list=/etc/apt/sources.list.d/vmem-contrib-$suite.sources
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: contrib\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$suite" > "$list"
    trap 'rm -f "$list"' EXIT
    apt-get update -qq -o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 >&2
    (cd "$dir" && apt-get download -qq "nvidia-open-kernel-source=$pkg" >&2)
    dpkg-deb -x "$dir"/nvidia-open-kernel-source_"$pkg"_amd64.deb "$dir/deb"
    tar -C "$dir" -xf "$dir/deb/usr/src/nvidia-open-kernel.tar.xz"
    rm -rf "$dir/deb" "$dir"/nvidia-open-kernel-source_*.deb
    echo "$dir/modules/nvidia-open-kernel"
    ;;
  upstream)
    url="https://github.com/NVIDIA/open-gpu-kernel-modules/archive/refs/tags/$version.tar.gz"
    curl -fsSL "$url" | tar -C "$dir" -xz
    echo "$dir/open-gpu-kernel-modules-$version/kernel-open"
    ;;
  *) echo "usage: $0 debian|upstream VERSION DIR" >&2; exit 2 ;;
esac
