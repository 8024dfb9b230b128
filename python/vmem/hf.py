"""Moved to :mod:`vmem.transformers.generate` (``vmem.transformers.VmemCache``); this module stays so
that ``from vmem.hf import VmemCache`` keeps working."""

from .transformers.generate import VmemCache, VmemLayer

__all__ = ["VmemCache", "VmemLayer"]
