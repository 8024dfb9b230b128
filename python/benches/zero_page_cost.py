"""What the zero page costs on the host backend, to choose the default for views handed to
Python (issue #22.12; docs/python.md, "Reading past a request's length").

Contenders: the same cache with ``zero_page`` off and on (host backend, per-layer and
token-major). Each run creates the cache, then grows ``B`` requests token by token from
``start`` to ``end`` tokens with one ``step`` per token (every step maps the pages the new
token needs, so every page crossing is in it), then frees them. Timed: the constructor, every
``step`` (median, p99, and the steps that mapped a page), and the whole growth. Rounds
interleave the contenders (order reversed every other round); the first round is dropped.
Ratios are on / off of the medians over rounds.

    python3 python/benches/zero_page_cost.py [--rounds 7]   # CPU only; prints a table, JSON to $OUT
"""

import argparse

from harness import zero_page

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    zero_page.main(ap.parse_args())
