"""GPU benchmarks of the Python package on CUDA (scripts/python-gpu.sh bench-gpu runs this on
the GPU machine with the wheel built here; the GPU checks are tests: python/tests/test_gpu.py).
Prints a results table per benchmark; exits non-zero if a benchmark's own sanity check fails.
Writes results to $VMEM_BENCH_OUT (or /tmp) as JSON (python_gpu.json).

  throughput: decode throughput and peak memory: VmemCache (both layouts) vs DynamicCache and
    StaticCache, eager, interleaved in rounds in one process.
  padding_cost: what a batched kernel over rows of different lengths costs, each way of
    keeping it on mapped memory: pad_rows (every row mapped as far as the longest) vs
    zero_page (each row its own length, the rest the zero page), and a contiguous torch
    buffer as the floor; a decode loop with masked SDPA over [:, :longest], interleaved
    rounds; step time and mapped memory.

``--benches name,name`` (or ``BENCHES=name,name``) runs only those; ``--out DIR`` (or ``$VMEM_BENCH_OUT``).
"""

from __future__ import annotations

import argparse
import os

from harness import cli

#: the benchmarks (harness.decode.BENCHES)
BENCHES = ("throughput", "padding_cost")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benches", default=os.environ.get("BENCHES", ""),
                    help=f"comma-separated, of {list(BENCHES)} (default $BENCHES, else all)")
    ap.add_argument("--out", default=cli.default_out(),
                    help="python_gpu.json's directory ($VMEM_BENCH_OUT, else /tmp)")
    args = ap.parse_args(argv)
    only = cli.names(ap, "--benches", args.benches, BENCHES, allow_none=True)
    cli.need_gpu(ap, "gpu_bench.py")
    cli.check_out(ap, args.out)
    from harness import decode

    return decode.main(args.out, only)


if __name__ == "__main__":
    cli.exit_with(main)
