"""GPU benchmarks of the Python package on CUDA (scripts/python-gpu.sh bench-gpu runs this on
the GPU machine with the wheel built here; the GPU checks are tests: python/tests/test_gpu.py).
Prints a results table per benchmark; exits non-zero if a benchmark's own sanity check fails.
Writes results to $OUT (or /tmp) as JSON (python_gpu.json).

  throughput: decode throughput and peak memory: VmemCache (both layouts) vs DynamicCache and
    StaticCache, eager, interleaved in rounds in one process.
  padding_cost: what a batched kernel over rows of different lengths costs, each way of
    keeping it on mapped memory: pad_rows (every row mapped as far as the longest) vs
    zero_page (each row its own length, the rest the zero page), and a contiguous torch
    buffer as the floor; a decode loop with masked SDPA over [:, :longest], interleaved
    rounds; step time and mapped memory.

BENCHES=name,name runs only those.
"""

from harness import decode

if __name__ == "__main__":
    decode.main()
