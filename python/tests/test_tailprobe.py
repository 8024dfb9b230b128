"""The profile's tail probes (python/benches/harness/tailprobe.py): what they record per round,
that they come off again, and the slowest-rounds listing."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch", reason="the probes wrap torch's calls")
from harness import tailprobe  # noqa: E402
from harness.hostclock import HookClock  # noqa: E402


def _round(clock: HookClock) -> None:
    """Opens a round on ``clock`` and gives it a decode forward of one request."""
    clock.round_starts(lambda *a: None)()
    batch = {"cu_seq_lens_q": torch.tensor([0, 1]), "input_ids": torch.zeros(1, 1, dtype=torch.long)}
    clock.round_kind(lambda runner, model, data: None)(None, None, batch)


def test_the_probes_file_their_calls_under_the_open_round_and_come_off() -> None:
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    before = list(gc.callbacks)
    with HookClock() as clock:
        tailprobe.attach(clock)
        assert torch.Tensor.item is not item
        _round(clock)
        torch.ones(2).sum().item()
        torch.ones(3).tolist()
        gc.collect()
        _round(clock)  # files the first, opens a second with no probe call
        clock.close_round()
    assert torch.Tensor.item is item and torch.Tensor.tolist is tolist and "item" not in torch.Tensor.__dict__
    assert gc.callbacks == before
    first, second = (r.get("extra", {}) for r in clock.rounds)
    assert first["sync_n"] == 2 and first["sync_ms"] >= 0
    assert first["gc_n"] >= 1 and first["gc_ms"] > 0
    assert "sync_n" not in second and "gc_n" not in second
    torch.ones(1).item()  # off again: no round, no probe, no error
    assert len(clock.rounds) == 2


def test_the_cpu_probe_tells_a_busy_host_from_a_waiting_one() -> None:
    import time

    with HookClock() as clock:
        tailprobe.attach(clock)
        _round(clock)
        end = time.thread_time() + 0.03
        while time.thread_time() < end:  # busy: 30 ms of the thread's own CPU, however long that takes
            pass
        _round(clock)
        time.sleep(0.03)  # waiting: no CPU, a voluntary switch
        _round(clock)
    clock.close_round()
    busy, waiting = (r["extra"] for r in clock.rounds[:2])
    assert busy["thread_ms"] >= 30 and busy["process_ms"] >= busy["thread_ms"] - 0.5  # read a moment apart
    assert waiting["thread_ms"] < 10 and waiting["waits"] >= 1
    assert "cpu thread" in tailprobe._describe(clock.rounds[0])
    # the last round, closed from another thread than the one that opened it, gets no counters
    import threading

    with HookClock() as other:
        tailprobe.attach(other)
        _round(other)
        t = threading.Thread(target=other.close_round)
        t.start()
        t.join()
    assert "thread_ms" not in other.rounds[0].get("extra", {})


def _r(kind: str, ms: float, **extra: float) -> dict:
    return {"kind": kind, "wall_ns": int(ms * 1e6), "hooks": {"compute": int(ms * 0.9e6)}, "sequences": 6,
            "extra": extra, "calls": {}}


def test_slowest_lists_the_slowest_rounds_with_what_came_before_them() -> None:
    rounds = [_r("decode", 3.0, replay_ms=0.1, replay_n=1) for _ in range(600)]
    rounds[10] = _r("prefill", 55.0)
    rounds[11] = _r("decode", 30.0, replay_ms=0.1, replay_n=1, sync_ms=27.5, sync_n=1, device_alloc=2)
    rounds[300] = _r("decode", 20.0, gc_ms=17.0, gc_n=1)
    text = tailprobe.slowest(rounds)
    lines = text.splitlines()
    assert lines[0].startswith("slowest 17 of 599 decode rounds")  # 3 %
    assert "replay_ms 0.1" in lines[1] and "replay_n 1" in lines[1] and "sync" not in lines[1]
    assert lines[2].startswith("  round 11 (after prefill 55.00 ms): wall 30.00 ms")
    assert "sync 27.50 ms/1" in lines[2] and "device_alloc +2" in lines[2]
    assert lines[3].startswith("  round 300 (after decode 3.00 ms): wall 20.00 ms") and "gc 17.00 ms/1" in lines[3]
    assert len(lines) == 2 + 17
    assert len(tailprobe.slowest(rounds[:100]).splitlines()) == 2 + 5  # at least 5
    assert tailprobe.slowest(rounds, kind="prefill", count=1).splitlines()[-1].startswith("  round 10 ")
    assert tailprobe.slowest([], kind="decode") == "slowest decode rounds: none"


class _WaitingKV:
    """A KVCache stand-in whose step waits ``wait_s`` for another thread (counted as vmem counts
    it, in ``step_waits()``) and then maps for ``map_s``."""

    def __init__(self, wait_s: float, map_s: float) -> None:
        self.wait_s, self.map_s, self.waited_ns = wait_s, map_s, 0

    def step(self, lengths: list[int]) -> tuple[int, int, int]:
        import time

        time.sleep(self.wait_s + self.map_s)
        self.waited_ns += int(self.wait_s * 1e9)
        return (1, 0, 0)

    def step_waits(self) -> tuple[int, int]:
        return (1 if self.waited_ns else 0, self.waited_ns)


def test_the_mapping_step_is_filed_with_the_part_it_waited_and_comes_off() -> None:
    import threading
    from types import SimpleNamespace

    tenancy = pytest.importorskip("vmem.transformers.tenancy")
    step = tenancy.Tenant.__dict__["step"]
    kv = _WaitingKV(wait_s=0.03, map_s=0.02)
    tenant = tenancy.Tenant(kv, SimpleNamespace(lengths=[5]), threading.Lock(), blocks=4, block_bytes=1,
                            idle_after=None)
    with HookClock() as clock:
        tailprobe.attach(clock)
        _round(clock)
        tenant.step()
        _round(clock)
        clock.close_round()
    assert tenancy.Tenant.__dict__["step"] is step
    first, second = (r.get("extra", {}) for r in clock.rounds)
    assert first["vmem_step_n"] == 1 and first["vmem_wait_n"] == 1
    assert first["vmem_wait_ms"] == pytest.approx(30.0)
    assert 50.0 <= first["vmem_step_ms"] < 500.0
    assert "vmem_step_n" not in second
    line = tailprobe.slowest(clock.rounds[:1] * 5).splitlines()[2]
    assert "vmem_step 5" in line and "vmem_wait 30.00 ms/1" in line
