"""Command-line pieces the benches share: name lists, flag checks (usage errors, exit 2, one
line naming the flag, before any model is built or any measurement starts: zero, negative, huge,
NaN, a missing input file, an ``--out`` that cannot be written), where a run goes (GPU, or
``--tiny`` on the CPU), and the load generator's client flags (how requests are made and sent),
which serve_bench.py and the serving drivers share. Every script checks its flags here, none with
copies of its own."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harness.trace import default_trace, load_trace


def exit_with(main: Callable[[], int]) -> None:
    """Runs a script's ``main`` and exits with its code; a reader that closed the output pipe
    (``script | head``) ends the run with exit code 1 and no traceback, the rest of the output
    discarded."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 1
    sys.exit(code)


def int_list(text: str) -> list[int]:
    """An ``argparse`` type: comma-separated integers of at least 1 (``"256,16"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be at least 1: {text!r}")
    return values


def check_int_list(ap: argparse.ArgumentParser, flag: str, text: str) -> None:
    """Refuses, as a usage error, ``text`` of ``flag`` that :func:`int_list` refuses."""
    try:
        int_list(text)
    except argparse.ArgumentTypeError as e:
        ap.error(f"{flag}: {e}")


def names(ap: argparse.ArgumentParser, flag: str, spec: str, known: Sequence[str],
          allow_none: bool = False) -> list[str]:
    """The comma-separated names of ``spec`` for ``flag``; one not in ``known``, or none (unless
    ``allow_none``), is a usage error."""
    out = [n.strip() for n in spec.split(",") if n.strip()]
    for n in out:
        if n not in known:
            ap.error(f"{flag}: unknown {n!r} (known: {list(known)})")
    if not out and not allow_none:
        ap.error(f"{flag} names none (known: {list(known)})")
    return out


#: The largest count a flag takes unless it names a smaller one: a signed 32-bit int, what torch,
#: the engine and vmem's bindings take without overflowing.
MOST = 2**31 - 1
#: The largest value of the flags the benches share, where a larger one is a typo or cannot be
#: built (a model of 10**5 layers, 10**9 rows); a script's own ``most`` overrides.
COMMON_MOST = {"--rounds": 1000, "--repeats": 1000, "--reps": 10_000, "--warmup": 100, "--layers": 128,
               "--max-requests": 4096, "--max-rows": 4096, "--max-batch-tokens": 1 << 20, "--max-context": 1 << 20,
               "--new-tokens": 1 << 20, "--max-prompt": 1 << 20, "--check-requests": 1000, "--check-tokens": 4096}


def value(args: Any, flag: str) -> Any:
    """The value of ``--flag-name`` in ``args``."""
    return getattr(args, flag[2:].replace("-", "_"))


def check_counts(ap: argparse.ArgumentParser, args: Any, positive: Sequence[str],
                 at_least_zero: Sequence[str] = (), most: Mapping[str, int] | None = None,
                 least: Mapping[str, int] | None = None) -> None:
    """Refuses, as a usage error (exit 2, one line naming the flag), a count in ``positive``
    below 1 (or its ``least``) or in ``at_least_zero`` below 0, or above its ``most`` (default
    :data:`MOST`; a ``None`` default passes)."""
    for flag in [*positive, *at_least_zero]:
        v = value(args, flag)
        low = (least or {}).get(flag, 1 if flag in positive else 0)
        top = (most or {}).get(flag, COMMON_MOST.get(flag, MOST))
        if v is not None and v < low:
            ap.error(f"{flag} must be at least {low}, got {v}")
        if v is not None and v > top:
            ap.error(f"{flag} must be at most {top}, got {v}")


def check_out(ap: argparse.ArgumentParser, path: str, flag: str = "--out") -> str:
    """Makes the output directory ``path`` and checks a file can be written there; else a usage
    error naming ``flag``. Returns ``path``. The directories it makes are removed again (while
    empty) if ``ap`` refuses the command line later, so a refused run leaves nothing behind."""
    made = _missing_dirs(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        _remove_empty(made)
        ap.error(f"{flag} {path!r} cannot be created or written: {e.strerror or e}")
    if made:
        refuse = ap.error

        def error(message: str) -> Any:
            _remove_empty(made)
            return refuse(message)

        ap.error = error  # type: ignore[method-assign]
    return path


def _missing_dirs(path: str) -> list[str]:
    """The directories of ``path`` that do not exist yet, the deepest first."""
    missing: list[str] = []
    d = os.path.abspath(path)
    while not os.path.exists(d) and d != os.path.dirname(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing


def _remove_empty(dirs: Sequence[str]) -> None:
    """Removes ``dirs`` (the deepest first) while each is empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return


