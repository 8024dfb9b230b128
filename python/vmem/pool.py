"""One GPU's KV memory shared by several vmem processes: the pool's ledger from Python, what
``vmem pool`` does on the command line (docs/multitenant.md).

The operator creates a pool and changes tenants' limits while they run::

    from vmem import pool
    p = pool.create(size="60G")                 # or reserve="2G": the GPU's free memory less 2G
    p.set_limit("llama", "40%")                 # "12G", "25%" or bytes
    p.set_floor("qwen", "20%")                  # room kept for it even while it is idle
    for t in p.status().tenants:
        print(t.name, t.usage, t.limit, t.over_limit)

A process joins as a tenant through its cache, whose pages are then charged to the pool (a
page the pool refuses is :class:`vmem.OutOfMemory`, as a full cache's)::

    kv = vmem.KVCache(..., pool=pool.Join("llama", limit="12G", floor="4G"))

Every refusal is :class:`vmem.PoolError` (a :class:`vmem.VmemError`) with the message
``vmem pool`` prints; nothing is changed by a refused call. The ledger is ``$VMEM_POOL``, else
``/dev/shm/vmem-pool``, unless a path is given.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Tuple, Union

import vmem._vmem as _vmem

from ._args import check_bool, integer, short
from ._pool_args import MAX_BYTES as MAX_BYTES  # vmem.pool.MAX_BYTES, as before the parsers moved
from ._pool_args import MIN_BYTES as MIN_BYTES
from ._pool_args import _floor, _floor_within_limit, _limit, _size
from ._vmem import InvalidArgument, PoolError

#: Longest tenant name, bytes (the ledger's rule: vmem-pool `layout::MAX_NAME`).
MAX_NAME = 31

__all__ = [
    "DEFAULT_LEDGER",
    "FloorChange",
    "Join",
    "LimitChange",
    "Pool",
    "PoolError",
    "PoolStatus",
    "Reaped",
    "TenantStatus",
    "create",
    "default_ledger",
    "open",
]

#: Where the ledger is when neither a path nor ``$VMEM_POOL`` says (as ``vmem pool``).
DEFAULT_LEDGER = "/dev/shm/vmem-pool"

#: A limit: bytes (an int >= 1), a size string (``"12G"``) or a share of the pool (``"25%"``).
Limit = Union[int, str]


def default_ledger() -> str:
    """``$VMEM_POOL`` when set and not empty, else :data:`DEFAULT_LEDGER`."""
    return os.environ.get("VMEM_POOL") or DEFAULT_LEDGER


def _path(value: Any) -> str:
    """A ledger path: a string, a path-like object or bytes (as the OS spells it), not empty and
    without a NUL byte (which no path holds)."""
    if value is None:
        return default_ledger()
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if not isinstance(value, str) or not value:
        raise PoolError(f"invalid pool setting: a ledger path must be a non-empty string, got {short(value)}")
    if "\0" in value:
        raise PoolError(f"invalid pool setting: a ledger path cannot hold a NUL byte, got {short(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class TenantStatus:
    """One live tenant: its ``name``, process ``pid``, ``usage``, ``limit``, ``floor`` (room
    the pool keeps for it while it holds less; 0: none) and ``peak`` (bytes), ``over_limit``
    (bytes above its limit, 0 within it: it must shrink), ``revision`` (times its limit was
    set, 1 at join), ``joined`` (Unix seconds), ``slot``."""

    name: str
    pid: int
    usage: int
    limit: int
    floor: int
    peak: int
    over_limit: int
    revision: int
    joined: int
    slot: int


@dataclasses.dataclass(frozen=True)
class Reaped:
    """A tenant whose process died, taken out of the pool with the ``usage`` it held."""

    name: str
    pid: int
    usage: int


@dataclasses.dataclass(frozen=True)
class PoolStatus:
    """The pool at one moment: ``total``, ``used`` and ``free`` bytes, the live ``tenants``
    (by slot) and the dead ones this call ``reaped``; on a ledger open read-only
    (``read_only``), the dead ones are left in, among ``tenants`` and in ``dead``."""

    path: str
    total: int
    used: int
    free: int
    default_limit: int
    slots: int
    tenants: Tuple[TenantStatus, ...]
    reaped: Tuple[Reaped, ...]
    dead: Tuple[Reaped, ...] = ()
    read_only: bool = False

    def tenant(self, name: str) -> Optional[TenantStatus]:
        """The live tenant ``name``, or ``None``."""
        return next((t for t in self.tenants if t.name == name), None)


@dataclasses.dataclass(frozen=True)
class LimitChange:
    """What :meth:`Pool.set_limit` changed: tenant ``name``'s limit from ``old`` to ``new``
    bytes, its ``usage`` then (above ``new``: it shrinks), the limit's ``revision`` now."""

    name: str
    old: int
    new: int
    usage: int
    revision: int


