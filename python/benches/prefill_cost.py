"""Prefill cost of demand paging (Figure 11 of the vAttention paper) on the GPU.

Llama-3-8B (all 32 layers, random bf16 weights, SDPA attention) prefills one prompt of 1K to
64K tokens into a ``VmemCache`` (2 MB pages, per-layer). Time to first token:

* ``premapped``: every page the prompt needs mapped before the clock starts (the baseline);
* ``synchronous``: the pages are mapped inside the prefill (layer 0's update maps them all);
* ``map_ahead``: the pages are mapped by another thread with ``KVCache.map_ahead``, started
  when the request is admitted, one simulated decode iteration (25 ms) before its prefill.

Interleaved: each round runs every mode for every length, order shuffled; median of rounds
2-4. Prints TTFT per mode and the ratio to ``premapped``; writes JSON to $OUT.
"""

from harness import prefill

if __name__ == "__main__":
    prefill.main()
