"""Lockstep check across processes (issue #24): ranks of a tensor-parallel group, each with its
own ``vmem.KVCache``, make the same seeded calls and all-gather their decision digests every
``--every`` steps over torch.distributed; any difference exits non-zero naming the step.

Runs on CPU with the gloo backend and the host backend (``device="cpu"``); ``--device cuda``
puts each rank's cache on ``cuda:<rank % GPUs>`` (the digest still travels over gloo).

    python3 python/benches/tp_lockstep.py                   # 2 ranks, 2,000 steps
    python3 python/benches/tp_lockstep.py --diverge-at 700  # rank 1 adds a token: must fail

Each rank's engine indexes its requests by admission order and uses the ids its own cache
hands out, as a tensor-parallel engine whose ranks schedule identically does; the digest
covers the ids, out-of-memory outcomes and the pages held after each step. Exit 0: every
comparison agreed (and the workload ran out of memory at least once, so the preemption path
ran). Exit 1: a divergence (``LOCKSTEP DIVERGENCE`` on stderr) or a bad run.
"""
from __future__ import annotations

import argparse

from harness import cli

import vmem


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=50, help="compare digests every N steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cap", default=None, help="memory cap per rank (default: 120 pages)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--deferred-reclaim", action=argparse.BooleanOptionalAction, default=False,
                   help="with --overlap, not lockstep-safe (docs/architecture.md)")
    p.add_argument("--diverge-at", type=int, default=None,
                   help="rank 1 adds 300 tokens to one request at this step (must fail)")
    args = p.parse_args(argv)
    cli.check_counts(p, args, ["--world", "--steps", "--every", "--batch", "--diverge-at"], ["--seed"],
                     least={"--world": 2}, most={"--world": 64, "--steps": 10**7, "--every": 10**7,
                                                 "--batch": 1024, "--diverge-at": args.steps})
    page = 64 << 10 if args.device == "cpu" else 2 << 20
    if args.cap is not None:
        try:
            cap = int(vmem.parse_bytes(args.cap))
        except (vmem.VmemError, TypeError, ValueError) as e:
            p.error(f"--cap {args.cap!r}: {e}")
        if cap < 2 * 2 * page:  # K and V of the 2 layers, one page each
            p.error(f"--cap {args.cap!r} holds less than one page of K and V per layer ({4 * page} bytes)")
    if args.device == "cuda":
        cli.need_gpu(p, "tp_lockstep.py --device cuda")
    from harness.lockstep import launch

    return launch(args)


if __name__ == "__main__":
    cli.exit_with(main)
