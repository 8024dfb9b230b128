"""``vmem-serve``: an OpenAI-compatible HTTP server for one or several models on vmem's KV
memory, over transformers' continuous-batching engine (docs/server.md)::

    vmem-serve --model PATH [--port 8000] [--memory 8GiB] [--api-key KEY]
    vmem-serve --model a=PATH_A --model b=PATH_B --memory 40GiB --limit a=60%

Modules, one job each: :mod:`.options` (the validated options), :mod:`.cli` (the command
line), :mod:`.serve` (uvicorn, signals, one model's server), :mod:`.protocol` (the OpenAI
request bodies, checked), :mod:`.errors` (OpenAI-shaped errors), :mod:`.loader` (the model
checked, loaded and its manager started), :mod:`.engine` (the manager bridged to asyncio,
admission), :mod:`.sampling` (per-request temperature, top-p and seed in the engine's rounds),
:mod:`.text` (incremental detokenization, stop strings), :mod:`.responses` (responses and SSE
streams), :mod:`.app` (one model's routes), :mod:`.metrics` (Prometheus), :mod:`.router`,
:mod:`.workers` and :mod:`.worker` (several models: the routing process, its model processes'
supervision, a model process). FastAPI, uvicorn, httpx and prometheus-client are imported only
here (``pip install "vmem-kv[server]"``).
"""

from typing import Optional, Sequence

from .options import ModelSpec, ServerOptions

__all__ = ["ModelSpec", "ServerOptions", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``vmem-serve`` with ``argv`` (default: the process's); returns the exit status."""
    from .cli import main as run

    return run(argv)
