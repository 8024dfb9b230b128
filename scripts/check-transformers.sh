#!/usr/bin/env bash
# Checks vmem.transformers against one transformers release, the day it appears:
#
#   scripts/check-transformers.sh VERSION      # e.g. 5.26.0
#
# 1. A venv for that version, target/check-transformers/VERSION (made once, reused: torch from
#    PyPI is ~5 GB), with torch (scripts/test.sh's version), transformers==VERSION and vmem built
#    from this checkout (reinstalled every run).
# 2. The patch table against it: every engine member vmem replaces, there with the parameters
#    the table expects (vmem.transformers.patches.target_problems). A release the version gate
#    does not serve yet is read against the rows of the newest served release: what moved is
#    listed, and what to change to serve it.
# 3. For a served release: the version gate's tests (test_transformers_versions.py: the table,
#    restore, other caches left to the engine) and the rest of scripts/test.sh's serving core,
#    on the CPU.
# 4. The GPU checks to run before the release is called served, with their commands.
#
# Exit 0: served and every CPU check passed; 1: a check failed or the release is not served yet;
# 2: bad usage.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() { echo "usage: $0 VERSION   (a transformers release, e.g. 5.26.0)" >&2; exit 2; }
[ $# -eq 1 ] || usage
version=$1
[[ $version =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?([a-z]+[0-9]*)?$ ]] || usage

# The torch version and the serving core are scripts/test.sh's: one list, kept there.
torch_version=$(sed -n 's/^TORCH_VERSION=//p' scripts/test.sh)
eval "$(sed -n '/^SERVING_CORE=(/,/^)/p' scripts/test.sh)"
[ -n "$torch_version" ] && [ ${#SERVING_CORE[@]} -gt 0 ] || {
  echo "$0: scripts/test.sh no longer defines TORCH_VERSION and SERVING_CORE" >&2; exit 1; }

venv=${CHECK_TRANSFORMERS_VENVS:-$root/target/check-transformers}/$version
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
  echo "== a venv for transformers $version at $venv (torch $torch_version from PyPI: once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy pytest mypy psutil "transformers==$version"
else
  echo "== reusing $venv"
fi
"$venv/bin/python" -c "import sys, transformers as t; sys.exit(t.__version__ != '$version' and f'transformers {t.__version__} is installed there, not $version')"
echo "== vmem from this checkout into it"
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps ./python

echo "== the patch table against transformers $version"
# The rows of this release if the gate serves it, else of the newest it serves.
set +e
CUDA_VISIBLE_DEVICES= "$venv/bin/python" - "$version" <<'EOF'
import sys

from vmem.transformers import patches, versions

version = sys.argv[1]
served = versions.served(version)
release = versions.release(version) if served else max(versions.SERVED)
rows = patches.patches_for(release)
problems = patches.target_problems(release)
label = f"{version}'s rows" if served else f"the rows of 5.{release[1]}, the newest served (the gate refuses {version})"
print(f"   {len(rows)} engine members vmem replaces, {label}:")
for p in rows:
    bad = [q for q in problems if q.startswith(p.target + ":")]
    print(f"   {'MOVED' if bad else 'ok   '} {p.target}" + (f"  -- {bad[0].split(': ', 1)[1]}" if bad else ""))
if not served:
    print(f"\ntransformers {version} is not served: python/vmem/transformers/versions.py's SERVED refuses it.")
    if problems:
        print(f"{len(problems)} member(s) moved: adapt them (a row for the new range) before serving it.")
    print("To serve it: read the continuous-batching diff against the newest served release "
          "(transformers/generation/continuous_batching/), add the release to SERVED and to the ranges of the "
          "rows that still hold (vmem/transformers/patches.py), widen the extra in python/pyproject.toml, "
          "then run this script again.")
    sys.exit(1)
sys.exit(1 if problems else 0)
EOF
table=$?
set -e
[ $table -eq 0 ] || exit 1

echo "== the version gate's tests and the serving core on the CPU"
tests=("${SERVING_CORE[@]/#/$root/python/tests/}")
(cd "$venv" && CUDA_VISIBLE_DEVICES= bin/python -m pytest -q -rs -p no:cacheprovider "${tests[@]}")

cat <<EOF

transformers $version passes the CPU checks. Before it is called served, run on a GPU machine
with torch (CUDA), transformers==$version and this checkout's vmem installed, from the checkout's root:

  (cd python && PYTHONPATH=benches python3 benches/versions_check.py)            # layouts, kernels, a preemption vs the engine's own path
  (cd python && PYTHONPATH=benches python3 benches/graphs_check.py --kernels fa) # CUDA graphs (fa,flashinfer with FlashInfer installed)
  python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_gpu.py         # the package's GPU tests

Each exits non-zero on a failure; keep their output with the release's notes (docs/serving.md).
EOF
