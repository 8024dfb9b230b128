"""The version gate: which transformers releases vmem serves, told apart by their version number.

vmem replaces members of transformers' continuous-batching internals (:mod:`.patches`), which
move from release to release: each served release was read and tested, and any other is
refused with :class:`~vmem.VmemError` naming the range, never served on trust. The range:
5.17.x, and 5.19 to 5.25 (5.18 rewrote the cache but kept the old attention names: not served).
"""

from __future__ import annotations

import re
from types import ModuleType

from .._vmem import VmemError
from . import engine517, engine519

#: The served ``(major, minor)`` release lines: 5.17, and 5.19 to 5.25.
SERVED = ((5, 17), *((5, m) for m in range(19, 26)))
#: The served range in words, for messages and docs.
SUPPORTED_RANGE = "5.17.x or 5.19-5.25"
#: What to install for a served transformers (pip picks one in the range).
INSTALL_HINT = 'pip install "vmem-kv[transformers]"'

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)?(?:(?:a|b|rc|\.post|\.dev)\d*)*(?:\+[\w.]+)?")


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a transformers version string (``"5.25.0"``, ``"5.24.0rc1"``,
    ``"5.23.0.dev0"``); ``None`` when it is not one."""
    m = _RELEASE.fullmatch(version.strip()) if isinstance(version, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def served(version: str) -> bool:
    """Whether vmem serves transformers ``version``."""
    return release(version) in SERVED


def check(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a served ``version``; :class:`~vmem.VmemError` naming the supported
    range and the install command otherwise."""
    r = release(version)
    if r not in SERVED:
        raise VmemError(
            f"vmem.transformers patches transformers' continuous-batching internals and supports transformers "
            f"{SUPPORTED_RANGE}; this is transformers {version}. Install a supported version "
            f"({INSTALL_HINT} picks one) or update vmem."
        )
    assert r is not None
    return r


def installed() -> str:
    """The installed transformers' version."""
    import transformers

    return str(transformers.__version__)


def adapter_for(version: str) -> ModuleType:
    """The adapter module for transformers ``version``: :mod:`.engine517` for 5.17.x,
    :mod:`.engine519` for 5.19-5.25; :class:`~vmem.VmemError` naming the range otherwise."""
    return engine517 if check(version) == (5, 17) else engine519
