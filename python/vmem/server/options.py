"""The server's options: one frozen, validated :class:`ServerOptions` (and a :class:`ModelSpec`
per served model), made from the command line (:mod:`.cli`) or in code, checked here before
anything is loaded or bound.

Nothing in this module imports torch or transformers: a bad option is refused in a moment. The
vmem cache options (``--page-size``, ``--layout``, ``--vmem-option``) are checked again by
:class:`vmem.transformers.Options` when the engine is built, still before the model loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Optional, Tuple

from .._args import check_int, check_optional_size, check_size, short
from .._pool_args import _floor, _floor_within_limit, _limit
from .._vmem import InvalidArgument, PoolError

#: A served model's name: what clients put in ``model`` (letters, digits, ``.``, ``_``, ``-``; the
#: pool's tenant-name rule, so the name is the tenant's).
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,31}$")
#: ``--dtype`` choices (``auto``: the checkpoint's own, float32 on the CPU where it is half).
DTYPES = ("auto", "float16", "bfloat16", "float32")
#: ``--cuda-graphs`` / ``--async-batching``: the engine decides (on for CUDA, off on the CPU), or forced.
SWITCHES = ("auto", "on", "off")
#: ``--sampling``: ``full`` honours temperature, top_p and seed per request (vmem's logits
#: processors run in every round); ``greedy`` runs the engine's plain argmax and refuses them.
SAMPLING = ("full", "greedy")
#: ``--log-level`` choices.
LOG_LEVELS = ("debug", "info", "warning", "error")
#: The largest prompt body (bytes) a request may send by default: 32 MiB.
MAX_BODY = 32 << 20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One served model: ``name`` (what requests ask for), ``path`` (a directory or a hub name,
    as ``from_pretrained`` takes it), and with several models its pool ``limit`` and ``floor``
    (bytes, ``"12G"`` or ``"25%"`` of the pool; ``None``: the pool's default, none)."""

    name: str
    path: str
    limit: Any = None
    floor: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise InvalidArgument(f"model name {short(self.name)} must be 1 to 31 letters, digits, '.', '_' or '-'")
        if not isinstance(self.path, str) or not self.path or "\0" in self.path:
            raise InvalidArgument(f"model path of {self.name!r} must be a non-empty path or name, "
                                  f"got {short(self.path)}")
        try:
            if self.limit is not None:
                _limit(f"limit of {self.name}", self.limit)
            if self.floor is not None:
                _floor(f"floor of {self.name}", self.floor)
            if self.limit is not None and self.floor is not None:
                _floor_within_limit(self.name, str(self.floor), str(self.limit))
        except PoolError as e:
            raise InvalidArgument(str(e).removeprefix("invalid pool setting: ")) from None

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``NAME=PATH`` or ``PATH`` (then the name is the path's last part, cleaned to the name
        rule, as vLLM names a model by its path)."""
        if not isinstance(text, str) or not text:
            raise InvalidArgument("--model needs a path or NAME=PATH")
        head, sep, tail = text.partition("=")
        if sep and NAME_RE.match(head):
            return cls(head, tail)
        base = text.rstrip("/").rsplit("/", 1)[-1] or text
        name = re.sub(r"[^A-Za-z0-9._-]", "-", base)[:31] or "model"
        return cls(name, text)


def _finite_seconds(name: str, value: Any, *, allow_none: bool) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be seconds (a number >= 0), got {short(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"{name} must be finite seconds >= 0, got {short(value)}")
    return seconds


def _choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(f"{name} must be one of {', '.join(choices)}, got {short(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Everything ``vmem-serve`` takes (docs/server.md has the table). Made once, validated in
    ``__post_init__``; frozen. ``models``: one :class:`ModelSpec` serves in this process; several
    are served by a router process, each model in a worker process joined to one vmem pool."""

    models: Tuple[ModelSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    #: A Unix socket to listen on instead of host:port (the router's workers).
    uds: Optional[str] = None
    api_key: Optional[str] = None
    #: KV memory: one model's cache budget, or the pool's size with several models.
    memory: Any = None
    max_context: Optional[int] = None
    max_requests: int = 256
    max_batch_tokens: Optional[int] = None
    #: Requests admitted beyond ``max_requests`` (they wait); past it, 429.
    max_queue: int = 256
    page_size: Any = "2M"
    layout: str = "token-major"
    kernel: str = "fa"
    #: More vmem.transformers.Options, as (name, value) pairs.
    vmem_options: Tuple[Tuple[str, Any], ...] = ()
    prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    cuda_graphs: str = "auto"
    async_batching: str = "auto"
    sampling: str = "full"
    #: Seconds without a request after which the model's KV memory is released (vmem sleep).
    idle_sleep: Optional[float] = None
    #: Seconds SIGTERM waits for requests in flight before cancelling them.
    drain_timeout: float = 60.0
    max_body: int = MAX_BODY
    trust_remote_code: bool = False
    log_level: str = "info"
    #: The pool's ledger with several models (``None``: ``$VMEM_POOL``, else /dev/shm/vmem-pool).
    pool_ledger: Optional[str] = None
    #: Seconds a worker may take to load and warm up before it is restarted.
    worker_start_timeout: float = 600.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        models = tuple(self.models) if isinstance(self.models, (list, tuple)) else self.models
        if not isinstance(models, tuple) or not models or not all(isinstance(m, ModelSpec) for m in models):
            raise InvalidArgument("give at least one --model")
        names = [m.name for m in models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InvalidArgument(f"model name(s) {', '.join(dup)} given twice (use --model NAME=PATH)")
        if len(models) == 1 and self.pool_ledger is None and (models[0].limit is not None or
                                                              models[0].floor is not None):
            raise InvalidArgument("--limit and --floor are a pool tenant's: give several models, or --pool-ledger "
                                  "to join a pool (one model's own memory is --memory)")
        set_(self, "models", models)
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise InvalidArgument(f"--host must be an address or a host name, got {short(self.host)}")
        set_(self, "port", check_int("--port", self.port, min=0, max=65535))
        if self.uds is not None and (not isinstance(self.uds, str) or not self.uds):
            raise InvalidArgument(f"the socket path must be a non-empty string, got {short(self.uds)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise InvalidArgument("--api-key must be a non-empty printable string without spaces")
        set_(self, "memory", check_optional_size("--memory", self.memory, min=1))
        if self.max_context is not None:
            set_(self, "max_context", check_int("--max-context", self.max_context, min=1, max=2**31 - 1))
        set_(self, "max_requests", check_int("--max-requests", self.max_requests, min=1, max=1 << 20))
        if self.max_batch_tokens is not None:
            set_(self, "max_batch_tokens", check_int("--max-batch-tokens", self.max_batch_tokens, min=1, max=1 << 24))
        set_(self, "max_queue", check_int("--max-queue", self.max_queue, min=0, max=1 << 20))
        set_(self, "page_size", check_size("--page-size", self.page_size, min=1))
        set_(self, "layout", _choice("--layout", self.layout, ("per-layer", "token-major")))
        set_(self, "kernel", _choice("--kernel", self.kernel, ("fa", "flex", "flashinfer", "fa+flashinfer")))
        pairs = tuple(tuple(p) for p in self.vmem_options)
        if any(len(p) != 2 or not isinstance(p[0], str) for p in pairs):
            raise InvalidArgument("vmem_options must be (name, value) pairs")
        set_(self, "vmem_options", pairs)
        for flag in ("prefix_caching", "trust_remote_code"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(f"{flag} must be True or False, got {short(getattr(self, flag))}")
        set_(self, "dtype", _choice("--dtype", self.dtype, DTYPES))
        if not isinstance(self.device, str) or not re.match(r"^(auto|cpu|cuda(:\d+)?)$", self.device):
            raise InvalidArgument(f"--device must be auto, cpu, cuda or cuda:N, got {short(self.device)}")
        set_(self, "cuda_graphs", _choice("--cuda-graphs", self.cuda_graphs, SWITCHES))
        set_(self, "async_batching", _choice("--async-batching", self.async_batching, SWITCHES))
        set_(self, "sampling", _choice("--sampling", self.sampling, SAMPLING))
        set_(self, "idle_sleep", _finite_seconds("--idle-sleep", self.idle_sleep, allow_none=True))
        set_(self, "drain_timeout", _finite_seconds("--drain-timeout", self.drain_timeout, allow_none=False))
        set_(self, "max_body", check_int("--max-body", self.max_body, min=1024, max=1 << 40))
        set_(self, "log_level", _choice("--log-level", self.log_level, LOG_LEVELS))
        if self.pool_ledger is not None and (not isinstance(self.pool_ledger, str) or not self.pool_ledger):
            raise InvalidArgument(f"--pool-ledger must be a path, got {short(self.pool_ledger)}")
        set_(self, "worker_start_timeout",
             _finite_seconds("--worker-start-timeout", self.worker_start_timeout, allow_none=False))
        if self.worker_start_timeout <= 0:
            raise InvalidArgument("--worker-start-timeout must be more than 0 seconds")

    @property
    def multi(self) -> bool:
        """Whether several models are served (a router and one worker process per model)."""
        return len(self.models) > 1

    @property
    def capacity(self) -> int:
        """Requests admitted at once: those holding KV plus those queued."""
        return self.max_requests + self.max_queue

    def replace(self, **changes: Any) -> ServerOptions:
        """A new, validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The options as JSON (a worker's command line carries them)."""
        d = dataclasses.asdict(self)
        d["models"] = [dataclasses.asdict(m) for m in self.models]
        d["vmem_options"] = [list(p) for p in self.vmem_options]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ServerOptions:
        """Options made by :meth:`to_json`, validated again."""
        d = json.loads(text)
        d["models"] = tuple(ModelSpec(**m) for m in d["models"])
        d["vmem_options"] = tuple(tuple(p) for p in d["vmem_options"])
        return cls(**d)
