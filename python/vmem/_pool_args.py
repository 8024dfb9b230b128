"""The arguments of :mod:`vmem.pool` checked as the ledger parses them: limits, floors and
sizes (bytes, ``"12G"``, ``"25%"``), each refused with a :class:`vmem.PoolError` naming the
setting before anything reaches the ledger. Private: :mod:`vmem.pool` is the face.
"""

from __future__ import annotations

from typing import Any, Tuple

import vmem._vmem as _vmem

from ._args import integer, short
from ._vmem import PoolError

MAX_BYTES = (1 << 64) - 1
"""The most bytes a limit or a floor may name (the ledger's words are 64-bit)."""

MIN_BYTES: int = _vmem.POOL_MIN_BYTES
"""The least a pool or a limit may be: one page of vmem's smallest size (64 KiB)."""


def _whole_share(text: str) -> bool:
    """``text`` (a share less its ``%``) is ASCII digits, as the ledger parses them: ``str.isdigit``
    alone passes superscripts and other scripts' digits, which ``int`` refuses or the ledger does."""
    return text.isascii() and text.isdigit()


def _limit(name: str, value: Any) -> str:
    """A limit as the ledger parses it (``"12G"``, ``"25%"``, bytes as digits)."""
    return _setting(name, value, floor=False)


def _floor(name: str, value: Any) -> str:
    """A floor as the ledger parses it (``"4G"``, ``"25%"``, bytes as digits, ``"0"``: none)."""
    return _setting(name, value, floor=True)


def _setting(name: str, value: Any, *, floor: bool) -> str:
    """A limit (at least one page, :data:`MIN_BYTES`, or 1%) or a floor (0 allowed: none), as the
    ledger parses it."""
    least = 0 if floor else 1  # percent
    least_bytes = 0 if floor else MIN_BYTES
    too_small = ("a floor cannot be negative" if floor
                 else "a limit of less than one page (64K) lets the tenant hold nothing")
    as_int = integer(value)  # a NumPy integer too
    if as_int is not None:
        value = as_int
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PoolError(f"invalid pool setting: {name} must be bytes (an int), a size such as "
                        f"'{'4G' if floor else '12G'}' or a share such as '25%', got {short(value)}")
    if isinstance(value, int):
        if value < least_bytes:
            raise PoolError(f"invalid pool setting: {name} {short(value)}: {too_small}")
        if value > MAX_BYTES:
            raise PoolError(f"invalid pool setting: {name} {short(value)}: more bytes than a 64-bit count holds")
        return str(value)
    text = value.strip()
    if text.endswith("%"):
        share = text[:-1].strip()
        if not _whole_share(share) or not least <= int(share) <= 100:
            raise PoolError(f"invalid pool setting: {name} {short(value)}: a share is {least}% to 100%")
        return value
    if floor and text.startswith("-"):
        raise PoolError(f"invalid pool setting: {name} {short(value)}: a floor cannot be negative")
    try:
        size = int(_vmem.parse_bytes(text))
    except Exception as e:  # the parser's own message says what it reads
        raise PoolError(f"invalid pool setting: {name} {short(value)}: {e}") from None
    if size < least_bytes:
        raise PoolError(f"invalid pool setting: {name} {short(value)}: {too_small}")
    return value


def _amount(text: str) -> Tuple[bool, int]:
    """``(is_share, value)`` of a checked limit or floor: the percentage, or the bytes."""
    text = text.strip()
    if text.endswith("%"):
        return True, int(text[:-1].strip())
    return False, int(_vmem.parse_bytes(text))


def _floor_within_limit(tenant: str, floor: str, limit: str) -> None:
    """Refuses a floor above the limit when both are bytes or both shares (a share against a
    size depends on the pool's total: the ledger checks it at join)."""
    (f_share, f), (l_share, lim) = _amount(floor), _amount(limit)
    if f_share == l_share and f > lim:
        raise PoolError(f"invalid pool setting: floor {short(floor)} of tenant {short(tenant)} is above its limit "
                        f"{short(limit)}: a tenant is never kept more room than it may hold")


def _size(name: str, value: Any) -> str:
    as_int = integer(value)  # a NumPy integer too
    if as_int is not None:
        value = as_int
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PoolError(f"invalid pool setting: {name} must be a size (an int or a string such as '60G'), "
                        f"got {short(value)}")
    if isinstance(value, int) and value < 0:
        raise PoolError(f"invalid pool setting: {name} {short(value)}: a size cannot be negative")
    return str(value)
