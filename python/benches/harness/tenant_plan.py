"""What the multi-tenant bench (multitenant_bench.py) serves: its three tenants (model shape,
trace, which rows of it), its two scenarios, and each tenant's arrivals replayed from the Azure
traces with their timestamps.

The two bundled traces overlap in time (conversation 18:15:46-18:22:50, code 18:17:03-18:31:17
on 2023-11-16). A window is a span of that shared clock: ``start_s`` seconds after the earliest
first request of the traces used, ``window_s`` long. Every tenant takes the requests of its trace
in the window (the ``part``-th of every ``parts`` rows, so two tenants on one trace split its
traffic instead of repeating it), and replays them ``time_scale`` times faster: a request at
trace time ``t`` arrives ``(t - window start) / time_scale`` seconds after the run's start.

* ``bursty``: every tenant replays the same window (the code trace's bursts hit its tenants at
  once, the conversation tenant stays steady);
* ``staggered``: the same arrivals, tenant ``i``'s shifted ``i * stagger_s`` seconds later, so
  the tenants' busy spans follow each other (same work, demand peaking at different times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.trace import TRACES, load_trace, trace_path  # noqa: F401 (TRACES: the traces a tenant names)

#: the scenarios, in the order a run serves them
SCENARIOS = ("bursty", "staggered")
#: rows a bundled trace holds (its first 2,000 requests)
TRACE_ROWS = 2000


@dataclass(frozen=True)
class TenantSpec:
    """One tenant: its name (also its name in the pool), model shape and layers
    (:data:`harness.models.TENANT_SHAPES`), trace (:data:`TRACES`), the ``part``-th of every
    ``parts`` rows of it, and the seed of its weights and prompt ids."""

    name: str
    shape: str
    layers: int
    trace: str
    part: int = 0
    parts: int = 1
    seed: int = 0


#: the three tenants: Llama-3-8B shapes x 8 layers on the conversation trace; Llama-3.2-1B
#: shapes x 16 layers and Qwen2.5-7B shapes x 8 layers splitting the code trace's bursts
TENANTS = (
    TenantSpec("llama8b-conv", "llama3-8b", 8, "conv", seed=1),
    TenantSpec("llama1b-code", "llama3.2-1b", 16, "code", part=0, parts=2, seed=2),
    TenantSpec("qwen7b-code", "qwen2.5-7b", 8, "code", part=1, parts=2, seed=3),
)


@dataclass(frozen=True)
class Arrival:
    """One request of a tenant's replay: seconds after the run's start, prompt tokens, and its
    row in the trace."""

    at_s: float
    prompt_len: int
    row: int


@dataclass(frozen=True)
class Window:
    """The replayed span (trace seconds after the traces' common origin), its speed-up, the
    prompt cap, the most requests per tenant (``None``: all in the window) and the staggered
    scenario's shift (run seconds; ``None``: the window's run length, so no two overlap)."""

    start_s: float
    window_s: float
    time_scale: float
    max_prompt: int
    max_requests: int | None = None
    stagger_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("window_s", "time_scale"):
            if not getattr(self, name) > 0:  # NaN included
                raise ValueError(f"{name} must be more than 0, got {getattr(self, name)}")
        if not self.start_s >= 0:
            raise ValueError(f"start_s must be at least 0, got {self.start_s}")
        if self.max_prompt < 1 or (self.max_requests is not None and self.max_requests < 1):
            raise ValueError(f"max_prompt and max_requests must be at least 1, got {self.max_prompt}, "
                             f"{self.max_requests}")
        if self.stagger_s is not None and not self.stagger_s >= 0:
            raise ValueError(f"stagger_s must be at least 0, got {self.stagger_s}")

    @property
    def shift_s(self) -> float:
        """The staggered scenario's shift between consecutive tenants, in run seconds."""
        return self.window_s / self.time_scale if self.stagger_s is None else self.stagger_s


def arrivals(tenants: tuple[TenantSpec, ...], window: Window, scenario: str,
             paths: dict[str, str] | None = None) -> list[list[Arrival]]:
    """Each tenant's arrivals in ``scenario`` (:data:`SCENARIOS`), in time order. ``paths``
    maps a trace name to its file (default :func:`trace_path`). A tenant left with no request
    in the window, or an unknown scenario, is a ValueError."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (known: {SCENARIOS})")
    names = sorted({t.trace for t in tenants})
    rows = {n: load_trace((paths or {}).get(n) or trace_path(n), TRACE_ROWS, window.max_prompt, timestamps=True)
            for n in names}
    origin = min(rs[0].timestamp or 0.0 for rs in rows.values())
    lo, hi = origin + window.start_s, origin + window.start_s + window.window_s
    out: list[list[Arrival]] = []
    for i, t in enumerate(tenants):
        shift = i * window.shift_s if scenario == "staggered" else 0.0
        picked = [r for r in rows[t.trace] if r.timestamp is not None and lo <= r.timestamp < hi
                  and r.index % t.parts == t.part]
        picked = picked[:window.max_requests]
        if not picked:
            raise ValueError(f"tenant {t.name}: no request of trace {t.trace!r} in the window "
                             f"[{window.start_s}, {window.start_s + window.window_s}) s")
        out.append([Arrival(shift + ((r.timestamp or 0.0) - lo) / window.time_scale, r.prompt_len, r.index)
                    for r in picked])
    return out


def floor_bytes(text: str, total: int, tenants: int) -> int:
    """``--floor`` in bytes: a fraction of the pool's ``total`` (``"1/6"``), a share (``"15%"``)
    or a size (``"256M"``). Refused (ValueError, saying why) when it is not above 0 or the
    ``tenants`` floors together would pass the total."""
    import vmem

    t = text.strip()
    try:
        if "/" in t:
            num, den = (int(x) for x in t.split("/"))
            if num <= 0 or den <= 0:
                raise ValueError
            floor = total * num // den
        elif t.endswith("%"):
            share = float(t[:-1])
            if not math.isfinite(share):
                raise ValueError
            floor = int(total * share / 100)
        else:
            floor = vmem.parse_bytes(t)
    except (ValueError, vmem.VmemError):
        raise ValueError(f"{text!r} is not a fraction of the pool (1/6), a share (15%) or a size (256M)") from None
    if floor <= 0:
        raise ValueError(f"{text!r} is no room: a floor is above 0 bytes")
    if floor * tenants > total:
        raise ValueError(f"{text!r}: {tenants} floors of {floor} bytes pass the pool's {total} bytes")
    return floor
