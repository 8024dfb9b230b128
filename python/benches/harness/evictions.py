"""Preemptions counted the same way for every contender: the engine's scheduler evicts requests
(CPU offload or soft reset) through ``OffloadingManager.offload_requests`` alone, in every
transformers version the benches run; :class:`Evictions` wraps it for the length of a run and
counts the active requests each call takes away. A vmem cache's own count (its rows admitted
again, ``readmissions``) agrees with it, but the engine's caches keep none."""

from __future__ import annotations

import importlib
from typing import Any


class Evictions:
    """``with Evictions() as ev:`` counts, in ``ev.count``, the requests the engine evicted
    while the block ran (whatever the cache); the engine's method is restored on exit."""

    def __init__(self) -> None:
        self.count = 0
        self._cls: Any = None
        self._original: Any = None

    def __enter__(self) -> Evictions:
        mod = importlib.import_module("transformers.generation.continuous_batching.offloading_manager")
        cls = mod.OffloadingManager
        original = cls.__dict__["offload_requests"]
        counter = self

        def offload_requests(manager: Any, *args: Any, **kwargs: Any) -> Any:
            before = len(manager.scheduler.active_requests)
            try:
                return original(manager, *args, **kwargs)
            finally:
                counter.count += max(0, before - len(manager.scheduler.active_requests))

        self._cls, self._original = cls, original
        cls.offload_requests = offload_requests
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cls is not None:
            self._cls.offload_requests = self._original
            self._cls = None
