"""Argument checkers shared by every public constructor and option of the package.

The converters below them turn what a call takes into what the Rust module takes: byte sizes
(:func:`parse_bytes`), a step's lengths (:func:`lengths`), a prompt's token ids
(:func:`token_ids`) and a dtype's name (:func:`dtype_name`).

Each checker takes the argument's public name (as the user spells it, e.g. ``"max_batch"`` or
``"install(memory=...)"``) and its value, and returns the value in its canonical form or raises
:class:`vmem.InvalidArgument` naming the argument and what it accepts. None of them coerces: a
string is never a bool, a float never an int, a bool never a number.
"""

from __future__ import annotations

import operator
from collections.abc import Set as AbstractSet
from typing import Any, Iterable, List, Mapping, Optional, Sequence, TypeVar, Union

import vmem._vmem as _vmem

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
    t = type(value)
    if t.__module__ == "numpy" and t.__name__ in ("bool_", "bool"):  # NumPy 1's bool_, NumPy 2's bool
        return bool(value)
    raise InvalidArgument(f"{name} must be True or False, got {short(value)}")


def check_optional_bool(name: str, value: Any) -> Optional[bool]:
    """``None`` (the default is decided elsewhere) or a bool (:func:`check_bool`)."""
    return None if value is None else check_bool(name, value)


def integer(value: Any) -> Optional[int]:
    """``value`` as an int if it is one: a Python int (not a bool) or a NumPy integer scalar
    (``np.int64``, ``np.uint32``, ``np.longlong``, ...: a dtype of kind signed or unsigned
    integer; never a NumPy bool, float or ``timedelta64``); ``None`` otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    t = type(value)
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if t.__module__ == "numpy" and t.__name__ != "ndarray" and kind in ("i", "u"):
        return operator.index(value)  # NumPy integer scalars (not arrays, not even 0-d ones)
    return None


def check_int(name: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool, not a float, not a string; a NumPy integer is an
    int) within ``[min, max]``."""
    as_int = integer(value)
    if as_int is None:
        raise InvalidArgument(f"{name} must be an int, got {short(value)}")
    value = as_int
    if min is not None and value < min:
        raise InvalidArgument(f"{name} must be >= {min}, got {short(value)}")
    if max is not None and value > max:
        raise InvalidArgument(f"{name} must be <= {max}, got {short(value)}")
    return value


def check_positive_int(name: str, value: Any, *, max: Optional[int] = None) -> int:
    """An int >= 1 (:func:`check_int`)."""
    return check_int(name, value, min=1, max=max)


def check_optional_seconds(name: str, value: Any) -> Optional[float]:
    """``None``, or a duration in seconds: an int or a float, finite and >= 0 (not a bool, not
    a string), as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be seconds (an int or a float >= 0) or None, got {short(value)}")
    try:
        seconds = float(value) + 0.0  # + 0.0: -0.0 is 0.0
    except OverflowError:
        raise InvalidArgument(f"{name} must be finite seconds >= 0 (or None to disable), got {short(value)}") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")) or seconds < 0:
        raise InvalidArgument(f"{name} must be finite seconds >= 0 (or None to disable), got {short(value)}")
    return seconds


def check_choice(name: str, value: Any, choices: Sequence[T]) -> T:
    """The one of ``choices`` that ``value`` equals: a string choice is matched by a ``str``
    (a subclass such as NumPy's ``str_`` too) spelled exactly the same, and returned as the
    choice itself; any other choice by a value of its own type. Anything else (an array, a
    bool, bytes) is :class:`InvalidArgument`, never another exception."""
    for choice in choices:
        same_kind = isinstance(value, str) if isinstance(choice, str) else type(value) is type(choice)
        if same_kind and value == choice:
            return choice
    listed = ", ".join(repr(c) for c in choices)
    raise InvalidArgument(f"{name} must be one of {listed}, got {short(value)}")


def check_size(name: str, value: Any, *, min: int = 0) -> int:
    """A byte size, as an int >= ``min`` (a NumPy integer too) or a string such as ``"64K"``,
    ``"2M"``, ``"40GiB"``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name}: not a size: {value!r}")
    as_int = integer(value)
    if as_int is not None:
        n = as_int
    elif isinstance(value, str):
        try:
            n = _vmem.parse_bytes(value)
        except InvalidArgument as e:
            raise InvalidArgument(f"{name}: {e}") from None
    else:
        raise InvalidArgument(f"{name}: not a size: {short(value)} (an int, or a string like '2M')")
    if n < min:
        raise InvalidArgument(f"{name} must be at least {min} bytes, got {short(value)}")
    if n >= 1 << 64:  # what Rust takes: refused here, when the setting is made, not later
        raise InvalidArgument(f"{name} must be at most 2**64 - 1 bytes, got {short(value)}")
    return n


def check_optional_size(name: str, value: Any, *, min: int = 0) -> Optional[int]:
    """``None`` or a byte size (:func:`check_size`)."""
    return None if value is None else check_size(name, value, min=min)


def parse_bytes(size: Size) -> int:
    """A byte size: an int (a NumPy integer too), or a string such as ``"64K"``, ``"2M"``,
    ``"40GiB"``."""
    if isinstance(size, bool):
        raise InvalidArgument(f"not a size: {size!r}")
    as_int = integer(size)
    if as_int is not None:
        if as_int < 0:
            raise InvalidArgument(f"a size must be >= 0, got {as_int}")
        return as_int
    if isinstance(size, str):
        return _vmem.parse_bytes(size)
    raise InvalidArgument(f"not a size: {size!r} (an int, or a string like '2M')")


