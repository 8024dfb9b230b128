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
import sys

from harness import model_dir
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
        ap.error(str(e))
    have = model_dir.read_marker(args.out)
    if have is not None and have.get("spec") != model_dir.asdict(args.spec):
        ap.error(f"--out {args.out!r} holds a model made from {have.get('spec')}: choose another path")
    import os

    if have is None and os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        ap.error(f"--out {args.out!r} exists and is not a finished model directory")
    if args.device is not None and args.device != "cpu" and not args.device.startswith("cuda"):
        ap.error(f"--device {args.device!r} is neither cpu nor cuda[:N]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"make_model_dir.py: --device {device}: no CUDA GPU here", file=sys.stderr)
        return 2
    doc = model_dir.build(args.spec, args.out, device, log)
    log(f"model directory {'reused' if doc['reused'] else 'made'}: {args.out}")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
