"""Plots the decode-throughput results of gpu_bench.py (python_gpu.json) as an SVG bar chart:
tokens/s per cache for each batch and context, normalised to StaticCache (eager).

    python3 python/benches/plot_throughput.py docs/results/python-package-h100/python_gpu.json out.svg

No plotting library needed: the SVG is written directly.
"""

import sys

from harness import plot

if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(f"usage: {sys.argv[0]} PYTHON_GPU_JSON OUT_SVG", file=sys.stderr)
        sys.exit(2)
    plot.main(sys.argv[1], sys.argv[2])
