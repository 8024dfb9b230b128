"""What the serving drivers (serve_compare.py, serve_multitenant.py, serve_steady.py) share: their
common flags, the model directories they make or reuse, the servers they start by kind
(``vmem``: vmem-serve; ``tf``: ``transformers serve --continuous-batching`` on the engine's own
paged cache) with one KV budget, and the client settings each server needs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from harness import cli, loadgen, model_dir, server_proc, workload
from harness.log import log

#: the server kinds
KINDS = ("vmem", "tf")
#: how each kind forces an answer's length (transformers serve refuses unknown fields)
FORCE = {"vmem": "ignore-eos", "tf": "generation-config"}
#: the environment of every server and in-process engine: output unbuffered, nothing fetched from
#: the Hub (the model directories are local; transformers 5.25 would fetch kernels by default)
SERVER_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "USE_HUB_KERNELS": "NO"}
#: the KV budget of a --tiny run
TINY_KV = "16M"
#: where model directories go by default
MODELS_ROOT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vmem-bench-models")


def add_flags(ap: argparse.ArgumentParser, shape: str, layers: int | None, kv: str, kv_flag: str = "--kv-memory",
              kv_help: str = "the KV budget of each server") -> None:
    """The flags every driver takes (model, KV budget as ``kv_flag``, servers, outputs) and the
    client's."""
    ap.add_argument("--shape", default=shape, help=f"the model's shape, one of {sorted(model_dir.SHAPES)}")
    ap.add_argument("--layers", type=int, default=layers, help="its layers (default: full depth)")
    ap.add_argument("--dtype", default="bf16", help=f"its weights' dtype, one of {model_dir.DTYPES}")
    ap.add_argument("--model-dir", default=None, help="the model directory, made there if absent (default: a "
                                                      "directory under --models-root named after the model)")
    ap.add_argument("--models-root", default=MODELS_ROOT, help="where model directories go by default")
    ap.add_argument(kv_flag, dest="kv_memory", default=None, help=f"{kv_help}, a size (default {kv}, --tiny {TINY_KV})")
    ap.add_argument("--block-size", type=int, default=256, help="transformers serve's KV block tokens")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--vmem-serve-cmd", default=None, help="how vmem-serve is started (default: "
                                                           f"{sys.executable} -m vmem.server)")
    ap.add_argument("--vmem-serve-args", default="", help="more arguments of vmem-serve (one string)")
    ap.add_argument("--tf-serve-args", default="", help="more arguments of transformers serve (one string)")
    ap.set_defaults(kv_default=kv, kv_flag=kv_flag)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test, not a measurement")
    ap.add_argument("--out", default=None)
    cli.add_client_flags(ap)


def check_flags(ap: argparse.ArgumentParser, args: Any, default_out: str) -> None:
    """Usage errors (exit 2, one line, before any model or server) of :func:`add_flags`' flags;
    sets ``args.kv_bytes``, ``args.spec`` (the model's), ``args.model_dir``, ``args.device``."""
    import vmem

    cli.check_client_flags(ap, args)
    args.kv_memory = args.kv_memory or (TINY_KV if args.tiny else ap.get_default("kv_default"))
    try:
        args.kv_bytes = int(vmem.parse_bytes(args.kv_memory))
    except (vmem.VmemError, TypeError) as e:
        ap.error(f"{args.kv_flag} {args.kv_memory!r}: {e}")
    if args.kv_bytes < 1 << 20:
        ap.error(f"{args.kv_flag} {args.kv_memory!r} is under 1 MiB")
    cli.check_counts(ap, args, ["--block-size"], most={"--block-size": 1 << 16})
    cli.check_seconds(ap, "--ready-timeout", args.ready_timeout)
    try:
        args.spec = model_dir.ModelSpec(args.shape, None if args.tiny else args.layers, args.tiny,
                                        "fp32" if args.tiny else args.dtype)
    except ValueError as e:
        ap.error(f"--shape/--layers/--dtype: {e}")
    cfg = args.spec.config()
    args.kv_token_bytes = model_dir.kv_token_bytes(cfg, 4 if args.spec.dtype == "fp32" else 2)
    try:
        tf_blocks(args.kv_bytes, args.block_size, args.kv_token_bytes)
    except ValueError as e:
        ap.error(f"{args.kv_flag}/--block-size: {e}")
    args.model_dir = args.model_dir or default_model_dir(args.spec, args.models_root)
    why = model_dir.unusable(args.spec, args.model_dir)
    if why is not None:
        ap.error(f"--model-dir {why}")
    for flag in ("--vmem-serve-args", "--tf-serve-args", "--vmem-serve-cmd"):
        try:
            server_proc.split_args(cli.value(args, flag))
        except ValueError as e:
            ap.error(f"{flag}: {e}")
    args.out = cli.check_out(ap, args.out or os.environ.get("VMEM_BENCH_OUT") or default_out)
    args.device = cli.device_or_tiny(ap, args.tiny)
    cli.check_kv_memory(ap, args.kv_flag, args.kv_memory, args.kv_bytes, args.tiny)


