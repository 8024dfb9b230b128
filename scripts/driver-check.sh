#!/usr/bin/env bash
# Proves the loaded driver answers the vMem ioctls: detection, then a round trip through
# vmem's UVM backend on GPU 0 (reserve, create and map every page size, write nothing,
# unmap, release, free) and a KV-cache replay at 64 KB pages.
#   scripts/driver-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release -q -p vmem-cli -- detect
cargo run --release -q -p vmem-bench --example uvm_check
