"""What the serving tests need to know of the transformers engine they run under (5.17.x or
5.19-5.24): whether vmem serves it, its own paged reference path, how to size its block, and how
many prompt tokens its own prefix sharing served. Imported by the tests (not a test module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import vmem  # noqa: E402
from vmem.transformers import versions as _versions  # noqa: E402

VERSION = transformers.__version__
try:
    ADAPTER = _versions.adapter_for(VERSION)
except vmem.VmemError:
    ADAPTER = None
#: Whether vmem.transformers serves the installed transformers.
SERVED = ADAPTER is not None
#: The engine's 5.17 surface (allocate_blocks, paged| names) rather than 5.19-5.24's.
IS_517 = VERSION.startswith("5.17.")
#: The engine's own paged path, the reference vmem is compared with.
ENGINE_SDPA = "paged|sdpa" if IS_517 else "sdpa"


def skip_unless_served() -> None:
    """Skips the calling test module when vmem does not serve this transformers, saying why."""
    if not SERVED:
        pytest.skip(f"vmem.transformers serves transformers {_versions.SUPPORTED_RANGE}, not {VERSION}",
                    allow_module_level=True)


#: The tiny serving tests' options: 64 KiB pages, 4 rows of 1,024 tokens, 8 MiB of KV.
TINY_OPTS = {"page_size": "64K", "max_requests": 4, "max_context": 1024, "memory": "8M"}
#: One engine block of ``llama-gqa`` per-layer under :data:`TINY_OPTS`: one 64 KiB page in each
#: of its 4 buffers, 256 tokens.
TINY_BLOCK = 4 * 65536


def tiny_cache(options: dict[str, Any], sharing: bool = True) -> Any:
    """vmem's engine cache for ``llama-gqa`` (fp32, CPU) with ``options``, rounds of 64 tokens."""
    import torch
    from harness import check as h

    import vmem.transformers as vt

    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64, allow_block_sharing=sharing)
    return vt.cache_class()(h.make_config("llama-gqa"), cb, "cpu", dtype=torch.float32, options=vt.Options(**options))


def serve_tiny(options: dict[str, Any], lengths: list[int], new: int, stagger: list[int] | None = None,
               sharing: bool = True) -> tuple[Any, dict[str, Any]]:
    """Serves prompts of ``lengths`` through vmem with ``options`` on the CPU: the tiny fp32
    ``llama-gqa`` with decisive logits, ``new`` tokens each, rounds of 64 tokens. Returns the model
    and the engine run (``harness.check.run_engine``)."""
    import torch
    from harness import check as h

    import vmem.transformers as vt

    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
    with vt.serving(**options):
        run = h.run_engine(model, vt.VMEM_ATTENTION, prompts, new, stagger=stagger,
                           cb_kwargs={"max_batch_tokens": 64, "allow_block_sharing": sharing})
    return model, run


def assert_same_under_preemption(ours: dict[str, Any], theirs: dict[str, Any], model: Any, new: int,
                                 tol: float) -> None:
    """``ours`` (a :func:`serve_tiny` run) matches DynamicCache's logits within ``tol``, generated
    exactly ``theirs``'s tokens for every request, and preempted at least once."""
    from harness import check as h

    cmp = h.compare(ours, model, new)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < tol, cmp
    for rid in ours["ids"]:
        assert list(ours["results"][rid].generated_tokens) == list(theirs["results"][rid].generated_tokens)
    assert ours["cache"].readmissions > 0, "expected at least one preemption"


def engine_block(tokens: int) -> dict[str, int]:
    """The engine's continuous-batching config for its own blocks of ``tokens`` tokens."""
    return {"block_size": tokens} if IS_517 else {"page_size": tokens}


