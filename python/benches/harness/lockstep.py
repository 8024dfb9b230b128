"""tp_lockstep.py's ranks: each makes the same seeded calls on its own KVCache and all-gathers
its decision digest. What is checked and how: the script's docstring."""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vmem


def make_cache(args: argparse.Namespace, rank: int) -> vmem.KVCache:
    # 256 tokens a page on both: 256 B a token in 64 KB pages (host), 8 KB in 2 MB (CUDA).
    if args.device == "cpu":
        device, heads, dim, page, cap = "cpu", 2, 64, "64K", 120 * 64 * 1024
    else:
        device = f"cuda:{rank % max(1, torch.cuda.device_count())}"
        heads, dim, page, cap = 8, 512, "2M", 120 * 2 * 1024 * 1024
    return vmem.KVCache(
        layers=2, kv_heads=heads, head_dim=dim, dtype="fp16", max_batch=args.batch,
        max_context=4096, page_size=page, device=device,
        memory_cap=args.cap if args.cap is not None else cap, overlap=args.overlap,
        deferred_reclaim=args.deferred_reclaim,
    )


def gather(d: tuple[int, int, int], world: int) -> list[tuple[int, int, int]]:
    # int64 on the wire: the digest's u64 value reinterpreted, then back.
    t = torch.tensor([d[0] - (1 << 64) if d[0] >= (1 << 63) else d[0], d[1], d[2]],
                     dtype=torch.int64)
    out = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, t)
    return [(int(o[0]) & ((1 << 64) - 1), int(o[1]), int(o[2])) for o in out]


def worker(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    kv = make_cache(args, rank)
    rng = random.Random(args.seed)  # the same seed on every rank: the same calls
    active: list[list[int]] = []  # [id, length] in admission order
    ooms = checks = 0
    status = 0
    for step in range(1, args.steps + 1):
        roll = rng.randrange(100)
        if roll < 15 and len(active) < args.batch:
            active.append([kv.alloc(), 1 + rng.randrange(1500)])
        elif roll < 25 and active:
            kv.free(active.pop(rng.randrange(len(active)))[0])
        lens = [0] * args.batch
        for a in active:
            a[1] = min(4096, a[1] + 1 + rng.randrange(40))
            lens[a[0]] = a[1]
        if rank == 1 and step == args.diverge_at and active:
            lens[active[0][0]] = min(4096, lens[active[0][0]] + 300)
        try:
            kv.step(lens)
        except vmem.OutOfMemory:
            ooms += 1
            i = max(range(len(active)), key=lambda j: active[j][1])
            kv.free(active.pop(i)[0])
        if step % args.every == 0 or step == args.steps:
            mine = kv.decision_digest()
            all_d = gather(mine, world)
            checks += 1
            bad = [r for r, d in enumerate(all_d) if d != mine]
            if bad:
                print(f"LOCKSTEP DIVERGENCE rank {rank} by step {mine[1]} (call {mine[2]}): "
                      f"digest {mine[0]:#018x}, rank {bad[0]} {all_d[bad[0]][0]:#018x}",
                      file=sys.stderr, flush=True)
                status = 1
                break
    kv.close()
    if status == 0 and rank == 0:
        print(f"lockstep ok: {world} ranks, {args.steps} steps, {checks} comparisons, "
              f"{ooms} out-of-memory steps, final digest {mine[0]:#018x}", flush=True)
    if status == 0 and ooms == 0:
        print(f"rank {rank}: the workload never ran out of memory (raise the load)",
              file=sys.stderr)
        status = 1
    dist.destroy_process_group()
    sys.exit(status)


def launch(args: argparse.Namespace) -> int:
    """Spawns ``args.world`` ranks running :func:`worker`; 1 if a rank failed, else 0."""
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        ctx = mp.start_processes(worker, args=(args.world, args, init), nprocs=args.world,
                                 join=False, start_method="spawn")
        failed = False
        try:
            while not ctx.join():
                pass
        except mp.ProcessExitedException as e:
            print(f"rank {e.error_index} exited with {e.exit_code}", file=sys.stderr)
            failed = True
        except mp.ProcessRaisedException as e:
            print(str(e), file=sys.stderr)
            failed = True
    return 1 if failed else 0

