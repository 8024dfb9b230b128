"""Plots the decode-throughput results of gpu_bench.py (python_gpu.json) as an SVG bar chart:
tokens/s per cache for each batch and context, normalised to StaticCache (eager).

    python3 python/benches/plot_throughput.py docs/results/python-package-h100/python_gpu.json out.svg

No plotting library needed: the SVG is written directly.
"""

from __future__ import annotations

import argparse

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", metavar="PYTHON_GPU_JSON", help="gpu_bench.py's python_gpu.json")
    ap.add_argument("svg", metavar="OUT_SVG", help="the chart to write")
    args = ap.parse_args(argv)
    cli.check_in_file(ap, args.results, "PYTHON_GPU_JSON")
    cli.check_out_file(ap, args.svg, "OUT_SVG")
    from harness import plot

    try:
        text = plot.svg(args.results)
    except (OSError, ValueError, KeyError, TypeError) as e:  # not gpu_bench.py's results
        ap.error(f"PYTHON_GPU_JSON {args.results!r} holds no throughput results: {type(e).__name__}: {e}")
    with open(args.svg, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