@contextlib.contextmanager
def engine_prefix_hits() -> Iterator[list[int]]:
    """Within the block, collects what the engine's own ``search_prefix_match`` returns (the prompt
    tokens its block sharing served), in a list."""
    from transformers.generation.continuous_batching import cache as engine

    hits: list[int] = []
    real = engine.PagedAttentionCache.search_prefix_match

    def search(self: Any, request_id: str, prompt_ids: Any) -> int:
        got = real(self, request_id, prompt_ids)
        hits.append(int(got))
        return got

    engine.PagedAttentionCache.search_prefix_match = search
    try:
        yield hits
    finally:
        engine.PagedAttentionCache.search_prefix_match = real


def random_mixed_round(g: Any, k4: Any, v4: Any, count: int = 5) -> list[tuple[int, int, int]]:
    """A mixed round over row caches ``k4``/``v4`` (``[rows, ctx, Hkv, D]``): ``count`` rows in a
    random order, every other one decoding (1 query token) and the rest prefilling 2-8 tokens
    after a random past; each row's first ``past + q`` slots get random K/V (the rest stays as
    the caller filled it). Returns the ``(row, past, q)`` entries."""
    import torch

    rows, ctx, hkv, d = k4.shape
    order = torch.randperm(rows, generator=g).tolist()[:count]
    entries = []
    for i, row in enumerate(order):
        q = 1 if i % 2 else int(torch.randint(2, 9, (1,), generator=g))
        past = int(torch.randint(0, ctx - q + 1, (1,), generator=g))
        entries.append((row, past, q))
        k4[row, :past + q] = torch.randn(past + q, hkv, d, generator=g)
        v4[row, :past + q] = torch.randn(past + q, hkv, d, generator=g)
    return entries


@contextlib.contextmanager
def forced_padding():
    """The engine's padding path on the CPU (graphs are off without CUDA): the runner pads every
    round (``pad_inputs``) and the IOs bucket ``max_seqlen_k`` as for a varlen graph."""
    from transformers.generation.continuous_batching import input_outputs as cb_io
    from transformers.generation.continuous_batching import model_runner as cb_runner

    runner_init, io_init = cb_runner.ModelRunner.__init__, cb_io.ContinuousBatchingIOs.__init__

    def init_runner(self, *a, **k):
        runner_init(self, *a, **k)
        self.pad_inputs = True

    def init_io(self, *a, **k):
        io_init(self, *a, **k)
        self.use_cuda_graph_varlen = True

    cb_runner.ModelRunner.__init__, cb_io.ContinuousBatchingIOs.__init__ = init_runner, init_io
    try:
        yield
    finally:
        cb_runner.ModelRunner.__init__, cb_io.ContinuousBatchingIOs.__init__ = runner_init, io_init


@pytest.fixture(autouse=True)
def fake_memory_and_uninstall() -> Iterator[None]:
    """Each test with the CPU's memory faked as a GPU's (the engine's default sizing reads it)
    and vmem's engine patch taken off after it. Autouse in the modules that import it."""
    from harness import check as h
    from vmem import transformers as vt

    h.fake_cpu_memory()
    yield
    vt.uninstall()


@pytest.fixture
def graphed(monkeypatch: Any) -> list[int]:
    """The runner believes varlen graphs are on (``use_cuda_graph_varlen``) and never finds one
    captured; a capture runs the round without one (none can be captured on the CPU) and records
    its padded tokens in the list returned: the rounds the engine would have graphed."""
    from transformers.generation.continuous_batching import input_outputs as cb_io
    from transformers.generation.continuous_batching import model_runner as cb_runner

    seen: list[int] = []
    init = cb_runner.ModelRunner.__init__

    def runner_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self.use_cuda_graph_varlen = True

    def capture(self: Any, forward_fn: Any, stream: Any, *args: Any) -> None:
        seen.append(int(args[1]["input_ids"].shape[-1]))  # args: model, batch_data, ...
        forward_fn(*args)

    monkeypatch.setattr(cb_runner.ModelRunner, "__init__", runner_init)
    monkeypatch.setattr(cb_runner.ModelRunner, "_capture_graph", capture)
    monkeypatch.setattr(cb_io.ContinuousBatchingIOs, "get_graph", lambda self, *a, **k: None)
    return seen
