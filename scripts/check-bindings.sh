#!/usr/bin/env bash
# CI: the committed uvm-ioctl bindings are what bindgen makes from the uapi header.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export DEBIAN_FRONTEND=noninteractive
dpkg -s libclang-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libclang-dev >/dev/null; }
if ! bindgen --version 2>/dev/null | grep -q "0.72.1"; then
  cargo install -q bindgen-cli --version 0.72.1 --locked
fi
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$root/scripts/gen-bindings.sh" "$tmp" > /dev/null
diff -u "$root/uvm-ioctl/src/bindings.rs" "$tmp" || { echo "uvm-ioctl/src/bindings.rs is stale: run scripts/gen-bindings.sh" >&2; exit 1; }
echo "bindings up to date"
