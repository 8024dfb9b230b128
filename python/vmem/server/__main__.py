"""``python -m vmem.server``: the same as ``vmem-serve``."""

from .cli import entry

entry()