@dataclasses.dataclass(frozen=True)
class FloorChange:
    """What :meth:`Pool.set_floor` changed: tenant ``name``'s floor from ``old`` to ``new``
    bytes, its ``usage`` then, and the live tenants' ``floors`` together now."""

    name: str
    old: int
    new: int
    usage: int
    floors: int


def _tenant(d: dict) -> TenantStatus:
    return TenantStatus(**{f.name: d[f.name] for f in dataclasses.fields(TenantStatus)})


class Pool:
    """An open pool ledger: made by :func:`create` or :func:`open`. Opening one joins
    nothing; its tenants are the processes whose caches joined (:class:`Join`)."""

    def __init__(self, rs: Any) -> None:
        self._rs = rs
        info = rs.info()
        self.path: str = info["path"]
        self.total: int = info["total"]
        self.slots: int = info["slots"]
        self.default_limit: int = info["default_limit"]

    def status(self) -> PoolStatus:
        """The pool now; dead tenants are taken out first (listed in ``reaped``), or, on a
        ledger open read-only, listed in ``dead`` and left in."""
        d = self._rs.status()
        return PoolStatus(path=d["path"], total=d["total"], used=d["used"], free=max(0, d["total"] - d["used"]),
                          default_limit=d["default_limit"], slots=d["slots"],
                          tenants=tuple(_tenant(t) for t in d["tenants"]),
                          reaped=tuple(Reaped(**r) for r in d["reaped"]),
                          dead=tuple(Reaped(**r) for r in d["dead"]), read_only=d["read_only"])

    def set_limit(self, tenant: str, limit: Limit) -> LimitChange:
        """Sets live tenant ``tenant``'s limit: bytes, ``"12G"`` or ``"25%"`` of the total. A
        tenant above its new limit gets no new page until it is under it (a vmem cache
        shrinks: :meth:`vmem.KVCache.shrink_to_limit`); a raised limit applies at once."""
        if not isinstance(tenant, str) or not tenant:
            raise PoolError(f"invalid pool setting: tenant must be a name (a non-empty string), got {short(tenant)}")
        return LimitChange(**self._rs.set_limit(tenant, _limit("limit", limit)))

    def set_floor(self, tenant: str, floor: Limit) -> FloorChange:
        """Sets live tenant ``tenant``'s floor: bytes, ``"4G"``, ``"25%"`` of the total, or ``0``
        (none). The pool keeps that much room for it while it holds less, even while it is idle:
        the other tenants' new pages that would eat into it are refused. Refused above the
        tenant's limit, or when the floors would sum past the pool's total; a tenant holding
        more than its floor is not affected (a floor only limits the others' growth)."""
        if not isinstance(tenant, str) or not tenant:
            raise PoolError(f"invalid pool setting: tenant must be a name (a non-empty string), got {short(tenant)}")
        return FloorChange(**self._rs.set_floor(tenant, _floor("floor", floor)))

    def reap(self) -> Tuple[Reaped, ...]:
        """Takes tenants whose process died out of the pool; returns them."""
        return tuple(Reaped(**r) for r in self._rs.reap())

    def __repr__(self) -> str:
        return f"Pool(path={self.path!r}, total={self.total}, slots={self.slots})"


