"""What the zero page costs on the host backend, to choose the default for views handed to
Python (issue #22.12; docs/python.md, "Reading past a request's length").

Contenders: the same cache with ``zero_page`` off and on (host backend, per-layer and
token-major). Each run creates the cache, then grows ``B`` requests token by token from
``start`` to ``end`` tokens with one ``step`` per token (every step maps the pages the new
token needs, so every page crossing is in it), then frees them. Timed: the constructor, every
``step`` (median, p99, and the steps that mapped a page), and the whole growth. Rounds
interleave the contenders (order reversed every other round); the first round is dropped.
Ratios are on / off of the medians over rounds.

    python3 python/benches/zero_page_cost.py [--rounds 7] [--out DIR]   # CPU only; a table, JSON to DIR
"""

from __future__ import annotations

import argparse

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds, the first dropped (at least 2)")
    ap.add_argument("--out", default=cli.default_out(),
                    help="zero_page_cost.json's directory ($VMEM_BENCH_OUT, else /tmp)")
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--rounds"], least={"--rounds": 2}, most={"--rounds": 1000})  # the first is dropped
    cli.check_out(ap, args.out)
    from harness import zero_page

    return zero_page.main(args.rounds, args.out)


if __name__ == "__main__":
    cli.exit_with(main)
