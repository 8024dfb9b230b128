"""The ``-before`` serving contenders: vmem's per-round copies as they were before issue #32's
eighth-session cuts, patched in for one contender's run so that before and after run
interleaved in one process (docs/serving.md, "The engine's read index and vmem's round
copies"). What is put back:

* the engine's own ``maybe_pad_inputs`` (a padded round's KV read at least one interval) and,
  on 5.19+, the cache's ``read_cache_limit = None`` and ``max_tokens_read`` of every row: the
  engine fills and copies its whole ``read_index`` buffer every round that reads;
* each round's metadata copied from pageable memory, and the whole ``3 x capacity + 2``-entry
  buffer of :class:`~vmem.kernels.buffers.RoundBuffers` rather than the round's ``3 P + 2``
  (re-added beside the cut's own copy, which stays: the layout changed with the cut).

Not put back: the split plan's list building (``fa_split.SplitBuffers.fill``), a few µs a round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import vmem.transformers as vt
from vmem.kernels import buffers


def _pageable_copy_on_stream(buffer: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
    """``buffers.copy_on_stream`` before the cut: the copy from pageable memory."""
    if buffer.device.type != "cuda":
        buffer.copy_(host)
        return
    if stream is None:
        buffer.copy_(host, non_blocking=True)
        return
    stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream):
        buffer.copy_(host, non_blocking=True)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Inside the block, vmem's caches built and served with the copies above put back."""
    from transformers.generation.continuous_batching import model_runner

    runner = model_runner.ModelRunner
    cache_cls = vt.cache_class()
    saved = [(runner, "maybe_pad_inputs", runner.__dict__["maybe_pad_inputs"]),
             (cache_cls, "__init__", cache_cls.__dict__["__init__"]),
             (buffers.RoundBuffers, "fill", buffers.RoundBuffers.__dict__["fill"]),
             (buffers, "copy_on_stream", buffers.copy_on_stream)]
    init, fill = cache_cls.__init__, buffers.RoundBuffers.fill

    def cache_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if hasattr(self, "max_tokens_read"):  # 5.19+
            self.read_cache_limit = None
            self.max_tokens_read = self.rows * self.max_context

    def whole_fill(self: Any, entries: Any, **kwargs: Any) -> Any:
        meta = fill(self, entries, **kwargs)
        host = torch.zeros(3 * self.capacity + 2, dtype=torch.int32)
        host[: meta.host.numel()] = meta.host
        _pageable_copy_on_stream(self.buffer, host, kwargs.get("stream"))
        return meta

    runner.maybe_pad_inputs = runner.maybe_pad_inputs.__wrapped__
    cache_cls.__init__ = cache_init
    buffers.RoundBuffers.fill = whole_fill
    buffers.copy_on_stream = _pageable_copy_on_stream
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