def create(path: Any = None, *, size: Optional[Union[int, str]] = None, reserve: Union[int, str] = "2G",
           backend: str = "cuda", device: int = 0, slots: int = 64, default_limit: Optional[Limit] = None,
           group: Optional[Union[str, int]] = None) -> Pool:
    """Creates a pool ledger at ``path`` (default :func:`default_ledger`), never replacing
    anything there, as ``vmem pool create``: ``size`` bytes (``"60G"``), or the free memory
    of ``backend`` (``"cuda"``, ``"uvm"``, ``"host"``) device ``device`` less ``reserve``;
    ``slots`` tenants at most (1 to 1024); ``default_limit`` for tenants that join without
    one (default: the whole pool); ``group`` (a name or a number) may join and change limits
    (mode 0660; owner-only, 0600, without)."""
    # Past 64 bits cannot cross into Rust, which checks the range (1 to 1024) itself.
    slots_n, device_n = integer(slots), integer(device)  # NumPy integers too
    if slots_n is None or not 0 <= slots_n < 2**64:
        raise PoolError(f"invalid pool setting: slots must be an int from 1 to 1024, got {short(slots)}")
    if device_n is None or not 0 <= device_n < 2**31:
        raise PoolError(f"invalid pool setting: device must be a GPU ordinal (an int >= 0), got {short(device)}")
    slots, device = slots_n, device_n
    if not isinstance(backend, str):
        raise PoolError(f"invalid pool setting: backend must be 'cuda', 'uvm' or 'host', got {short(backend)}")
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
        raise PoolError(f"invalid pool setting: group must be a group name or number, got {short(group)}")
    rs = _vmem.Pool.create(
        _path(path), size=None if size is None else _size("size", size), reserve=_size("reserve", reserve),
        backend=backend, device=device, slots=slots,
        default_limit=None if default_limit is None else _limit("default_limit", default_limit),
        group=None if group is None else str(group))
    return Pool(rs)


def open(path: Any = None, *, read_only: bool = False) -> Pool:  # noqa: A001 - pool.open, as its users read it
    """Opens the pool ledger at ``path`` (default :func:`default_ledger`); ``read_only``: for
    reading only (a monitor that must never write), as a ledger on a filesystem mounted
    read-only is opened anyway: :meth:`Pool.status` works, every change raises
    :class:`vmem.PoolError`."""
    try:
        reading = check_bool("read_only", read_only)
    except InvalidArgument as e:
        raise PoolError(f"invalid pool setting: {e}") from None
    return Pool(_vmem.Pool.open(_path(path), reading))


@dataclasses.dataclass(frozen=True)
class Join:
    """How a cache joins a pool: as tenant ``tenant`` (a name no live tenant has), with
    ``limit`` (bytes, ``"12G"`` or ``"25%"``; ``None``: the pool's default limit) and ``floor``
    (room kept for it even while idle, as :meth:`Pool.set_floor`; ``None``: none), in the
    ledger at ``ledger`` (``None``: :func:`default_ledger`, read when the ``Join`` is made).
    Validated when made; frozen. ``vmem.KVCache(..., pool=Join(...))`` or ``pool="name"``."""

    tenant: str
    limit: Optional[Limit] = None
    ledger: Optional[str] = None
    floor: Optional[Limit] = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant.strip():
            raise PoolError("invalid pool setting: tenant must be a name (a non-empty string), "
                            f"got {short(self.tenant)}")
        if len(self.tenant.encode()) > MAX_NAME or not all(c.isascii() and (c.isalnum() or c in "._-")
                                                             for c in self.tenant):
            raise PoolError(f"invalid pool setting: tenant name {short(self.tenant)} must be 1 to {MAX_NAME} bytes of "
                            "letters, digits, '.', '_' and '-' (the ledger's rule)")
        if self.limit is not None:
            _limit("limit", self.limit)
        if self.floor is not None:
            _floor("floor", self.floor)
        if self.limit is not None and self.floor is not None:
            _floor_within_limit(self.tenant, _floor("floor", self.floor), _limit("limit", self.limit))
        object.__setattr__(self, "ledger", _path(self.ledger))

    @classmethod
    def of(cls, value: Any) -> Optional["Join"]:
        """``value`` as a :class:`Join`: ``None`` (no pool), a ``Join``, or a tenant name."""
        if value is None or isinstance(value, Join):
            return value
        if isinstance(value, str):
            return cls(value)
        raise PoolError(f"invalid pool setting: pool must be a vmem.pool.Join or a tenant name, got {short(value)}")

    def args(self) -> Tuple[str, Optional[str], Optional[str], str]:
        """What the Rust module takes: ``(tenant, limit, floor, ledger)``."""
        assert self.ledger is not None
        return (self.tenant, None if self.limit is None else _limit("limit", self.limit),
                None if self.floor is None else _floor("floor", self.floor), self.ledger)
