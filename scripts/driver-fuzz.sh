#!/usr/bin/env bash
# Fuzzes the vMem ioctls' argument checks (driver-patch/src/uvm_vmem_check.h, the header
# nvidia-uvm compiles) against an independent 128-bit model, under ASan and UBSan, for a
# bounded time: driver-patch/fuzz/fuzz_check.c. Fails on any disagreement or sanitizer report.
#   scripts/driver-fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
command -v clang >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
clang -g -O1 -std=gnu11 -Wall -Werror -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$root/driver-patch/src" -I"$root/driver-patch/include" \
  "$root/driver-patch/fuzz/fuzz_check.c" -o "$work/fuzz_check"
mkdir -p "$work/corpus"
status=0
(cd "$work" && ./fuzz_check -max_total_time="$seconds" -print_final_stats=1 corpus) > "$work/fuzz.log" 2>&1 || status=$?
grep -E 'stat::number_of_executed_units|ERROR|SUMMARY|Done' "$work/fuzz.log" || true
if [ "$status" != 0 ]; then
  tail -40 "$work/fuzz.log"
  echo "DRIVER FUZZ FAILED (exit $status): a check disagrees with the model; the input is above" >&2
  exit 1
fi
echo "driver fuzz: $(ls "$work/corpus" | wc -l) corpus inputs, no disagreement in ${seconds}s"
