"""VmemCache in the compiled mode (static=True) against StaticCache, both compiled by generate.

transformers compiles the decode step of ``generate`` (torch.compile, mode "reduce-overhead":
CUDA graphs) when the cache is compileable. ``StaticCache`` is; ``VmemCache(static=True)``
is too: full ``max_cache_len`` views over vmem memory whose unmapped part is vmem's shared
read-only zero page, pages mapped outside the graph.

Model: Llama-3-8B shapes, 4 layers, bf16, random weights, the output head scaled x50 so
greedy tokens are decisive. Each batch holds left-padded prompts of different lengths.

Every cache is sized for a context cap (``max_cache_len``) 4x the prompts, as an engine sizes
for the model's context rather than for one batch: StaticCache holds all of it, vmem the
tokens' pages. A third contender, "static BLHD", is a StaticCache whose tensors are laid out
as vmem's per-layer buffers ([B, L, H, D], handed out transposed) in torch memory: it
separates the cost of that layout from the cost of vmem's memory.

Checks, per configuration: the compiled step ran with CUDA graphs (no cudagraph skips);
generated tokens and logits agree with StaticCache's up to the first step where a row's tokens
differ, and every such step is a near-tie in StaticCache's own logits (different kernels for
different layouts round differently; a near-tie then flips, and free-running generation
diverges from there).
Benchmark: decode tokens/s = batch x 64 / the time of the 64 decode steps of one generate
(65 new tokens), stamped by a logits processor at every step; 7 rounds, the caches interleaved
in each round (order reversed every other round), one process; a cache's ratio to StaticCache
is the median of its per-round ratios (pairs from the same round share the GPU's drift).
KV memory: the static cache's tensors vs vmem's physical pages plus its zero page. Prints a
table; writes JSON to $VMEM_BENCH_OUT/compiled.json.
"""

from __future__ import annotations

import argparse

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=cli.default_out(),
                    help="compiled.json's directory ($VMEM_BENCH_OUT, else /tmp)")
    args = ap.parse_args(argv)
    cli.need_gpu(ap, "compiled_bench.py")
    cli.check_out(ap, args.out)
    from harness import compiled

    return compiled.main(args.out)


if __name__ == "__main__":
    cli.exit_with(main)