# Lengths travel to Rust as 64-bit signed ints; anything larger is refused here, clearly.
_MAX_LENGTH = 1 << 63


def lengths(lengths: Any, max_batch: int) -> List[int]:
    """One length per request id from a list, a dict {id: length}, a NumPy array or a CPU
    tensor."""
    if isinstance(lengths, (str, bytes, bytearray, memoryview)):
        # Before the tolist() branch: a memoryview has tolist() (its bytes as ints).
        raise InvalidArgument(f"lengths must be a list, a dict {{id: length}} or an array, got {short(lengths)}")
    if isinstance(lengths, Mapping):
        out = [0] * max_batch
        for r, n in lengths.items():
            rid = integer(r)  # a NumPy integer is an id too
            if rid is None or not 0 <= rid < max_batch:
                raise InvalidArgument(f"request id {r!r} out of range (0..{max_batch})")
            out[rid] = n
        lengths = out
    elif hasattr(lengths, "tolist"):  # NumPy arrays, torch tensors
        device = getattr(lengths, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise InvalidArgument("lengths must be on the CPU (a device tensor would sync)")
        lengths = lengths.tolist()
    elif not isinstance(lengths, (list, tuple)):
        try:
            lengths = list(lengths)
        except TypeError:
            raise InvalidArgument(
                f"lengths must be a list, a dict {{id: length}} or an array, got {short(lengths)}") from None
    # The common case, a list of plain non-negative ints, checked by C loops (a step of a
    # batch of 256 spent 14 µs in the loop below).
    if (
        len(lengths) == max_batch
        and set(map(type, lengths)) <= {int}
        and min(lengths, default=0) >= 0
        and max(lengths, default=0) < _MAX_LENGTH
    ):
        return list(lengths)
    out = []
    for i, value in enumerate(lengths):
        n = integer(value)  # a NumPy integer is a length too (never a bool)
        if n is None:
            if isinstance(value, float) and value.is_integer():
                n = int(value)
            else:
                raise InvalidArgument(f"lengths[{i}] = {short(value)} is not a whole number of tokens")
        if n < 0:
            raise InvalidArgument(f"lengths[{i}] = {short(n)} is negative")
        if n >= _MAX_LENGTH:
            raise InvalidArgument(f"lengths[{i}] = {short(n)} is too large")
        out.append(n)
    if len(out) != max_batch:
        raise InvalidArgument(f"step expects {max_batch} lengths (max batch), got {len(out)}")
    return out


def token_ids(tokens: Any) -> List[int]:
    """Token ids as a list of ints from a list, a tuple, a NumPy array or a CPU tensor (1-D),
    or any ordered iterable of ints, NumPy integers or 0-d integer CPU tensors (the Rust side
    checks each is an int in ``0..2**32``)."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        # Before the tolist() branch: a memoryview has tolist() (its bytes as ints).
        raise InvalidArgument(f"tokens must be a sequence of token ids, got {short(tokens)}")
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):  # arrays, tensors
        device = getattr(tokens, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise InvalidArgument("tokens must be on the CPU (a device tensor would sync)")
        shape = getattr(tokens, "shape", None)
        if shape is not None and len(shape) != 1:
            raise InvalidArgument(f"tokens must be a 1-D sequence of token ids, got an array of shape {tuple(shape)}")
        if "bool" in str(getattr(tokens, "dtype", "")):
            raise InvalidArgument("tokens must be token ids, not booleans")
        out = tokens.tolist()
        if not isinstance(out, list):
            raise InvalidArgument(f"tokens must be a 1-D sequence of token ids, got {short(tokens)}")
        return out
    if not isinstance(tokens, Iterable):
        raise InvalidArgument(f"tokens must be a sequence of token ids, got {short(tokens)}")
    if isinstance(tokens, (Mapping, AbstractSet)):
        raise InvalidArgument(f"tokens must be an ordered sequence of token ids, not a {type(tokens).__name__}")
    out = tokens if isinstance(tokens, list) else list(tokens)
    # The common case, plain ints, goes to Rust as it is (a C loop over the types).
    if set(map(type, out)) <= {int}:
        return out
    return [token_id(i, t) for i, t in enumerate(out)]


def token_id(i: int, t: Any) -> Any:
    """Element ``i`` of a prompt as an int where it is an integer scalar (a NumPy integer, a 0-d
    integer CPU tensor); anything else is refused here, naming it in one short line (ints go on
    to Rust's range check)."""
    if isinstance(t, int) and not isinstance(t, bool):
        if t >= 2**32:  # Rust would say "at most 2**64 - 1" past 64 bits
            raise InvalidArgument(f"tokens[{i}] = {short(t)} is not a token id (< 2**32)")
        return t
    if not isinstance(t, (bool, float)) and getattr(t, "ndim", 0) == 0 and hasattr(t, "__index__") \
            and "bool" not in str(getattr(t, "dtype", "")):
        device = getattr(t, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise InvalidArgument("tokens must be on the CPU (a device tensor would sync)")
        try:
            return token_id(i, operator.index(t))
        except TypeError:
            pass
    raise InvalidArgument(f"tokens[{i}] must be an int, got {short(t)}")


def dtype_name(dtype: Any) -> str:
    """A dtype's name from a string, a torch dtype (``torch.float16``), a NumPy dtype or a NumPy
    scalar type (``numpy.float16``), without importing either."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, type):  # numpy.float16
        return dtype.__name__
    name = getattr(dtype, "name", None)  # numpy.dtype("float16")
    if isinstance(name, str):
        return name
    return str(dtype).replace("torch.", "")
