"""Progress lines of the benches: stderr, flushed, so stdout keeps only the results."""

from __future__ import annotations

import sys
from typing import Any


def log(*a: Any) -> None:
    """Prints ``a`` to stderr, flushed."""
    print(*a, file=sys.stderr, flush=True)
