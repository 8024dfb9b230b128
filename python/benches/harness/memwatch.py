"""Device memory as ``cudaMemGetInfo`` sees it (``torch.cuda.mem_get_info``): everything any
allocator holds on the device (torch's caching allocator, vmem's mapped pages, CUDA graph
pools, kernels' workspaces), sampled by a thread during a run."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any


def used_bytes() -> int | None:
    """Bytes in use on the current CUDA device (total - free); ``None`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


class MemWatch:
    """A context that samples :func:`used_bytes` every ``interval_s`` on a thread, and once on
    entering and leaving: ``peak`` is the most seen, ``samples`` how many. Without CUDA both
    stay ``None`` / 0. The thread only reads the driver's counter (no synchronization), so it
    costs the run one short driver call and a GIL hand-over per interval."""

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be above 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.peak: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._device: Any = None

    def sample(self) -> None:
        """Takes one sample now."""
        u = used_bytes()
        if u is not None:
            self.samples += 1
            self.peak = u if self.peak is None else max(self.peak, u)

    def _loop(self) -> None:
        import torch

        torch.cuda.set_device(self._device)
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemWatch:
        import torch

        self.sample()
        if torch.cuda.is_available():
            self._device = torch.cuda.current_device()
            self._thread = threading.Thread(target=self._loop, name="memwatch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
