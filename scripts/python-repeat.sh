#!/usr/bin/env bash
# Runs the Python suite N times in a row (default 20), stopping at the first failure: issue
# #30's done-criterion ("the Python suite passes 20 runs in a row"). Run scripts/test.sh first
# (it builds the venv), or pass a venv with vmem installed.
#
#   scripts/python-repeat.sh [N] [VENV]   # VENV default: the venv with torch and the newest
#                                         # transformers scripts/test.sh made (target/venvs/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
n=${1:-20}
venv=${2:-$(ls -d "${VMEM_TEST_VENVS:-$root/target/venvs}"/py*-torch*-transformers* 2>/dev/null | sort -V | tail -1)}
[ -n "$venv" ] && [ -x "$venv/bin/python" ] || { echo "$0: no venv at $venv (run scripts/test.sh first)" >&2; exit 2; }
cd "$venv"
for i in $(seq "$n"); do
  t0=$(date +%s)
  if ! bin/python -m pytest -q -p no:cacheprovider --ignore="$root/python/tests/test_gpu.py" \
      "$root/python/tests" > "$root/target/python-repeat.log" 2>&1; then
    echo "run $i of $n FAILED (target/python-repeat.log):" >&2
    grep -E '^(FAILED|ERROR)' "$root/target/python-repeat.log" >&2 || tail -20 "$root/target/python-repeat.log" >&2
    exit 1
  fi
  echo "run $i of $n: $(tail -1 "$root/target/python-repeat.log") ($(( $(date +%s) - t0 ))s)"
done
echo "$n runs in a row, no failure"
