"""Makes a local model directory for the serving benches: a named shape with random weights
(``from_config`` + ``save_pretrained``) and a word-level tokenizer made here, with a chat
template and an EOS token (harness/model_dir.py). Nothing is downloaded.

    python3 python/benches/make_model_dir.py --shape llama3-8b --out /tmp/models/llama3-8b
    python3 python/benches/make_model_dir.py --shape llama3-8b --layers 8 --out /tmp/models/8b-x8
    python3 python/benches/make_model_dir.py --shape tiny --device cpu --dtype fp32 --out /tmp/models/tiny

Shapes: ``llama3-8b`` (32 layers at full depth), ``llama3.2-1b`` (16), ``qwen2.5-7b`` (28),
``tiny`` (2 layers, hidden 128, vocab 256: CPU tests); ``--tiny`` makes the CPU stand-in of a
named shape. Weights are built on ``--device`` (default: the GPU if there is one) and saved as
safetensors. A finished directory made from the same flags is reused; one made from other
flags, or any other non-empty path, is refused (exit 2), never overwritten. Prints the
directory's summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from harness import cli, model_dir
from harness.log import log


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help=f"one of {sorted(model_dir.SHAPES)}")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's full depth)")
    ap.add_argument("--tiny", action="store_true", help="the CPU stand-in of the shape")
    ap.add_argument("--dtype", default="bf16", help=f"one of {model_dir.DTYPES}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-context", type=int, default=8192, help="the model's context (max_position_embeddings)")
    ap.add_argument("--device", default=None, help="where the weights are built: cuda, cuda:N or cpu (default: "
                                                   "cuda if there is a GPU, else cpu)")
    ap.add_argument("--out", required=True, help="the model directory")
    args = ap.parse_args(argv)
    try:
        args.spec = model_dir.ModelSpec(args.shape, args.layers, args.tiny, args.dtype, args.seed, args.max_context)
    except ValueError as e:
        ap.error(f"--shape/--layers/--dtype/--max-context: {e}")
    why = model_dir.unusable(args.spec, args.out)
    if why is not None:
        ap.error(f"--out {why}")
    if model_dir.read_marker(args.out) is None:  # to be made: its parent must take it
        cli.check_out(ap, os.path.dirname(os.path.abspath(args.out)))
    cli.check_counts(ap, args, [], ["--seed"])
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device {args.device!r} is neither cpu nor cuda[:N]")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.device = args.device or ("cuda" if gpus else "cpu")
    if args.device.startswith("cuda") and int(args.device.partition(":")[2] or 0) >= gpus:
        ap.error(f"--device {args.device}: {'no CUDA GPU here' if not gpus else f'{gpus} CUDA GPUs here'}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        doc = model_dir.build(args.spec, args.out, args.device, log)
    except OSError as e:  # a full disk, a permission lost since the check: nothing is left behind
        print(f"make_model_dir.py: cannot make {args.out}: {e}", file=sys.stderr)
        return 1
    log(f"model directory {'reused' if doc['reused'] else 'made'}: {args.out}")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
