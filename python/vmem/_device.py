"""The one device parser every entry point shares (``vmem.KVCache``, ``vmem.vattention``,
``vmem.hf``): ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int ``N`` (GPU N), a ``torch.device``
(read through its ``str()``, so torch is not imported here) or ``None`` (let the backend
decide).

>>> parse_device("cuda:1"), parse_device("cpu"), parse_device(2), parse_device(None)
(('cuda', 1), ('cpu', 0), ('cuda', 2), (None, 0))
>>> placement("cpu", "auto")
('host', 0, False)
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ._vmem import InvalidArgument

__all__ = ["parse_device", "placement"]

_SPELLINGS = "'cpu', 'cuda', 'cuda:N', an int N or a torch.device"


def parse_device(device: Any) -> Tuple[Optional[str], int]:
    """``("cpu", 0)``, ``("cuda", N)``, or ``(None, 0)`` for ``None``; anything else is
    :class:`vmem.InvalidArgument`."""
    if device is None:
        return None, 0
    if isinstance(device, bool):
        raise InvalidArgument(f"device {device!r}: use {_SPELLINGS}")
    if isinstance(device, int):
        if device < 0:
            raise InvalidArgument(f"device {device} is negative: use {_SPELLINGS}")
        return "cuda", device
    if not isinstance(device, str) and not hasattr(device, "type"):
        raise InvalidArgument(f"device {device!r}: use {_SPELLINGS}")
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", 0
    # ASCII digits only: str.isdigit() also takes '²' (int() refuses it) and '٣' (torch too).
    if text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise InvalidArgument(f"device {device!r}: use {_SPELLINGS}")


def placement(device: Any, backend: str) -> Tuple[str, int, bool]:
    """``(backend, ordinal, gpu_required)`` for a device and a backend name.

    ``"cpu"`` turns ``backend="auto"`` into the host backend and refuses the GPU backends. A
    GPU device passes its ordinal; with ``"auto"`` the cache must then land on a GPU
    (``gpu_required``: no silent fallback to host memory). The host and simulation backends
    take a GPU device only as an int (the ordinal they ignore, as before the parser existed).
    """
    kind, ordinal = parse_device(device)
    name = str(backend).lower()
    if kind == "cpu":
        if name in ("cuda", "uvm"):
            raise InvalidArgument(f"device 'cpu' with backend {backend!r}: a GPU backend needs a GPU device")
        return ("host" if name == "auto" else backend), 0, False
    if kind == "cuda" and name in ("host", "sim") and not isinstance(device, int):
        raise InvalidArgument(f"device {str(device)!r} with backend {backend!r}: use device='cpu' or a GPU backend")
    return backend, ordinal, kind == "cuda" and name == "auto"