#: the oldest transformers whose ``transformers serve`` the drivers run. 5.17's takes its sampling
#: settings from the first request for every later one, loads the model at the first request,
#: answers /v1/models with 500, and on the CPU closed a fresh server's first stream after ~55 s;
#: 5.24 and 5.25 ran here (5.23 is the version the issue's tries of its serve were made on)
TF_SERVE_MIN = (5, 23)


def check_tf_serve(ap: argparse.ArgumentParser, flag: str) -> None:
    """Refuses, as a usage error, running ``transformers serve`` (``flag`` names it) on a
    transformers older than :data:`TF_SERVE_MIN`."""
    import transformers

    try:
        have = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        return
    if have < TF_SERVE_MIN:
        ap.error(f"{flag}: the drivers run transformers serve from transformers "
                 f"{'.'.join(map(str, TF_SERVE_MIN))} (installed: {transformers.__version__}, whose serve takes "
                 "every request's sampling from the first one)")


def default_model_dir(spec: model_dir.ModelSpec, root: str = MODELS_ROOT) -> str:
    """Where the model of ``spec`` goes under ``root`` when no ``--model-dir`` is given."""
    depth = "tiny" if spec.tiny else f"x{spec.depth}"
    return os.path.join(root, f"{spec.shape}-{depth}-{spec.dtype}-s{spec.seed}-c{spec.max_context}")


def ensure_model(spec: model_dir.ModelSpec, path: str, device: str) -> dict[str, Any]:
    """The model directory of ``spec`` at ``path``, made there (weights built on ``device``) unless
    it is there already; logs how long it took."""
    t0 = time.perf_counter()
    try:
        doc = model_dir.build(spec, path, device, log)
    except OSError as e:
        raise ModelDirError(f"cannot make the model directory {path}: {e}") from e
    log(f"model {path}: {'reused' if doc['reused'] else 'made'} in {time.perf_counter() - t0:.1f} s "
        f"({doc['bytes'] / 2**30:.2f} GiB, {doc['kv_token_bytes']} KV bytes a token)")
    return doc


class ModelDirError(RuntimeError):
    """A model directory could not be made (a full disk, no permission)."""


def tf_blocks(kv_bytes: int, block_size: int, token_bytes: int) -> int:
    """transformers serve's ``--cb-num-blocks`` for ``kv_bytes`` of KV in blocks of ``block_size``
    tokens of ``token_bytes`` each (every layer's K and V): the engine sizes its cache as
    ``num_blocks * block_size * token_bytes`` (5.25's ``num_sectors_from_config``). Less than one
    block is a ValueError."""
    n = kv_bytes // (block_size * token_bytes)
    if n < 1:
        raise ValueError(f"{kv_bytes} bytes of KV hold no block of {block_size} tokens of {token_bytes} bytes")
    return n


