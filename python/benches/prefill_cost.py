"""Prefill cost of demand paging (Figure 11 of the vAttention paper) on the GPU.

Llama-3-8B (all 32 layers, random bf16 weights, SDPA attention) prefills one prompt of 1K to
64K tokens into a ``VmemCache`` (2 MB pages, per-layer). Time to first token:

* ``premapped``: every page the prompt needs mapped before the clock starts (the baseline);
* ``synchronous``: the pages are mapped inside the prefill (layer 0's update maps them all);
* ``map_ahead``: the pages are mapped by another thread with ``KVCache.map_ahead``, started
  when the request is admitted, one simulated decode iteration (25 ms) before its prefill.

Interleaved: each round runs every mode for every length, order shuffled; median of rounds
2-4. Prints TTFT per mode and the ratio to ``premapped``; writes JSON to $VMEM_BENCH_OUT.
"""

from __future__ import annotations

import argparse

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=cli.default_out(),
                    help="prefill_cost.json's directory ($VMEM_BENCH_OUT, else /tmp)")
    args = ap.parse_args(argv)
    cli.need_gpu(ap, "prefill_cost.py")
    cli.check_out(ap, args.out)
    from harness import prefill

    return prefill.main(args.out)


if __name__ == "__main__":
    cli.exit_with(main)