def check_out_file(ap: argparse.ArgumentParser, path: str, flag: str = "--out") -> str:
    """Checks that the output file ``path`` can be written (its directory exists and takes a
    file; ``path`` is no directory) without writing it; else a usage error naming ``flag``."""
    if not path:
        ap.error(f"{flag} must name a file, not ''")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        ap.error(f"{flag} {path!r} is a directory, not a file")
    if not os.path.isdir(parent):
        ap.error(f"{flag} {path!r}: the directory {parent!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        ap.error(f"{flag} {path!r} cannot be written: {e.strerror or e}")
    return path


def check_in_file(ap: argparse.ArgumentParser, path: str, flag: str) -> str:
    """Checks that the input file ``path`` exists and can be read; else a usage error."""
    if not os.path.isfile(path):
        ap.error(f"{flag} {path!r} is not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        ap.error(f"{flag} {path!r} cannot be read: {e.strerror or e}")
    return path


def default_out() -> str:
    """The output directory of the scripts that write to ``$VMEM_BENCH_OUT``: ``$VMEM_BENCH_OUT``, else /tmp."""
    return os.environ.get("VMEM_BENCH_OUT") or "/tmp"


def need_modules(ap: argparse.ArgumentParser, what: str, modules: Sequence[str]) -> None:
    """A usage error naming the first of ``modules`` that cannot be imported here (looked up,
    not imported)."""
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            ap.error(f"{what} needs the {name!r} module, which is not installed here "
                     "(scripts/python-gpu.sh bench-build builds vmem_bench; kvcached is pip-installed there)")


def device_or_tiny(ap: argparse.ArgumentParser, tiny: bool) -> str:
    """Where a run with a ``--tiny`` flag goes: ``"cpu"`` with it, else ``"cuda"`` (no GPU is a
    usage error)."""
    import torch

    if not tiny and not torch.cuda.is_available():
        ap.error("no GPU: use --tiny for a CPU smoke test")
    return "cpu" if tiny else "cuda"


#: the most KV memory a ``--tiny`` run takes (it lives in host memory)
TINY_MOST = 4 << 30


def check_kv_memory(ap: argparse.ArgumentParser, flag: str, text: str, nbytes: int, tiny: bool) -> None:
    """Refuses, as a usage error, ``nbytes`` of KV memory (``flag`` ``text``) the run cannot hold:
    with ``tiny`` more than :data:`TINY_MOST` of host memory, else more than the GPU has (or no GPU)."""
    if device_or_tiny(ap, tiny) == "cpu":
        if nbytes > TINY_MOST:
            ap.error(f"{flag} {text}: --tiny's KV lives in host memory, at most {TINY_MOST >> 30} GiB")
        return
    import torch

    total = torch.cuda.mem_get_info()[1]
    if nbytes > total:
        ap.error(f"{flag} {text}: more than the GPU's {total >> 20} MiB")


def need_gpu(ap: argparse.ArgumentParser, what: str = "this benchmark") -> None:
    """A usage error where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        ap.error(f"no GPU: {what} runs on CUDA only")


def check_fraction(ap: argparse.ArgumentParser, flag: str, value: float) -> None:
    """Refuses, as a usage error, ``value`` of ``flag`` outside (0, 1] (NaN included)."""
    if not 0 < value <= 1:
        ap.error(f"{flag} must be a fraction in (0, 1], got {value}")


#: The longest a timed flag may ask for: a week (an infinite or absurd wait is a typo).
MOST_SECONDS = 7 * 24 * 3600.0


def check_seconds(ap: argparse.ArgumentParser, flag: str, value: float, most: float = MOST_SECONDS) -> None:
    """Refuses, as a usage error, ``value`` of ``flag`` not above 0 seconds or above ``most``
    (NaN and infinity included)."""
    if not value > 0:
        ap.error(f"{flag} must be more than 0 seconds, got {value}")
    if not value <= most:
        ap.error(f"{flag} must be at most {most:g} seconds, got {value}")


def check_positive(ap: argparse.ArgumentParser, flag: str, value: float) -> None:
    """Refuses, as a usage error, ``value`` of ``flag`` not a finite number above 0."""
    if not 0 < value < float("inf"):
        ap.error(f"{flag} must be a finite number above 0, got {value}")


def check_flags(ap: argparse.ArgumentParser, args: Any, positive: Sequence[str],
                at_least_zero: Sequence[str] = ()) -> None:
    """Refuses, as usage errors (exit 2, one line naming the flag), before any model is built,
    what a serving bench cannot run: :func:`check_counts`, ``--memory-percent`` outside (0, 1],
    ``--timeout`` not above 0, a ``--page-size`` that is not one of vmem's, a ``--trace`` that is
    no file, an ``--out`` that cannot be created."""
    check_counts(ap, args, positive, at_least_zero)
    check_fraction(ap, "--memory-percent", args.memory_percent)
    check_seconds(ap, "--timeout", args.timeout)
    if args.page_size is not None:
        page_bytes(ap, args.page_size)
    check_in_file(ap, args.trace, "--trace")
    check_out(ap, args.out)


def check_fits(ap: argparse.ArgumentParser, args: Any) -> None:
    """Refuses, as a usage error, ``--max-prompt`` + ``--new-tokens`` past ``--max-context`` (vmem's
    row: such a request would be refused when it arrives)."""
    if args.max_prompt + args.new_tokens > args.max_context:
        ap.error(f"--max-prompt {args.max_prompt} + --new-tokens {args.new_tokens} pass --max-context "
                 f"{args.max_context} (a vmem row)")


def page_bytes(ap: argparse.ArgumentParser, text: Any) -> int:
    """``--page-size``'s bytes: one of vmem's page sizes, else a usage error (exit 2, one line)."""
    import vmem
    from vmem.transformers import PAGE_SIZES

    try:
        page = int(vmem.parse_bytes(text))
    except (vmem.VmemError, TypeError) as e:
        ap.error(f"--page-size {text!r}: {e}")
    if page not in PAGE_SIZES:
        ap.error(f"--page-size {text!r} is not one of vmem's page sizes "
                 f"({', '.join(f'{p >> 10}K' for p in PAGE_SIZES)})")
    return page


def trace_lengths(ap: argparse.ArgumentParser, path: str, n: int, cap: int) -> list[int]:
    """The first ``n`` prompt lengths of ``path`` capped at ``cap``; a trace that cannot give
    them is a usage error."""
    try:
        return [r.prompt_len for r in load_trace(path, n, cap)]
    except (OSError, ValueError) as e:
        ap.error(f"--trace {path!r}: {e}")
        raise  # not reached: ap.error exits


def place(ap: argparse.ArgumentParser, args: Any) -> None:
    """Sets ``args.device`` and ``args.dtype``: bf16 on the GPU, or with ``--tiny`` fp32 on the CPU
    with small pages, context and batch (a smoke test; with ``args.schedule`` the context, batch
    and rows stay those given); no GPU without ``--tiny`` is a usage error.
    ``args.page_size`` given is kept; else 2M on the GPU, 64K with ``--tiny``."""
    import torch

    from harness.engine import fake_cpu_memory

    if args.tiny:
        args.device, args.dtype = "cpu", torch.float32
        args.page_size = args.page_size or "64K"
        if not getattr(args, "schedule", False):  # --schedule keeps the GPU run's limits
            args.max_context = min(args.max_context, 2048)
            args.max_batch_tokens = args.max_batch_tokens or 256
            args.max_requests = min(args.max_requests, 8)  # eager Flex on the CPU materializes rows x context scores
        fake_cpu_memory()
    else:
        args.device, args.dtype = device_or_tiny(ap, False), torch.bfloat16
        args.page_size = args.page_size or "2M"


def add_client_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of how requests are made and sent (serve_bench.py and the serving drivers)."""
    from harness import loadgen

    ap.add_argument("--endpoint", default="completions", choices=sorted(loadgen.ENDPOINTS))
    ap.add_argument("--prompts", default="text", choices=("ids", "text"), help="a list of token ids, or text")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer directory for text prompts")
    ap.add_argument("--vocab-size", type=int, default=None, help="token ids drawn below this (default: the "
                                                                  "tokenizer's)")
    ap.add_argument("--force-output", default=None, choices=loadgen.FORCE_MODES)
    ap.add_argument("--trace", default=default_trace(), help="an Azure trace CSV")
    ap.add_argument("--max-prompt", type=int, default=4000, help="prompt tokens at most")
    ap.add_argument("--max-output", type=int, default=1024, help="answer tokens at most")
    ap.add_argument("--output-len", type=int, default=None, help="every answer this many tokens")
    ap.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                    help="SLOs of goodput (ttft, tpot, e2el in ms; e.g. ttft:500 tpot:50)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--max-time", type=float, default=600.0, help="seconds of sending per run at most")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds in-flight requests get after --max-time")
    ap.add_argument("--warmup", type=int, default=2, help="short requests sent before the clock")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--allow-remote", action="store_true", help="allow a server that is not on loopback")


def check_client_flags(ap: argparse.ArgumentParser, args: Any) -> None:
    """Usage errors (exit 2, one line) of :func:`add_client_flags`' flags; sets ``args.slo``."""
    from harness import serve_metrics, workload

    check_counts(ap, args, ["--max-prompt", "--max-output", "--output-len", "--max-concurrency", "--vocab-size"],
                 ["--warmup", "--seed"], most={"--warmup": 10_000})
    check_seconds(ap, "--request-timeout", args.request_timeout)
    check_seconds(ap, "--max-time", args.max_time)
    if not 0 <= args.drain <= MOST_SECONDS:
        ap.error(f"--drain must be a number of seconds from 0 to {MOST_SECONDS:g}, got {args.drain}")
    check_in_file(ap, args.trace, "--trace")
    try:
        workload.trace_lengths(args.trace, 1, args.max_prompt, args.max_output, args.output_len)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        ap.error(f"--trace {args.trace!r}: {e}")
    if args.api_key is not None and (not args.api_key or not args.api_key.isprintable() or " " in args.api_key
                                     or not args.api_key.isascii()):
        ap.error("--api-key must be printable ASCII with no spaces")
    try:
        args.slo = serve_metrics.parse_slo(args.goodput)
    except ValueError as e:
        ap.error(f"--goodput: {e}")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        ap.error(f"--tokenizer {args.tokenizer!r} is not a directory")


def prompts_for(ap_error: Any, args: Any, model: str) -> Any:
    """The prompt maker (:class:`harness.workload.Prompts`) of ``args`` for ``model`` (its
    tokenizer: ``--tokenizer``, else the model's id when it is a directory)."""
    from harness import workload

    tok = args.tokenizer or (model if os.path.isdir(model) else None)
    vocab = args.vocab_size
    if vocab is None and tok is not None:
        vocab = workload.tokenizer_vocab(tok)
    if vocab is None:
        ap_error("give --vocab-size or --tokenizer (the model's id is not a local directory)")
    if args.prompts == "text" and tok is None:
        ap_error("--prompts text needs --tokenizer (the model's id is not a local directory)")
    return workload.Prompts(args.prompts, vocab, args.seed, tok)
