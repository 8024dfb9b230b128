"""FlashInfer's ``plan()`` stages a plan in a pinned buffer and copies it to the device on the
stream asynchronously; :class:`vmem.kernels.buffers.StagedPlans` makes the next plan into the same
staging buffer wait until that copy has run. Here: the guard itself (with a stand-in CUDA event,
so it runs on the CPU), and the order its two users keep, the wait before each plan and the mark
after it, per IO pair: the graph wrappers of ``kernel="flashinfer"`` and the fi-paged peer
(:class:`~vmem.kernels.fi_graphs.WrapperSet`), and ``prompt_reader="flashinfer"``
(:class:`~vmem.kernels.fa_prompts.PromptReader`).

Without the wait, an engine that runs a round eagerly and then captures its graph plans twice
before the GPU reaches the first plan's copy, and the eager round's kernels read the capture's
plan: on an H100 (transformers 5.17, the peer's eager rounds on FlashInfer's Hopper prefill, its
graph rounds on fa2) the engine's warm-up failed with an illegal memory access."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from vmem.kernels import buffers  # noqa: E402
from vmem.kernels import fa_prompts, fi_graphs  # noqa: E402
from vmem.kernels import flashinfer as vk_fi  # noqa: E402


class FakeEvent:
    """``torch.cuda.Event``'s two calls the guard makes, logged."""

    log: list = []

    def record(self, stream=None):
        assert stream == ("stream of", torch.device("cuda")), "recorded on the device's current stream"
        FakeEvent.log.append(("record", id(self)))

    def synchronize(self):
        FakeEvent.log.append(("synchronize", id(self)))


@pytest.fixture
def fake_events(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    return FakeEvent.log


def test_a_plan_waits_for_the_copy_of_the_last_plan_of_its_key_only(fake_events):
    staged = buffers.StagedPlans(torch.device("cuda"))
    staged.wait(0)  # nothing staged yet: nothing to wait for
    assert fake_events == []
    staged.record(0)
    first = fake_events[-1][1]
    staged.wait(1)  # another key's buffer: no wait
    assert fake_events == [("record", first)]
    staged.wait(0)
    assert fake_events[-1] == ("synchronize", first)
    staged.record(0)
    second = fake_events[-1][1]
    assert second != first
    staged.wait(0)
    assert fake_events[-1] == ("synchronize", second)  # the newest plan's copy, not the older one's


def test_off_cuda_nothing_is_recorded_or_waited_for(fake_events):
    staged = buffers.StagedPlans(torch.device("cpu"))
    staged.record(0)
    staged.wait(0)
    assert fake_events == []


class Recorder:
    """A :class:`StagedPlans` stand-in logging each call with the plans made so far. (The stream a
    mark lands on is the guard's own test's, above: here the CPU runs no stream.)"""

    def __init__(self, plans_made):
        self.calls, self.plans_made = [], plans_made

    def wait(self, key):
        self.calls.append(("wait", key, self.plans_made()))

    def record(self, key):
        self.calls.append(("record", key, self.plans_made()))


def _expected(pairs):
    out = []
    for i, pair in enumerate(pairs):
        out += [("wait", pair, i), ("record", pair, i + 1)]
    return out


def test_the_wrapper_set_waits_before_each_plan_and_marks_it_after(monkeypatch):
    from fake_flashinfer import FakeFlashInfer

    fake = FakeFlashInfer()
    recorders = []
    monkeypatch.setattr(fi_graphs, "StagedPlans",
                        lambda device: recorders.append(Recorder(lambda: len(fake.planned_inside))) or recorders[-1])
    ws = fi_graphs.WrapperSet(fake.module, torch.device("cpu"), 1024, 6, 2, 8, torch.float32, eager_prefill="fa3")
    pairs = [0, 0, 1, 0]
    # An eager round, then the same round planned for its graph on the same pair (the engine's
    # capture after an eager pass), then the other pair, then pair 0 again.
    eager = vk_fi.paged_plan([(3, 10, 5)], 48)
    graphed = fi_graphs.padded_paged_plan([(3, 10, 5)], 48, trash_row=6, trash_tokens=48, tokens=8, sequences=2)
    for pair, (plan, graph) in zip(pairs, [(eager, False), (graphed, True), (eager, False), (graphed, True)]):
        ws.plan(plan, pair=pair, graph=graph, scale=0.3)
    assert recorders[0].calls == _expected(pairs)


def test_the_prompt_reader_waits_before_each_plan_and_marks_it_after(monkeypatch):
    from fake_flashinfer import FakeFlashInfer

    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    monkeypatch.setattr(vk_fi, "kernels_on", lambda device: True)
    recorders = []
    monkeypatch.setattr(fa_prompts, "StagedPlans",
                        lambda device: recorders.append(Recorder(lambda: len(fake.planned_inside))) or recorders[-1])
    reader = fa_prompts.PromptReader(128, torch.device("cpu"), 8, 2, 16, torch.float32)
    pairs = [1, 1, 0, 1]
    for pair in pairs:
        reader.plan([(0, 3, 5), (2, 0, 6)], pair=pair, scale=0.5)
    assert recorders[0].calls == _expected(pairs)
