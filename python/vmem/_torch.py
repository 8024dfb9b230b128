"""A layer's K and V views as torch tensors (``torch.from_dlpack``, no copy): the one place
of the package that turns views into tensors, used by :mod:`vmem.torch` and
:meth:`vmem.KVCache.torch_layers`. Importing it imports torch."""

from __future__ import annotations

from typing import Tuple

import torch

from ._vmem import KVTensor

__all__ = ["pair"]


def pair(views: Tuple[KVTensor, KVTensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K and V views ``views`` as torch tensors over the same memory; each keeps the
    cache's memory alive until it is dropped."""
    k, v = views
    return torch.from_dlpack(k), torch.from_dlpack(v)