def start_server(kind: str, args: Any, models: list[tuple[str, str]], kv_bytes: int, token_bytes: int,
                 log_name: str, extra: list[str] | None = None) -> server_proc.Server:
    """A started server of ``kind`` (:data:`KINDS`) on a free port, serving ``models`` (``(name,
    path)``; ``tf`` takes one, served under its path) with ``kv_bytes`` of KV; its log at
    ``args.out/log_name``. One that does not start is :class:`harness.serve_run.ServerGone`."""
    port = server_proc.free_port()
    env = dict(SERVER_ENV)
    if kind == "tf":
        if len(models) != 1:
            raise ValueError("transformers serve is started with one model")
        argv = server_proc.tf_serve_argv(models[0][1], port, tf_blocks(kv_bytes, args.block_size, token_bytes),
                                         args.block_size, args.device,
                                         server_proc.split_args(args.tf_serve_args) + (extra or []))
    else:
        argv = server_proc.vmem_serve_argv(models, port, kv_bytes,
                                           server_proc.split_args(args.vmem_serve_args) + (extra or []),
                                           server_proc.split_args(args.vmem_serve_cmd) or None)
    log(f"starting {kind}: {' '.join(argv)}")
    srv = server_proc.Server(kind, argv, port, os.path.join(args.out, log_name), env, args.ready_timeout,
                             args.api_key)
    srv.start()
    log(f"{kind} ready in {srv.ready_s:.1f} s at {srv.base_url}")
    return srv


def client(kind: str, args: Any, base_url: str, model: str) -> loadgen.ClientConfig:
    """The client settings for a server of ``kind``: answers forced as it takes it (unless
    ``--force-output``), the run bounds of ``args``."""
    return loadgen.ClientConfig(base_url, model, args.endpoint, args.force_output or FORCE[kind], args.api_key,
                                args.request_timeout, args.max_concurrency, args.max_time, args.drain)


def served_model(srv: server_proc.Server, fallback: str) -> str:
    """The one model ``srv`` lists on ``/v1/models`` (``fallback`` when it lists none or several,
    or cannot list them)."""
    import httpx

    try:
        ids = loadgen.served_models(srv.base_url, srv.api_key)
    except (httpx.HTTPError, ValueError):
        return fallback
    return ids[0] if len(ids) == 1 else fallback


def prompts(args: Any, marker: dict[str, Any]) -> workload.Prompts:
    """The prompt maker for the model directory ``args.model_dir`` (its own tokenizer: exact text)."""
    return workload.Prompts(args.prompts, args.vocab_size or marker["vocab_size"], args.seed,
                            args.tokenizer or args.model_dir)


def device_name() -> str:
    """The GPU's name, or ``cpu``."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def versions() -> dict[str, str]:
    """The versions a result depends on."""
    import torch
    import transformers

    import vmem

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "vmem": getattr(vmem, "__version__", "?"), "python": sys.version.split()[0]}


def part_files(paths: list[str], name: str) -> list[str]:
    """The ``name.json`` files of ``paths`` (directories holding one, or the files), for ``--merge``."""
    return [os.path.join(p, f"{name}.json") if os.path.isdir(p) else p for p in paths]


def check_merge(ap: argparse.ArgumentParser, args: Any, name: str, default_out: str,
                merge: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
    """``--merge``: the parts joined by ``merge`` as ``args.merged``; a part that is no readable
    ``name`` document, or an ``--out`` that cannot be written, is a usage error."""
    for f in part_files(args.merge, name):
        cli.check_in_file(ap, f, "--merge")
    try:
        args.merged = merge(load_parts(args.merge, name))
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--merge: {e}")
    args.out = cli.check_out(ap, args.out or os.environ.get("VMEM_BENCH_OUT") or default_out)


def load_parts(paths: list[str], name: str) -> list[dict[str, Any]]:
    """The ``name.json`` documents of ``paths`` (:func:`part_files`), for ``--merge``."""
    docs = []
    for f in part_files(paths, name):
        with open(f) as fh:
            docs.append(json.load(fh))
    return docs
