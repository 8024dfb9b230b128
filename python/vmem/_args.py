"""Argument checkers shared by every public constructor and option of the package.

Each checker takes the argument's public name (as the user spells it, e.g. ``"max_batch"`` or
``"install(memory=...)"``) and its value, and returns the value in its canonical form or raises
:class:`vmem.InvalidArgument` naming the argument and what it accepts. None of them coerces: a
string is never a bool, a float never an int, a bool never a number.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, TypeVar, Union

from . import _vmem
from ._vmem import InvalidArgument

Size = Union[int, str]
T = TypeVar("T")


def short(v: Any, most: int = 60) -> str:
    """``repr(v)``, cut to ``most`` characters."""
    r = repr(v)
    return r if len(r) <= most else r[: most - 3] + "..."


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (``True``/``False``, or a NumPy bool); anything else, the strings
    ``"no"`` and ``"False"`` and the ints 0 and 1 included, is refused."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing NumPy
        return bool(value)
    raise InvalidArgument(f"{name} must be True or False, got {short(value)}")


def check_optional_bool(name: str, value: Any) -> Optional[bool]:
    """``None`` (the default is decided elsewhere) or a bool (:func:`check_bool`)."""
    return None if value is None else check_bool(name, value)


def check_int(name: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool, not a float, not a string) within ``[min, max]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        if type(value).__name__.startswith(("int", "uint")) and hasattr(value, "__index__"):
            value = int(value)  # NumPy integers
        else:
            raise InvalidArgument(f"{name} must be an int, got {short(value)}")
    if min is not None and value < min:
        raise InvalidArgument(f"{name} must be >= {min}, got {value}")
    if max is not None and value > max:
        raise InvalidArgument(f"{name} must be <= {max}, got {value}")
    return value


def check_positive_int(name: str, value: Any, *, max: Optional[int] = None) -> int:
    """An int >= 1 (:func:`check_int`)."""
    return check_int(name, value, min=1, max=max)


def check_choice(name: str, value: Any, choices: Sequence[T]) -> T:
    """``value`` if it is one of ``choices`` (compared with ``==``, so strings must match exactly)."""
    if isinstance(value, bool) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise InvalidArgument(f"{name} must be one of {listed}, got {short(value)}")
    return value


def check_size(name: str, value: Any, *, min: int = 0) -> int:
    """A byte size, as an int >= ``min`` or a string such as ``"64K"``, ``"2M"``, ``"40GiB"``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name}: not a size: {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        try:
            n = _vmem.parse_bytes(value)
        except InvalidArgument as e:
            raise InvalidArgument(f"{name}: {e}") from None
    else:
        raise InvalidArgument(f"{name}: not a size: {short(value)} (an int, or a string like '2M')")
    if n < min:
        raise InvalidArgument(f"{name} must be at least {min} bytes, got {value!r}")
    return n


def check_optional_size(name: str, value: Any, *, min: int = 0) -> Optional[int]:
    """``None`` or a byte size (:func:`check_size`)."""
    return None if value is None else check_size(name, value, min=min)
